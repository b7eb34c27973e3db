"""Does ``torch.compile`` close the routed model's gap to its FLOPs ideal? Dense and
routed twins, each eager and compiled, side by side: a prefill, then greedy decoding.

    OMP_NUM_THREADS=2 python benchmarks/compiled_speed.py --threads 2 --retention 0.81

On two CPU threads the shipped variant's prefill (seq 1024, batch 1) reaches 0.78-0.87
of its FLOPs ideal eager (``lab/NOTEBOOK.md`` §4.2-4.4) and its decoding runs at
~0.87x dense: a routed layer runs ~213 top-level ATen ops against dense's 62 (router,
selection, gathers and scatters, the skip path, the skipped tokens' keys and values),
each paying dispatch. Inductor fuses the elementwise ones. Routing's data-dependent
shapes (``nonzero`` of the kept mask) break the graph once per routed layer
(``--capture-nonzero`` asks dynamo to trace them instead); ``dynamic=True`` keeps one
compilation for every prompt length and kept count, and dynamo's default recompile limit
holds (``tests/test_compile.py``): what a user who writes ``torch.compile(model,
dynamic=True)`` gets.

Builds the quality study's variant as ``benchmarks/kept_attention.py`` does (rank-64
ridge skip path, skipped tokens' keys/values, skip-error routers, layer 0 dense, no
alignment: speed depends on kept counts only), saves it and loads dense and routed twins
from that checkpoint (``load_pair``). Each twin is compiled with ``torch.compile(model,
dynamic=True)`` (its ``forward``); compilation and a warm-up come before the timing.
Per repeat, in shuffled order: the four arms.

- Prefill: the first ``--seq-len`` test-split tokens, batch 1, without a KV cache
  (``use_cache=False``, the scoring case: perplexity, lm-eval), last-token logits.
- Decoding (``--decode-tokens``; 0, the default, skips it): after a
  ``--decode-prompt``-token prefill (not timed), seconds per greedy step with the KV
  cache, as ``adadsf bench`` times it. Compiled, both twins recompile at every step
  until dynamo's recompile limit (the ``DynamicCache``'s key tensors change their
  strides as they grow), then run eager: compiled decoding needs a static cache (not
  tried with the routed layers).

Prints median latencies, the routed/dense speedups eager and compiled, their fractions
of the FLOPs ideal (counted on the eager routed model's own kept tokens), each compiled
twin's largest last-token logit difference from its eager self (compilation must not
change the model beyond bfloat16 rounding, which dense's difference shows), and how many
greedy tokens the compiled routed model shares with the eager one.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer


def table(title: str, med: dict[str, float], ideal: float, unit: str) -> None:
    print(f"{title}\n| mode | dense | routed | speedup | / ideal |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("eager", "compiled"):
        d, r = med[f"dense {mode}"], med[f"routed {mode}"]
        print(f"| {mode} | {d * 1e3:.1f} {unit} | {r * 1e3:.1f} {unit} | "
              f"{d / r:.3f}x | {d / r / ideal:.3f} |")  # fmt: skip
    d = med["dense eager"] / med["routed compiled"]
    print(
        f"compiled routed against eager dense: {d:.3f}x ({d / ideal:.3f} of the ideal)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--retention", type=float, default=0.81)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=0, help="0: no decoding")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--capture-nonzero", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.decode_tokens < 0:
        p.error("--repeats must be >= 1 and --decode-tokens >= 0")
    if args.decode_tokens and not 0 < args.decode_prompt <= args.seq_len:
        p.error("--decode-prompt must be in [1, --seq-len]")

    from _common import interleaved, temporary_routed_checkpoint, variant_fields

    from adadsf_lab.study.measure import TokenStreams
    from adadsf_modifier.evaluation import resolve_model
    from adadsf_modifier.evaluation.speed import _decode_flops, _decode_loop, load_pair
    from adadsf_modifier.flops import normalized_flops

    torch.set_num_threads(args.threads)
    if args.capture_nonzero:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    path = resolve_model(args.model)
    checkpoint = temporary_routed_checkpoint(
        path, "adadsf-compiled-speed-", args.retention, variant_fields()
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
    setting = (f"{args.dtype}, retention {args.retention}, {torch.get_num_threads()} "
               f"threads, torch {torch.__version__}")  # fmt: skip

    def prefill(model) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t, out.logits

    logits = {}
    for name, model in arms.items():  # compilation, then a warm-up
        first, logits[name] = prefill(model)
        prefill(model)
        print(f"# {name} prefill: first call {first:.1f} s", flush=True)
    # compiled kernels round differently in bfloat16: dense's difference is that floor
    diff = {
        twin: (logits[f"{twin} compiled"] - logits[f"{twin} eager"]).abs().max().item()
        for twin in ("dense", "routed")
    }
    med = interleaved({k: lambda m=m: prefill(m)[0] for k, m in arms.items()},
                      args.repeats)  # fmt: skip
    ideal = 1.0 / normalized_flops(routed, {"input_ids": ids}).normalized
    title = (
        f"# prefill seq {args.seq_len}, batch 1, {setting}; FLOPs ideal {ideal:.3f}x; "
        "compiled against eager, largest last-token logit difference: dense "
        f"{diff['dense']:.3g}, routed {diff['routed']:.3g}"
    )
    table(title, med, ideal, "ms")
    if not args.decode_tokens:
        return 0

    prompt = ids[:, : args.decode_prompt]
    fed: dict[str, list[torch.Tensor]] = {}

    def decode(name: str) -> float:
        seconds, fed[name] = _decode_loop(arms[name], prompt, args.decode_tokens)
        return seconds

    for name, model in arms.items():  # the cached path's compilation, a warm-up
        t = time.perf_counter()
        decode(name)
        print(
            f"# {name} decoding: first run {time.perf_counter() - t:.1f} s", flush=True
        )
    med = interleaved({k: lambda k=k: decode(k) for k in arms}, args.repeats)
    ideal = 1.0 / _decode_flops(routed, prompt, fed["routed eager"])[0].normalized
    same = sum(
        int(torch.equal(a, b))
        for a, b in zip(fed["routed compiled"], fed["routed eager"])
    )
    table(f"# decoding {args.decode_tokens} greedy steps after a {args.decode_prompt}-"
          f"token prompt, batch 1, {setting}; FLOPs ideal {ideal:.3f}x; the compiled "
          f"routed model's tokens equal the eager one's at {same} of "
          f"{args.decode_tokens} steps", med, ideal, "ms/step")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
