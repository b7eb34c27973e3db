"""Does ``torch.compile`` close the routed prefill's gap to its FLOPs ideal? Dense and
routed twins, each eager and compiled, side by side.

    OMP_NUM_THREADS=2 python benchmarks/compiled_prefill.py --threads 2 --retention 0.81

On two CPU threads the shipped variant's prefill (seq 1024, batch 1) reaches 0.78-0.87
of its FLOPs ideal eager (``docs/measurements.md`` §4.2-4.4): a routed layer runs ~213
top-level ATen ops against dense's 62 (router, selection, gathers and scatters, the skip
path, the skipped tokens' keys and values), each paying dispatch. Inductor fuses the
elementwise ones. Routing's data-dependent shapes (``nonzero`` of the kept mask) break
the graph once per routed layer (``--capture-nonzero`` asks dynamo to trace them
instead); ``dynamic=True`` keeps one compilation for every prompt length and kept count,
and dynamo's default recompile limit holds (``tests/test_compile.py``): what a user who
writes ``torch.compile(model, dynamic=True)`` gets.

Builds the quality study's variant as ``benchmarks/kept_attention.py`` does (rank-64
ridge skip path, skipped tokens' keys/values, skip-error routers, layer 0 dense, no
alignment: speed depends on kept counts only), saves it and loads dense and routed twins
from that checkpoint (``load_pair``). Each twin is compiled with ``torch.compile(model,
dynamic=True)`` (its ``forward``); compilation and a warm-up run come before the timing.
Every arm runs without a KV cache (``use_cache=False``): a fresh cache object per call
makes the compiled dense model recompile on every call.
Per repeat, in shuffled order: the four arms. Prints median prefill latencies, the
routed/dense speedup eager and compiled, their fractions of the FLOPs ideal, and each
compiled twin's largest last-token logit difference from its eager self (compilation
must not change the model beyond bfloat16 rounding, which dense's difference shows).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoTokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--retention", type=float, default=0.81)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--capture-nonzero", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    from _common import temporary_routed_checkpoint, variant_fields

    from adadsf_modifier.evaluation import resolve_model
    from adadsf_modifier.evaluation.speed import load_pair
    from adadsf_modifier.flops import normalized_flops
    from adadsf_modifier.study.measure import TokenStreams

    torch.set_num_threads(args.threads)
    if args.capture_nonzero:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    path = resolve_model(args.model)
    checkpoint = temporary_routed_checkpoint(
        path, "adadsf-compiled-prefill-", args.retention, variant_fields()
    )
    # the first seq_len tokens of the test split (only the documents they need)
    ids = TokenStreams(AutoTokenizer.from_pretrained(path)).get("test", args.seq_len)
    ids = ids.view(1, -1)
    dense, routed = load_pair(checkpoint, dtype=getattr(torch, args.dtype))
    arms = {
        "dense eager": dense,
        "routed eager": routed,
        "dense compiled": torch.compile(dense, dynamic=True),
        "routed compiled": torch.compile(routed, dynamic=True),
    }

    def run(model) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t, out.logits

    logits = {}
    for name, model in arms.items():  # compilation, then a warm-up
        first, logits[name] = run(model)
        run(model)
        print(f"# {name}: first call {first:.1f} s", flush=True)
    # compiled kernels round differently in bfloat16: dense's difference is that floor
    diff = {
        twin: (logits[f"{twin} compiled"] - logits[f"{twin} eager"]).abs().max().item()
        for twin in ("dense", "routed")
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = list(arms)
        rng.shuffle(order)
        for k in order:
            times[k].append(run(arms[k])[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    ideal = 1.0 / normalized_flops(routed, {"input_ids": ids}).normalized
    print(f"# prefill seq {args.seq_len}, batch 1, {args.dtype}, retention "
          f"{args.retention}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; FLOPs ideal {ideal:.3f}x; compiled against eager, "
          f"largest last-token logit difference: dense {diff['dense']:.3g}, routed "
          f"{diff['routed']:.3g}")  # fmt: skip
    print("| mode | dense | routed | speedup | / ideal |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("eager", "compiled"):
        d, r = med[f"dense {mode}"], med[f"routed {mode}"]
        print(f"| {mode} | {d * 1e3:.0f} ms | {r * 1e3:.0f} ms | {d / r:.3f}x | "
              f"{d / r / ideal:.3f} |")  # fmt: skip
    d = med["dense eager"]
    print(f"compiled routed against eager dense: {d / med['routed compiled']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
