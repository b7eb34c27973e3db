"""Alignment wall-clock with and without ``align_teacher_cache``, side by side.

    OMP_NUM_THREADS=2 python benchmarks/teacher_cache.py            # embedded SmolLM2
    OMP_NUM_THREADS=2 python benchmarks/teacher_cache.py --epochs 3 --repeats 3

Builds AdaDSF (no alignment) once, reloads the routed student from its checkpoint for
every run (so each run starts from the same weights) and a dense teacher from the base
model, then times ``align_model`` over ``--epochs`` epochs of the same rows with the
cache off and on, interleaved, and prints the median times, their ratio, how many
batches the teacher ran, and how far the two runs' losses are apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trainable", default="routers_and_layers")
    args = p.parse_args(argv)
    if args.rows % args.batch_size:
        p.error("--rows must be a multiple of --batch-size (whole epochs)")

    from _common import temporary_routed_checkpoint

    import adadsf_modifier
    from adadsf_modifier.alignment import AlignmentConfig, align_model
    from adadsf_modifier.evaluation import calibration_dataset, resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    checkpoint = temporary_routed_checkpoint(
        path, "adadsf-teacher-cache-", args.retention
    )
    data = calibration_dataset(tok, args.rows, args.seq_len)
    steps = args.epochs * args.rows // args.batch_size
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    teacher.requires_grad_(False)

    times: dict[bool, list[float]] = {False: [], True: []}
    last = {}
    for _ in range(args.repeats):
        for cached in (False, True):
            student = adadsf_modifier.from_pretrained(checkpoint, dtype=torch.float32)
            cfg = AlignmentConfig(
                align_steps=steps,
                align_lr=1e-4,
                align_batch_size=args.batch_size,
                align_seq_len=args.seq_len,
                align_trainable=args.trainable,
                align_teacher_cache=cached,
            )
            t0 = time.perf_counter()
            report = align_model(student, teacher, data, cfg, show_progress=False)
            times[cached].append(time.perf_counter() - t0)
            last[cached] = report
            del student
    off, on = (statistics.median(times[c]) for c in (False, True))
    gap = max(abs(a - b) for a, b in zip(last[False].losses, last[True].losses))
    print(
        f"# teacher cache, {steps} steps ({args.epochs} epochs of {args.rows} rows x "
        f"{args.seq_len} tokens, batch {args.batch_size}), {args.trainable}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"cache off: {off:8.1f} s  ({off / steps:.2f} s/step)")
    print(
        f"cache on:  {on:8.1f} s  ({on / steps:.2f} s/step; the teacher ran on "
        f"{last[True].teacher_batches} of {steps} batches)"
    )
    print(f"speedup {off / on:.3f}x; largest per-step loss difference {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
