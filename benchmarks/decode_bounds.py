"""A decoding step's bounds: the routed twin with every token running and with every
token skipping, beside the dense twin and the routed twin as calibrated.

``every token runs`` (thresholds at -inf) is the dense model plus the routing's own
cost (router, the decision's host sync, bookkeeping); ``every token skips`` (+inf) is
the floor a step reaches when no layer but the first runs (each skipped token still
computes its keys/values and skip path). A mode whose decisions are shared by a
batch's rows runs each step at one of these two costs, so at kept share ``r`` its step
costs about ``r * runs + (1 - r) * skips`` -- the bound such a mode could reach at
batch 8 without building it. ``routed, router free`` is the routed twin as calibrated
with every router replaying the scores it gave in an untimed run of the same prompt
(:func:`routers_replaying`): the same decisions, skip paths and kept tokens' layers,
without the router's own ops -- the bound on what a cheaper router could buy.

Config-shaped twins with random weights, the shipped structure and thresholds fitted
to keep ``--retention`` (``shape_speed.build_twins``); greedy steps after a prompt of
128 tokens (one prompt for every arm), the arms interleaved in a shuffled order,
medians.

    OMP_NUM_THREADS=2 python benchmarks/decode_bounds.py --batch 1 8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from _common import interleaved, thresholds_at
from shape_speed import SHAPES, build_twins

from adadsf_modifier.routing import routed_layers


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def step_seconds(
    model: torch.nn.Module, prompt: torch.Tensor, steps: int, device: str
) -> float:
    """Mean seconds of a greedy decoding step after an untimed ``prompt``."""
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    return (time.perf_counter() - start) / steps


def router_scores(model: torch.nn.Module, run: Callable[[], float]) -> list:
    """Each routed layer's router outputs, in call order, over one untimed ``run``."""
    layers = routed_layers(model)
    recorded: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.router.register_forward_hook(
            lambda _m, _a, out, into=into: into.append(out)
        )
        for layer, into in zip(layers, recorded)
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return recorded


@contextmanager
def routers_replaying(model: torch.nn.Module, recorded: list) -> Iterator[None]:
    """Every routed layer's router returns, call by call, the scores
    :func:`router_scores` recorded (the run repeated must make the same calls): the
    routed step as calibrated with the router's arithmetic taken out, its decisions,
    skip paths and kept tokens' layers unchanged -- what a router costing nothing could
    reach."""
    layers = routed_layers(model)
    try:
        for layer, outs in zip(layers, recorded):
            replay = iter(outs)
            layer.router.forward = lambda _h, replay=replay: next(replay)
        yield
    finally:
        for layer in layers:
            layer.router.__dict__.pop("forward", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--retention", type=float, default=0.81)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="CPU intra-op threads")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, routed = build_twins(
        args.shape, args.retention, torch.bfloat16, 64, device=args.device
    )
    print(f"{args.shape}, bfloat16, {args.device}, {args.threads} threads, retention "
          f"{args.retention} forced")  # fmt: skip
    vocab = dense.config.vocab_size
    for batch in args.batch:
        # one prompt for every arm, so the replayed arm's recorded scores are its own
        prompt = torch.randint(0, vocab, (batch, args.prompt), device=args.device)

        def timed(model, threshold=None, replay=None):
            def run() -> float:
                with thresholds_at(model, threshold):
                    if replay is None:
                        return step_seconds(model, prompt, args.steps, args.device)
                    with routers_replaying(model, replay):
                        return step_seconds(model, prompt, args.steps, args.device)

            return run

        scores = router_scores(routed, timed(routed))
        arms = {
            "dense": timed(dense),
            "routed": timed(routed),
            "routed, router free": timed(routed, replay=scores),
            "every token runs": timed(routed, float("-inf")),
            "every token skips": timed(routed, float("inf")),
        }
        medians = interleaved(arms, args.repeats)
        shared = (
            args.retention * medians["every token runs"]
            + (1 - args.retention) * medians["every token skips"]
        )
        cells = [
            f"{name} {m * 1e3:.1f} ms ({medians['dense'] / m:.3f}x)"
            for name, m in medians.items()
        ]
        print(f"batch {batch}: " + ", ".join(cells))
        print(
            f"  a shared-decision mode's bound at {args.retention}: "
            f"{shared * 1e3:.1f} ms ({medians['dense'] / shared:.3f}x dense)"
        )


if __name__ == "__main__":
    main()
