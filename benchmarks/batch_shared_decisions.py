"""What would decisions shared by a batch's rows cost in quality?

A batched decoding step on a memory-bound device reads every weight of a layer once
whether 8 rows or 6 of them run it, so per-token decisions save little at batch 8 (a
layer is skipped for the whole batch only when every row skips it). A mode in which a
layer runs for all rows of a step or for none would save a whole layer's reads per
skipped step. Before building (and training) such a mode, this probe measures what
sharing the decisions costs a routed checkpoint as it is, teacher-forced on the test
split's prose, in batches of ``--batch`` rows whose position ``t`` stands for one
decoding step:

- ``per-token``: each row's own top ``r`` tokens per layer (``topk`` mode);
- ``shared (mean score)``: every row runs the positions whose router score, averaged
  over the batch's rows, is in the top ``r`` (the same positions for every row);
- ``shared (random)``: the same number of positions, drawn at random and shared;
- ``causal``: the checkpoint's calibrated thresholds (what inference runs today);
- ``every token runs``: each routed layer at retention 1 (the dense model's depth).

Every variant but ``causal`` keeps exactly each layer's retention ratio, so they
differ only in which tokens run. Float32, perplexity over every predicted token.

    python benchmarks/batch_shared_decisions.py /tmp/rank_ckpt --rows 64 --seq-len 256
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import contextmanager

import torch
from _common import load_routed, retention_ratios, row_perplexity
from loguru import logger

from adadsf_lab.study.measure import TokenStreams
from adadsf_modifier.routing import routed_layers, set_routing_mode


@contextmanager
def scores_as(model: torch.nn.Module, transform: Callable | None):
    """Every routed layer's router scores passed through ``transform`` (``None``:
    unchanged)."""
    routers = [layer.router for layer in routed_layers(model)]
    if transform is not None:
        for router in routers:
            router.forward = (lambda f: lambda h: transform(f(h)))(router.forward)
    try:
        yield
    finally:
        for router in routers:
            router.__dict__.pop("forward", None)


def batch_mean(scores: torch.Tensor) -> torch.Tensor:
    """Each position's score averaged over the batch's rows, for every row."""
    return scores.mean(0, keepdim=True).expand_as(scores)


def shared_random(generator: torch.Generator) -> Callable:
    def draw(scores: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(1, scores.shape[1], generator=generator)
        return noise.to(scores).expand_as(scores)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a routed checkpoint folder")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.rows % args.batch:
        parser.error("--rows must be a multiple of --batch")
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer, model = load_routed(args.checkpoint)
    stream = TokenStreams(tokenizer).text("test (prose)", args.rows * args.seq_len)
    rows = stream[: args.rows * args.seq_len].view(args.rows, args.seq_len)
    generator = torch.Generator().manual_seed(args.seed)
    variants = {
        "per-token": ("topk", None),
        "shared (mean score)": ("topk", batch_mean),
        "shared (random)": ("topk", shared_random(generator)),
        "causal": ("causal", None),
        "every token runs": ("causal", "dense"),
    }
    results = {}
    for name, (mode, transform) in variants.items():
        set_routing_mode(model, mode)
        dense = transform == "dense"
        with (
            scores_as(model, None if dense else transform),
            # every routed layer at retention 1: it runs as the dense layer
            retention_ratios(model, (lambda r: 1.0) if dense else None),
        ):
            results[name] = row_perplexity(model, rows, args.batch)
        logger.info(f"{name}: PPL {results[name]:.2f}")
    print(f"{args.rows} rows of {args.seq_len} test-prose tokens, batches of "
          f"{args.batch}, float32")  # fmt: skip
    for name, ppl in results.items():
        ratio = ppl / results["per-token"]
        print(f"{name:<22} PPL {ppl:8.2f}  ({ratio:.3f}x per-token)")


if __name__ == "__main__":
    main()
