"""What should a skipped token get? SmolLM2-135M, no alignment, validation perplexity
against measured normalized FLOPs.

Rows (each a fresh ``oneshot`` of ``AdaDSFModifier`` on the dense model, layer 0 dense
as in ``recipes/adadsf_w8a8.yaml``, the same calibration rows and seed):

* ``dense``                 - the unmodified model
* ``identity``              - paper-faithful AdaDSF (a skipped token passes unchanged)
* ``ridge``                 - ``skip_path: ridge`` (full rank, fit on the tokens each
  router skips, on the routed model's own activations, layer by layer)
* ``ridge_r64``             - the same at ``skip_path_rank: 64``
* ``ridge_auto`` / ``ridge_r64_auto`` / ``ridge_r32`` - ``skip_path_ridge: auto`` (per
  layer penalty by two-fold held-out error), and a lower rank
* ``ridge_r64_kv_auto_err``  - ``ridge_r64_kv_auto`` with ``router_init: skip_error``
  (each router refit to its skip path's relative error, the path refit after)
* ``kv``                    - ``skipped_tokens_kv: true`` (identity skip path)
* ``ridge_kv`` / ``ridge_r64_kv`` (``_auto``) - both
* ``layer_drop_<d>``        - ``allocation: layer_drop`` removing ``d`` whole layers
  (ShortGPT, no healing): rows at several ``d`` bracket every variant's FLOPs, so each
  can be compared with layer removal at matched measured FLOPs
* ``layer_drop_<d>_ridge``  - the same, removed layers replaced by a full-rank ridge
  map (LLM-Streamline-style); ``layer_drop_<d>_ridge_auto``: penalty chosen per layer
* ``<method>_upper``        - ``identity`` (or another routed method) routing only the
  upper half of the layers (Router-Tuning's choice), the rest dense
* ``<method>@<r>``          - any routed method at retention ``r`` instead of
  ``--retention`` (e.g. ``identity@0.8``)
* ``<method>[@<r>]:<field>=<value>[:...]`` - any row with modifier fields set on top
  (values read as YAML), e.g. ``ridge_r64_kv_auto_err@0.81:beta=30`` (a steeper
  allocation) or ``...:temperature=0.1:min_retention=0.3``

Every row is evaluated in causal routing (the eval-mode default): perplexity over the
first ``--ppl-tokens`` tokens of the ``validation`` split in non-overlapping windows of
``--ppl-max-length`` tokens (METHOD.md's setting: dense 34.46), and normalized FLOPs
(:func:`~adadsf_modifier.flops.stream_flops`, decoder stack, routers, skip paths
and skipped tokens' keys/values included) measured on the same validation tokens, in
rows of ``--ppl-max-length`` tokens, ``--flops-batch`` rows per forward (before
2026-12-01: on the first ``--flops-batch`` rows only, ``lab/NOTEBOOK.md`` §12).

``--align-steps N --align-rows ROWS`` (with ``--methods`` naming the variant) adds
alignment (``align_trainable: routers_and_layers``, KL + hidden loss) to every routed
row; its ``ridge`` rows then refit their skip paths after alignment.

Example (about 3 minutes of CPU per row on one core)::

    OMP_NUM_THREADS=1 python benchmarks/skip_paths.py --out outputs/skip_paths.json
    OMP_NUM_THREADS=1 python benchmarks/skip_paths.py \
        --methods dense,identity@0.8,kv@0.75 --out outputs/targets.json

Not a test: it needs the embedded model assets (see ASSETS.md) and CPU minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

ROUTED = {
    "identity": {},
    "ridge": {"skip_path": "ridge"},
    "ridge_r64": {"skip_path": "ridge", "skip_path_rank": 64},
    "kv": {"skipped_tokens_kv": True},
    "ridge_kv": {"skip_path": "ridge", "skipped_tokens_kv": True},
    "ridge_r64_kv": {"skip_path": "ridge", "skip_path_rank": 64,
                     "skipped_tokens_kv": True},
    "ridge_auto": {"skip_path": "ridge", "skip_path_ridge": "auto"},
    "ridge_r64_auto": {"skip_path": "ridge", "skip_path_rank": 64,
                       "skip_path_ridge": "auto"},
    "ridge_r32": {"skip_path": "ridge", "skip_path_rank": 32},
    "ridge_kv_auto": {"skip_path": "ridge", "skip_path_ridge": "auto",
                      "skipped_tokens_kv": True},
    "ridge_r64_kv_auto": {"skip_path": "ridge", "skip_path_rank": 64,
                          "skip_path_ridge": "auto", "skipped_tokens_kv": True},
    "ridge_r64_kv_auto_err": {"skip_path": "ridge", "skip_path_rank": 64,
                              "skip_path_ridge": "auto", "skipped_tokens_kv": True,
                              "router_init": "skip_error"},
}  # fmt: skip
DEFAULT_METHODS = (
    "dense,identity,ridge,ridge_r64,kv,ridge_kv,"
    "ridge_r64_kv,layer_drop_5,layer_drop_6,layer_drop_7,layer_drop_6_ridge"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--ppl-max-length", type=int, default=512)
    p.add_argument("--ppl-stride", type=int, default=512)
    p.add_argument("--flops-batch", type=int, default=4)
    p.add_argument("--align-steps", type=int, default=0)
    p.add_argument("--align-rows", type=int, default=64)
    p.add_argument("--align-lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def _modifier_kwargs(method: str, args: argparse.Namespace, num_layers: int) -> dict:
    method, _, fields = method.partition(":")
    if fields:  # the row's own fields on top of what its name sets
        import yaml

        pairs = (f.partition("=") for f in fields.split(":"))
        extra = {k.strip(): yaml.safe_load(v) for k, _, v in pairs}
        return {**_modifier_kwargs(method, args, num_layers), **extra}
    method, _, at = method.partition("@")
    kw: dict[str, Any] = {
        "retention": float(at) if at else args.retention,
        "ignore": ["re:.*layers\\.0$"],
        "seed": args.seed,
    }
    if method.startswith("layer_drop_"):
        parts = method.split("_")
        dropped = int(parts[2])
        routed = num_layers - 1
        # floor(r * routed) layers kept: the smallest r keeping routed - dropped
        kw.update(allocation="layer_drop", retention=(routed - dropped) / routed)
        if "ridge" in parts:
            kw.update(skip_path="ridge")  # every token skips a removed layer
        if "auto" in parts:
            kw.update(skip_path_ridge="auto")
        return kw
    if method.endswith("_upper"):  # route the upper half of the layers only
        method = method.removesuffix("_upper")
        kw["ignore"] = [
            f"re:.*layers\\.({'|'.join(map(str, range(num_layers // 2)))})$"
        ]
    kw.update(ROUTED[method])
    if args.align_steps:
        kw.update(align_steps=args.align_steps, align_lr=args.align_lr,
                  align_trainable="routers_and_layers", align_batch_size=4,
                  align_seq_len=args.calib_seq_len)  # fmt: skip
    return kw


def build_model(method: str, args, env: dict) -> tuple[Any, Any, dict]:
    """``(model, modifier, fields)`` of a row: the dense model (modifier None) or a
    fresh ``oneshot`` of ``AdaDSFModifier`` with the row's fields on it."""
    import torch
    from compressed_tensors.offload import remove_dispatch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from adadsf_modifier import AdaDSFModifier

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(env["path"], dtype=torch.float32)
    if method == "dense":
        return model, None, {}
    kw = _modifier_kwargs(method, args, model.config.num_hidden_layers)
    mod = AdaDSFModifier(**kw, align_dataset=env.get("align"))
    oneshot(model=model, processor=env["tok"], dataset=env["calib_rows"],
            recipe=[mod], num_calibration_samples=args.calib_samples,
            max_seq_length=args.calib_seq_len)  # fmt: skip
    remove_dispatch(model, onload_tensors=True)
    return model, mod, kw


def run_method(method: str, args, env: dict) -> dict[str, Any]:
    from adadsf_lab.study.measure import measure_perplexity
    from adadsf_modifier.flops import stream_flops

    t0 = time.perf_counter()
    model, mod, kw = build_model(method, args, env)
    row: dict[str, Any] = {"method": method}
    if mod is not None:
        row["settings"] = {k: v for k, v in kw.items() if k != "ignore"}
        if mod.skip_path_report is not None:
            row["skip_r2"] = mod.skip_path_report.r2
        row["compress_s"] = time.perf_counter() - t0
    model.eval()
    val = env["val"]
    res = measure_perplexity(model, val, args.ppl_max_length, args.ppl_stride,
                             "causal")  # fmt: skip
    row["ppl_val"] = res["ppl"]
    # FLOPs on the perplexity's own tokens (causal routing's share depends on the text)
    rep = stream_flops(model, val, args.ppl_max_length, args.flops_batch)
    row["normalized_flops"] = rep.normalized
    routed = sorted(rep.routed_layers) or range(1, len(rep.kept))
    real = sum(rep.seq_lens)
    # measured mean fraction of real tokens running each routed (sub-)block
    row["kept_fraction"] = sum(sum(rep.kept[i]) for i in routed) / (len(routed) * real)
    row["flops_by_term"] = {
        k: v / rep.dense for k, v in rep.routed_by_term.items() if v
    }
    row["seconds"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from adadsf_lab.study.measure import TokenStreams
    from adadsf_modifier.evaluation import calibration_dataset, embedded_model_path

    args = parse_args(argv)
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rows = calibration_dataset(tok, args.calib_samples, args.calib_seq_len,
                               seed=args.seed)  # fmt: skip
    env = {
        "path": path,
        "tok": tok,
        "calib_rows": rows,
        "val": TokenStreams(tok).get("validation", args.ppl_tokens),
    }
    if args.align_steps:
        env["align"] = calibration_dataset(tok, args.align_rows, args.calib_seq_len,
                                           seed=args.seed + 1)  # fmt: skip
    out = []
    for method in args.methods.split(","):
        row = run_method(method.strip(), args, env)
        out.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": out}, f, indent=1)
    print(f"\n{'method':<22} {'PPL val':>9} {'norm. FLOPs':>12} {'kept':>6}")
    for r in out:
        ppl = r["ppl_val"]
        kept = r.get("kept_fraction", 1.0)
        print(f"{r['method']:<22} {ppl if math.isfinite(ppl) else float('nan'):>9.2f} "
              f"{r['normalized_flops']:>12.4f} {kept:>6.3f}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
