"""Offline evaluation: the embedded model and text, perplexity; lm-eval tasks
(``lm_eval_tasks``), one model's record (``evaluate``), the speed bench (``speed``)."""

from adadsf_modifier.evaluation.asset_cache import CACHE_ENV_VAR, default_cache_root
from adadsf_modifier.evaluation.embedded_model import embedded_model_path, resolve_model
from adadsf_modifier.evaluation.perplexity import (
    PerplexityResult,
    perplexity,
    sliding_windows,
)
from adadsf_modifier.evaluation.text_splits import (
    SPLIT_FRACTIONS,
    calibration_dataset,
    load_text_splits,
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
