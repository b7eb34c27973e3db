"""Does a routed checkpoint keep its budget on text unlike its calibration set?

For each offline text (the project's test split without Shakespeare, the test split's
Shakespeare, the calibration split: the study's ``BUDGET_TEXTS``) and each routing mode
(``causal``: calibrated thresholds; ``rank``: each token in the top ``r`` of its row so
far), the routed layers' kept share of the real tokens that reached them, beside the
share their retention ratios plan (``KeptShare``):

- prefill: consecutive rows of ``--seq-len`` tokens (``stream_flops``);
- decode: ``--prompts`` prompts of ``--prompt-len`` tokens (taken after the prefill
  tokens), ``--new-tokens`` greedy steps, every step counted as ``adadsf bench`` counts
  it (``decode_kept_share``).

The study runs the same check on every routed run at fixed sizes
(``adadsf_lab.study.measure.measure_budget_per_text``); this is it for one checkpoint,
at the sizes you choose.

    python benchmarks/budget_drift.py /tmp/rank_ckpt --tokens 4096
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import load_routed

from adadsf_lab.study.measure import (
    BUDGET_MODES,
    TokenStreams,
    measure_budget_per_text,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a routed checkpoint folder")
    parser.add_argument("--tokens", type=int, default=4096, help="prefill tokens/text")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="prefill rows per forward")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer, model = load_routed(args.checkpoint)
    sizes = {
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    with torch.inference_mode():
        got = measure_budget_per_text(
            model, TokenStreams(tokenizer), args.batch, sizes, BUDGET_MODES
        )
    head = ("text", "mode", "prefill kept", "decode kept", "target")
    print(f"{head[0]:<20} {head[1]:<7} {head[2]:>12} {head[3]:>12} {head[4]:>7}")
    for text, modes in got["texts"].items():
        for mode, r in modes.items():
            print(
                f"{text:<20} {mode:<7} {r['prefill_kept']:>12.3f} "
                f"{r['decode_kept']:>12.3f} {r['target']:>7.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **got}, f, indent=1)


if __name__ == "__main__":
    main()
