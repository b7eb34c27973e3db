"""Does a routed checkpoint keep its budget on text unlike its calibration set?

For each offline text (the project's test split without Shakespeare, the test split's
Shakespeare, the calibration split) and each routing mode (``causal``: calibrated
thresholds; ``rank``: each token in the top ``r`` of its row so far), the routed
layers' kept share of the real tokens that reached them, beside the share their
retention ratios plan (``KeptShare``):

- prefill: consecutive rows of ``--seq-len`` tokens (``stream_flops``);
- decode: ``--prompts`` prompts of ``--prompt-len`` tokens (taken after the prefill
  tokens), ``--new-tokens`` greedy steps, every step counted as ``adadsf bench`` counts
  it (the same tokens replayed through ``normalized_flops``).

    python benchmarks/budget_drift.py /tmp/rank_ckpt --tokens 4096
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from loguru import logger

import adadsf_modifier
from adadsf_modifier.evaluation.assets import load_text_splits
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.evaluation.speed import _decode_flops, _decode_loop
from adadsf_modifier.flops import stream_flops
from adadsf_modifier.routing import set_routing_mode

MODES = ("causal", "rank")


def text_streams(tokenizer: Any, tokens: int) -> dict[str, torch.Tensor]:
    """``{name: 1-D token stream}`` of at least ``tokens`` tokens each (documents
    joined with a blank line, as the calibration set and perplexity join them); only
    as many documents as needed are tokenized."""
    splits = load_text_splits()
    sources = {
        "test (prose)": (splits["test"], lambda s: s != "shakespeare"),
        "test (Shakespeare)": (splits["test"], lambda s: s == "shakespeare"),
        "calibration": (splits["calibration"], lambda s: True),
    }
    streams = {}
    for name, (split, keep) in sources.items():
        ids: list[int] = []
        for text, source in zip(split["text"], split["source"]):
            if not keep(source):
                continue
            ids += tokenizer(("\n\n" if ids else "") + text)["input_ids"]
            if len(ids) >= tokens:
                break
        if len(ids) < tokens:
            logger.warning(f"{name}: only {len(ids)} tokens offline")
        streams[name] = torch.tensor(ids[:tokens], dtype=torch.long)
    return streams


@torch.inference_mode()
def measure(
    model: torch.nn.Module,
    stream: torch.Tensor,
    prompts: torch.Tensor,
    seq_len: int,
    new_tokens: int,
) -> dict[str, float | None]:
    """Kept share in prefill and in decoding under the model's current mode."""
    prefill = KeptShare(model)
    prefill.add(stream_flops(model, stream, seq_len))
    _, fed = _decode_loop(model, prompts, new_tokens)
    decode = _decode_flops(model, prompts, fed).share
    return {
        "prefill_kept": prefill.fraction,
        "decode_kept": decode.fraction,
        "target": prefill.target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a routed checkpoint folder")
    parser.add_argument("--tokens", type=int, default=4096, help="prefill tokens/text")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = adadsf_modifier.from_pretrained(args.checkpoint, dtype=torch.float32)
    model.eval()
    need = args.tokens + args.prompts * args.prompt_len
    rows = []
    for name, stream in text_streams(tokenizer, need).items():
        prompts = stream[args.tokens : need].view(args.prompts, args.prompt_len)
        for mode in MODES:
            set_routing_mode(model, mode)
            got = measure(
                model, stream[: args.tokens], prompts, args.seq_len, args.new_tokens
            )
            rows.append({"text": name, "mode": mode, **got})
            logger.info(f"{name} / {mode}: {got}")
    head = ("text", "mode", "prefill kept", "decode kept", "target")
    print(f"{head[0]:<20} {head[1]:<7} {head[2]:>12} {head[3]:>12} {head[4]:>7}")
    for r in rows:
        print(
            f"{r['text']:<20} {r['mode']:<7} {r['prefill_kept']:>12.3f} "
            f"{r['decode_kept']:>12.3f} {r['target']:>7.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
