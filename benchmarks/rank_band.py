"""How wide should rank routing's band be? Budget per text and perplexity per slack.

Rank routing (``routing/rank.py`` ``choose_by_rank``) runs a token that ranks in
the top ``r`` of its row so far, unless the row's count of tokens that ran the layer
would leave ``r * p`` +- ``RANK_SLACK`` tokens. A narrow band holds the budget on
short continuations; a wide one leaves the router more of the choice. For each
``--slacks`` value (``none``: no band, the rank alone) this measures, on one routed
checkpoint in float32:

- the kept share on every offline text, prefill and decoding, in rank mode (the
  study's check, ``adadsf_lab.study.measure.measure_budget_per_text``, at the study's
  sizes for ``--seq-len 512``);
- teacher-forced perplexity on ``--rows`` rows of ``--ppl-len`` test-prose tokens, and
  the kept share on those rows.

A narrower band keeps fewer tokens than the rank alone where scores rise along the
row, and fewer tokens cost perplexity by themselves, so ``--offsets`` also runs the
rank alone with every routed layer's ratio lowered by each offset: perplexity against
kept share without the band, the line to read the banded rows against. ``--causal``
adds causal routing (the calibrated thresholds) and ``--raise`` the band at its
default slack with every routed ratio raised by each value: the band at the share
causal routing spends, to compare the two at equal compute.

    python benchmarks/rank_band.py /tmp/rank_ckpt --slacks none 1 2 4 6 8 \
        --offsets 0.01 0.02
    python benchmarks/rank_band.py CKPT --slacks none 4 --offsets 0.01 --causal \
        --raise 0.02 0.04
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import torch
from _common import load_routed, retention_ratios, row_perplexity
from loguru import logger

from adadsf_lab.study.measure import TokenStreams, budget_sizes, measure_budget_per_text
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.flops import stream_flops
from adadsf_modifier.routing import (
    rank,
    routed_layers,
    routing_mode,
    set_routing_mode,
)

NO_BAND = 1 << 30  # a slack no row reaches: the rank alone decides


@contextmanager
def band_slack(slack: int):
    """Rank routing's band at ``slack`` tokens for the length of the block (the
    plug-in's constant, set and restored; its tables are keyed by it)."""
    before = rank.RANK_SLACK
    rank.RANK_SLACK = slack
    try:
        yield
    finally:
        rank.RANK_SLACK = before


def measure(model, streams, rows, args, mode: str = "rank") -> dict:
    got = measure_budget_per_text(
        model, streams, args.batch, budget_sizes(args.seq_len), (mode,)
    )
    ppl = row_perplexity(model, rows, args.batch)
    share = KeptShare(model)
    share.add(stream_flops(model, rows.reshape(-1), args.ppl_len, args.batch))
    texts = {name: modes[mode] for name, modes in got["texts"].items()}
    gap = max(
        abs(r[k] - r["target"])
        for r in texts.values()
        for k in ("prefill_kept", "decode_kept")
    )
    return {
        "ppl": ppl,
        "ppl_rows_kept": share.fraction,
        "largest_gap": gap,
        "texts": texts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a routed checkpoint folder")
    parser.add_argument("--slacks", nargs="+", default=["none", "2", "4", "8"])
    parser.add_argument("--offsets", nargs="*", type=float, default=[0.01, 0.02])
    parser.add_argument("--raise", dest="raises", nargs="*", type=float, default=[])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--ppl-len", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer, model = load_routed(args.checkpoint)
    set_routing_mode(model, "rank")
    streams = TokenStreams(tokenizer)
    n = args.rows * args.ppl_len
    stream = streams.text("test (prose)", n)
    if stream.numel() < n:
        parser.error(f"test prose has {stream.numel()} tokens, --rows x --ppl-len {n}")
    rows = stream[:n].view(args.rows, args.ppl_len)
    lowest = min(m.retention_ratio for m in routed_layers(model) if m.retention_ratio)
    if any(o >= lowest for o in args.offsets):
        parser.error(f"every offset must be below the lowest routed ratio {lowest}")
    slack_now = str(rank.RANK_SLACK)
    variants = (
        [("rank", s, 0.0) for s in args.slacks]
        + [("rank", "none", -o) for o in args.offsets]
        + [("rank", slack_now, o) for o in args.raises]
        + ([("causal", slack_now, 0.0)] if args.causal else [])
    )
    results = {}
    with torch.inference_mode():
        for mode, slack, change in variants:
            name = "causal" if mode == "causal" else f"slack {slack}"
            name += f", ratios {change:+g}" if change else ""
            with (
                band_slack(NO_BAND if slack == "none" else int(slack)),
                # every partly routed layer's ratio moved by the change (within 0..1)
                retention_ratios(
                    model, lambda r: min(max(r + change, 0.0), 1.0) if 0 < r < 1 else r
                ),
                routing_mode(model, mode),
            ):
                results[name] = measure(model, streams, rows, args, mode)
            logger.info(f"{name}: {results[name]}")
    first = next(iter(results.values()))
    texts = list(first["texts"])
    target = first["texts"][texts[0]]["target"]
    print(
        f"float32; PPL on {args.rows} x {args.ppl_len} test-prose "
        f"tokens; kept share prefill / decode per text (target {target:.3f})"
    )
    head = f"{'variant':<24} {'PPL':>7} {'kept':>6} {'gap':>6}"
    print(head + "".join(f"  {t:>20}" for t in texts))
    for name, r in results.items():
        cells = "".join(
            f"  {r['texts'][t]['prefill_kept']:>11.3f} / "
            f"{r['texts'][t]['decode_kept']:.3f}"
            for t in texts
        )
        row = f"{r['ppl']:>7.2f} {r['ppl_rows_kept']:>6.3f} {r['largest_gap']:>6.3f}"
        print(f"{name:<24} {row}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
