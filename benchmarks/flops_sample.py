"""How many test tokens a measured-FLOPs number needs: causal routing's FLOPs on the
first N test tokens, for growing N, and per 2,048-token slice (``lab/NOTEBOOK.md``
§12).

Causal routing keeps a token when its router score passes a threshold calibrated on
calibration text, so the share of tokens that run depends on the text; top-K routing
keeps a fixed share of every row. This prints both on the same tokens.

    OMP_NUM_THREADS=1 python benchmarks/flops_sample.py --checkpoint DIR

builds (once, into ``--checkpoint``) the quality study's routed variant without
alignment: ridge rank-64 skip path, skipped tokens' keys/values, routers fit to the
skip error, retention 0.79, 32 calibration rows of 512 tokens, bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _common import build_routed_checkpoint
from transformers import AutoTokenizer

from adadsf_lab.study.measure import TokenStreams
from adadsf_modifier.checkpoint import from_pretrained
from adadsf_modifier.evaluation import resolve_model
from adadsf_modifier.flops import FlopsReport, stream_flops
from adadsf_modifier.routing import routing_mode

VARIANT = dict(
    temperature=0.05,
    ignore=[r"re:.*layers\.0$"],
    skip_path="ridge",
    skip_path_rank=64,
    skip_path_ridge="auto",
    skipped_tokens_kv=True,
    router_init="skip_error",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="built here unless present")
    p.add_argument("--retention", type=float, default=0.79)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--slice", type=int, default=2048)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.tokens < a.slice or a.slice % 512:
        p.error("--slice must be a multiple of 512 and at most --tokens")
    path = resolve_model(None)
    if not os.path.exists(os.path.join(a.checkpoint, "adadsf_config.json")):
        build_routed_checkpoint(
            path, a.checkpoint, a.retention, 32, 512, torch.bfloat16, VARIANT
        )
    model = from_pretrained(a.checkpoint, dtype=torch.bfloat16).eval()
    stream = TokenStreams(AutoTokenizer.from_pretrained(path)).get("test", a.tokens)
    out: dict[str, dict] = {}
    for mode in ("causal", "topk"):
        with routing_mode(model, mode):
            slices = [
                stream_flops(model, stream[i : i + a.slice], 512)
                for i in range(0, stream.numel() - a.slice + 1, a.slice)
            ]
        first = {}
        n = 1
        while n <= len(slices):
            report = FlopsReport.combine(slices[:n])
            first[n * a.slice] = round(report.normalized, 4)
            n *= 2
        per_slice = [round(s.normalized, 4) for s in slices]
        out[mode] = {"first_n_tokens": first, "per_slice": per_slice}
        print(f"{mode}: first N test tokens {first}")
        print(f"{mode}: per {a.slice}-token slice min {min(per_slice)} max "
              f"{max(per_slice)}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
