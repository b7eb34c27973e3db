"""Prefill of a K/V-keeping variant in its three forms, against dense, side by side:
the compacted batch with the kept queries' attention in chunks (the default on one CPU
thread in bfloat16) or on the zero-padded causal kernel, and the attention on every
token with the MLP on the kept ones (``routed_layer.run_kept_mlp``, the default
elsewhere).

    OMP_NUM_THREADS=1 python benchmarks/kept_attention.py        # the quality variant
    OMP_NUM_THREADS=1 python benchmarks/kept_attention.py --seq-lens 1024 2048 \\
        --dtypes float32 bfloat16 --repeats 9
    OMP_NUM_THREADS=2 python benchmarks/kept_attention.py --threads 2 \\
        --dtypes bfloat16 --retention 0.81 --profile-threads 1 2  # ops per thread

Builds the quality study's variant (rank-64 ridge skip path, skipped tokens' keys and
values, skip-error routers, layer 0 dense; no alignment: speed depends on kept counts
only) with ``oneshot``, saves it and loads dense and routed twins from that checkpoint
(``load_pair``). Per repeat, in shuffled order: dense, routed with the kept queries in
chunks of at most ``kept_attention.CPU_QUERY_CHUNK`` (whatever the dtype), routed
with every kept query on the causal kernel (zero rows for the skipped ones), and
routed with its attention on every token. Prints median prefill latencies, speedups,
each speedup's fraction of the FLOPs ideal, and which path the package takes for that
dtype and thread count (``kept_attention.kept_queries_go_in_chunks``;
``lab/NOTEBOOK.md`` §4.2-4.3, §33).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoTokenizer


def _op_times(model, ids, repeats: int) -> dict[str, float]:
    """Self CPU time per operator (ms), median over ``repeats`` profiled prefills."""
    from torch.profiler import ProfilerActivity, profile

    runs: dict[str, list[float]] = {}
    for i in range(repeats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for ev in prof.key_averages():
            runs.setdefault(ev.key, [0.0] * repeats)[i] += ev.self_cpu_time_total / 1e3
    return {k: statistics.median(v) for k, v in runs.items()}


def _profile(dense, routed, ids, threads: list[int], repeats: int) -> None:
    """Operator table: each twin at each thread count side by side, the operators
    that take the routed model most time at the last thread count first."""
    cols, table = [], {}
    for n in threads:
        torch.set_num_threads(n)
        for name, model in (("dense", dense), ("routed", routed)):
            col = f"{name}@{n}"
            cols.append(col)
            for op, ms in _op_times(model, ids, repeats).items():
                table.setdefault(op, {})[col] = ms
    last = f"routed@{threads[-1]}"
    print(f"\n# self CPU ms per prefill (median of {repeats} profiled), seq "
          f"{ids.shape[1]}, {routed.dtype}")  # fmt: skip
    print("| operator | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    rows = sorted(table.items(), key=lambda kv: -kv[1].get(last, 0.0))
    for op, v in rows[:25]:
        cells = " | ".join(f"{v.get(c, 0.0):.1f}" for c in cols)
        print(f"| {op} | {cells} |")
    totals = " | ".join(
        f"{sum(v.get(c, 0.0) for v in table.values()):.0f}" for c in cols
    )
    print(f"| total | {totals} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--retention", type=float, default=0.79)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--profile-threads",
        type=int,
        nargs="*",
        default=[],
        help="after the timing: torch.profiler operator times (ms, median of the "
        "repeats) of dense and of the routed default path at each of these thread "
        "counts, side by side, to show which operators scale worse with threads",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    from _common import interleaved, temporary_routed_checkpoint, variant_fields

    from adadsf_lab.study.measure import TokenStreams
    from adadsf_modifier.evaluation import resolve_model
    from adadsf_modifier.evaluation.speed import load_pair
    from adadsf_modifier.flops import normalized_flops
    from adadsf_modifier.routing import RoutedLayer, kept_attention

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    checkpoint = temporary_routed_checkpoint(
        path, "adadsf-kept-attention-", args.retention, variant_fields()
    )
    # the test split's first tokens (only the documents the longest prompt needs)
    streams = TokenStreams(AutoTokenizer.from_pretrained(path))
    shipped = kept_attention.cpu_chunks_for
    every_token = RoutedLayer.attends_every_token
    rng = random.Random(0)
    print(f"# kept-queries attention, retention {args.retention}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")  # fmt: skip
    print("| seq | dtype | path | dense | routed | speedup | FLOPs ideal | / ideal |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes:
        dense, routed = load_pair(checkpoint, dtype=getattr(torch, dtype_name))
        for n in args.seq_lens:
            ids = streams.get("test", n).view(1, -1)

            def run(model, chunked: bool, compacted: bool = True) -> float:
                kept_attention.cpu_chunks_for = lambda dtype: chunked  # the arm decides
                RoutedLayer.attends_every_token = (
                    (lambda layer: False) if compacted else every_token
                )
                t = time.perf_counter()
                with torch.inference_mode():
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
                return time.perf_counter() - t

            arms = {
                "dense": (dense, False),
                "chunks": (routed, True),
                "causal kernel, zero rows": (routed, False),
                "attention on every token": (routed, False, False),
            }
            for arm in arms.values():  # warm-up
                run(*arm)
            med = interleaved(
                {k: lambda arm=arm: run(*arm) for k, arm in arms.items()},
                args.repeats,
                rng,
            )
            kept_attention.cpu_chunks_for = shipped
            RoutedLayer.attends_every_token = every_token
            if args.profile_threads:
                _profile(dense, routed, ids, args.profile_threads, args.repeats)
                torch.set_num_threads(args.threads)
            ideal = 1.0 / normalized_flops(routed, {"input_ids": ids}).normalized
            d = med["dense"]
            default = "chunks" if shipped(routed.dtype) else "attention on every"
            for k in list(arms)[1:]:
                r = med[k]
                mark = " (default)" if k.startswith(default) else ""
                print(f"| {n} | {dtype_name} | {k}{mark} | {d * 1e3:.0f} ms | "
                      f"{r * 1e3:.0f} ms | {d / r:.3f}x | {ideal:.3f}x | "
                      f"{d / r / ideal:.3f} |", flush=True)  # fmt: skip
        del dense, routed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
