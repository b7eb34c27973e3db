"""A decoding step's bounds: the routed twin with every token running and with every
token skipping, beside the dense twin and the routed twin as calibrated.

``every token runs`` (thresholds at -inf) is the dense model plus the routing's own
cost (router, the decision's host sync, bookkeeping); ``every token skips`` (+inf) is
the floor a step reaches when no layer but the first runs (each skipped token still
computes its keys/values and skip path). A mode whose decisions are shared by a
batch's rows runs each step at one of these two costs, so at kept share ``r`` its step
costs about ``r * runs + (1 - r) * skips`` -- the bound such a mode could reach at
batch 8 without building it.

Config-shaped twins with random weights, the shipped structure and thresholds fitted
to keep ``--retention`` (``shape_speed.build_twins``); greedy steps after a prompt of
128 tokens, the four variants interleaved in a shuffled order, medians.

    OMP_NUM_THREADS=2 python benchmarks/decode_bounds.py --batch 1 8
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import interleaved, thresholds_at
from shape_speed import SHAPES, build_twins


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def step_seconds(
    model: torch.nn.Module, batch: int, steps: int, prompt: int, device: str
) -> float:
    """Mean seconds of a greedy decoding step after an untimed prompt."""
    ids = torch.randint(0, 1000, (batch, prompt), device=device)
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    return (time.perf_counter() - start) / steps


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
    variants = {
        "dense": (dense, None),
        "routed": (routed, None),
        "every token runs": (routed, float("-inf")),
        "every token skips": (routed, float("inf")),
    }
    print(f"{args.shape}, bfloat16, {args.device}, {args.threads} threads, retention "
          f"{args.retention} forced")  # fmt: skip
    for batch in args.batch:

        def timed(model, threshold, batch=batch):
            def run() -> float:
                with thresholds_at(model, threshold):
                    return step_seconds(
                        model, batch, args.steps, args.prompt, args.device
                    )

            return run

        medians = interleaved(
            {name: timed(*variant) for name, variant in variants.items()}, args.repeats
        )
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
