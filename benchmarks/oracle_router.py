"""How much could a better router buy? The routed model of ``skip_paths.py`` (no
alignment) with its routers replaced by oracles that *know* each token's skip error.

For each routed layer below ratio 1, a forward pre-hook runs the layer densely on its
actual (routed) input ``x`` and scores every token by what skipping it would cost
there: ``|layer(x) - (x + skip_path(x))|`` (``abs``), the same divided by ``|x|``
(``rel``), or a random score (``random``, the floor). The layer then keeps its usual
share of tokens, per row (top-K routing), by that score. The oracle is greedy and
local: it sees the error this layer would make on its current input, not what the
error does to later layers, and the skip paths stay fitted on the tokens the learned
router skips. It is an upper bound on what the router can buy at this layer, not a
method (it runs every layer densely).

Rows per ``--methods`` entry (same grammar as ``skip_paths.py``): the learned router
in causal and in top-K routing, then each oracle in top-K routing; validation
perplexity over ``--ppl-tokens`` tokens in 512-token windows, as ``skip_paths.py``.

    OMP_NUM_THREADS=1 python benchmarks/oracle_router.py \
        --methods ridge_r64_kv_auto@0.8,identity@0.8 --out outputs/oracle_router.json

Not a test: it needs the embedded model assets and CPU minutes (about 10 per method).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import skip_paths  # noqa: E402  (the same model construction and data)

ORACLES = ("abs", "rel", "random")


class _OracleScores(nn.Module):
    """Stands in for a layer's router: returns the scores its hook just computed."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.scores is None or self.scores.shape != hidden_states.shape[:2]:
            raise RuntimeError("oracle scores missing for this input")
        return self.scores


def _skip_error(layer: Any, args: tuple, kwargs: dict, kind: str) -> torch.Tensor:
    """Per-token cost of skipping ``layer`` on its input (see the module docstring)."""
    x = args[0] if args else kwargs["hidden_states"]
    ratio = layer.retention_ratio
    layer.retention_ratio = 1.0  # run every token: the layer's own output
    try:
        y = layer(*args, **kwargs)
    finally:
        layer.retention_ratio = ratio
    y = y[0] if isinstance(y, tuple) else y
    skip = getattr(layer, "skip_path", None)
    skipped = x + skip(x) if skip is not None else x
    err = (y - skipped).float().norm(dim=-1)
    if kind == "rel":
        err = err / x.float().norm(dim=-1).clamp(min=1e-6)
    elif kind == "random":
        err = torch.rand_like(err)
    return err


@contextlib.contextmanager
def oracle_routers(model: nn.Module, kind: str):
    """Replace every partly routed layer's router by the ``kind`` oracle."""
    from adadsf_modifier.routing.routed_layer import routed_layers

    saved, handles = [], []
    for layer in routed_layers(model):
        if layer.retention_ratio >= 1.0 or layer.retention_ratio <= 0.0:
            continue
        oracle = _OracleScores()
        saved.append((layer, layer._modules["router"]))
        layer._modules["router"] = oracle

        def hook(mod, args, kwargs, oracle=oracle):
            if getattr(mod, "_oracle_busy", False):
                return  # the dense run inside the hook itself
            mod._oracle_busy = True
            try:
                with torch.no_grad():
                    oracle.scores = _skip_error(mod, args, kwargs, kind)
            finally:
                mod._oracle_busy = False

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for layer, router in saved:
            layer._modules["router"] = router


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    from transformers import AutoTokenizer

    from adadsf_lab.study.measure import TokenStreams, measure_perplexity
    from adadsf_modifier.evaluation import calibration_dataset, embedded_model_path
    from adadsf_modifier.flops import stream_flops

    args = skip_paths.parse_args(argv)
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    env = {
        "path": path,
        "tok": tok,
        "calib_rows": calibration_dataset(
            tok, args.calib_samples, args.calib_seq_len, seed=args.seed
        ),  # fmt: skip
    }
    val = TokenStreams(tok).get("validation", args.ppl_tokens)
    n = args.ppl_max_length
    out: dict[str, dict[str, float]] = {}
    for method in args.methods.split(","):
        model = skip_paths.build_model(method.strip(), args, env)[0].eval()
        flops = stream_flops(model, val, n, args.flops_batch).normalized
        row = {"normalized_flops_causal": flops}
        for mode in ("causal", "topk"):
            ppl = measure_perplexity(model, val, n, args.ppl_stride, mode)["ppl"]
            row[f"learned_{mode}"] = ppl
        for kind in ORACLES:
            with oracle_routers(model, kind):
                ppl = measure_perplexity(model, val, n, args.ppl_stride, "topk")["ppl"]
            row[f"oracle_{kind}_topk"] = ppl
            print(method, kind, ppl, flush=True)
        out[method] = row
        print(json.dumps({method: row}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": out},
                                                 indent=1))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
