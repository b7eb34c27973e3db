"""Does ranking layers by their measured loss rise (``importance: loss``) beat the
paper's cosine similarity (ShortGPT's Block Influence for layer removal)? The same
rows as ``benchmarks/skip_paths.py`` (SmolLM2-135M, no alignment, validation perplexity
against measured normalized FLOPs); a method name ending in ``_loss`` is that method
with ``importance: loss``, in ``_skiploss`` with ``importance: skip_path_loss`` (the
loss rise of replacing each layer by its fitted ridge map; ridge rows only), before any
``@<retention>``.

    OMP_NUM_THREADS=1 python benchmarks/importance.py --out outputs/importance.json
    OMP_NUM_THREADS=1 python benchmarks/importance.py --methods \\
        ridge_r64_kv_auto_err@0.81,ridge_r64_kv_auto_err_skiploss@0.81 \\
        --out outputs/skiploss.json

Not a test: it needs the embedded model assets and CPU minutes (~3-5 per row).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import skip_paths  # noqa: E402  (the sibling benchmark: its rows, data and measures)

DEFAULT_METHODS = (
    "layer_drop_5,layer_drop_5_loss,layer_drop_6,layer_drop_6_loss,"
    "layer_drop_6_ridge,layer_drop_6_ridge_loss,ridge_r64_kv_auto,ridge_r64_kv_auto_loss"
)

_kwargs = skip_paths._modifier_kwargs


_SUFFIXES = {"_skiploss": "skip_path_loss", "_loss": "loss"}


def _with_importance(method: str, args, num_layers: int) -> dict:
    name, at, retention = method.partition("@")
    for suffix, importance in _SUFFIXES.items():
        if name.endswith(suffix):
            base = name.removesuffix(suffix) + at + retention
            return {**_kwargs(base, args, num_layers), "importance": importance}
    return _kwargs(method, args, num_layers)


if __name__ == "__main__":
    skip_paths._modifier_kwargs = _with_importance
    argv = sys.argv[1:]
    if not any(a.startswith("--methods") for a in argv):
        argv = ["--methods", DEFAULT_METHODS, *argv]
    skip_paths.main(argv)
