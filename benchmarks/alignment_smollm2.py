"""Does the alignment stage recover dense quality? SmolLM2-135M, retention 0.8, held-out
perplexity.

Rows of the table (same calibration data, steps, learning rate and seed for every
trained row):

* ``dense``            - the unmodified model
* ``routed``           - AdaDSF routing without alignment (``align_steps=0``)
* ``aligned``          - alignment with KL + hidden-state terms (the paper's loss),
  ``--trainable``
* ``lm_only``          - alignment with the causal-LM loss only (the paper's ablation),
  same trainable set, steps, learning rate and seed as ``aligned``
* ``aligned_routers``  - KL + hidden alignment training the routers only
  (``--routers-lr``), to show what the cheap setting buys

Two perplexities per row: ``PPL top-k`` routes the top-K tokens of each window (the
routing the alignment trains, paper-style evaluation) and ``PPL causal`` uses the
model's eval-mode default (per-token thresholds calibrated after alignment, the mode
``generate()`` uses).

Perplexity is measured on the ``test`` split of
:func:`~adadsf_modifier.evaluation.load_text_splits` (disjoint from the calibration
split that calibration and alignment train on); use ``--split validation`` while
choosing hyper-parameters. Each method runs in its own subprocess so that "peak RSS" is
that method's own peak (``ru_maxrss`` only ever grows within a process) and one method's
allocations cannot slow the next.

Example (each aligned row ~10 minutes on 2 otherwise idle CPU cores)::

    python benchmarks/alignment_smollm2.py --steps 100 --lr 3e-4 --batch-size 4
    --seq-len 256

Not a test: it needs the embedded model assets (see ASSETS.md) and minutes of CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

METHODS = ("dense", "routed", "aligned", "lm_only", "aligned_routers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {METHODS}",
    )
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument(
        "--steps", type=int, default=100, help="alignment steps of every trained row"
    )
    p.add_argument(
        "--lr", type=float, default=3e-4, help="lr of the aligned and lm_only rows"
    )
    p.add_argument(
        "--routers-lr", type=float, default=3e-3, help="lr of the aligned_routers row"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="alignment row length")
    p.add_argument(
        "--trainable",
        default="routers_and_layers",
        choices=("routers", "routers_and_layers"),
        help="what the aligned and lm_only rows train",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 autocast during alignment (~2x faster on CPUs with avx512_bf16)",
    )
    p.add_argument(
        "--calib-samples", type=int, default=64, help="calibration (= training) rows"
    )
    p.add_argument("--calib-seq-len", type=int, default=None, help="default: --seq-len")
    p.add_argument("--split", default="test", choices=("test", "validation"))
    p.add_argument(
        "--eval-tokens", type=int, default=4096, help="tokens of held-out text scored"
    )
    p.add_argument("--eval-max-length", type=int, default=512)
    p.add_argument("--eval-stride", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--model", default=None, help="HF model folder (default: embedded SmolLM2)"
    )
    p.add_argument(
        "--json", default=None, help="also write all results to this JSON file"
    )
    p.add_argument("--run-method", default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_method(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """One row of the table, in this process."""
    import torch
    from llmcompressor import oneshot
    from loguru import logger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.evaluation import (
        calibration_dataset,
        embedded_model_path,
        load_text_splits,
        perplexity,
    )
    from adadsf_modifier.routing import routing_mode

    torch.set_num_threads(args.threads)
    path = args.model or embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    result: dict[str, Any] = {"method": method, "compress_s": 0.0, "align_s": 0.0}
    if method != "dense":
        align: dict[str, Any] = {}
        if method != "routed":
            align = dict(
                align_steps=args.steps,
                align_lr=args.routers_lr if method == "aligned_routers" else args.lr,
                align_batch_size=args.batch_size,
                align_seq_len=args.seq_len,
                align_trainable="routers"
                if method == "aligned_routers"
                else args.trainable,
                align_bf16=args.bf16,
                align_loss="lm" if method == "lm_only" else "kl_hidden",
            )
        modifier = AdaDSFModifier(retention=args.retention, seed=args.seed, **align)
        data = calibration_dataset(
            tokenizer, args.calib_samples, args.calib_seq_len, seed=args.seed
        )
        start = time.perf_counter()
        oneshot(
            model=model,
            recipe=[modifier],
            dataset=data,
            processor=tokenizer,
            num_calibration_samples=len(data),
            max_seq_length=args.calib_seq_len,
        )
        result["compress_s"] = time.perf_counter() - start
        report = modifier.alignment_report
        if report is not None:
            result.update(
                align_s=report.seconds,
                align_steps=report.steps,
                first_loss=report.first_loss,
                last_loss=report.last_loss,
                terms={k: [v[0], v[-1]] for k, v in report.terms.items()},
            )

    texts = load_text_splits(args.seed)[args.split]["text"]

    def score():
        return perplexity(
            model,
            tokenizer,
            texts,
            max_length=args.eval_max_length,
            stride=args.eval_stride,
            max_tokens=args.eval_tokens,
            batch_size=2,
            show_progress=False,
        )

    causal = (
        score()
    )  # the eval-mode default of a routed model (= plain dense for `dense`)
    if method == "dense":
        topk = causal
    else:
        with routing_mode(model, "topk"):
            topk = score()
    result.update(
        ppl_topk=topk.ppl,
        ppl_causal=causal.ppl,
        tokens=topk.tokens,
        peak_rss_mb=peak_rss_mb(),
    )
    logger.info(f"[{method}] {result}")
    return result


def print_table(
    args: argparse.Namespace, rows: list[dict[str, Any]], wall_s: float
) -> None:
    print()
    print(
        f"SmolLM2-135M, retention {args.retention}, PPL on {args.eval_tokens} tokens "
        f"of the {args.split} split (windows {args.eval_max_length}, stride "
        f"{args.eval_stride}); alignment {args.steps} steps x batch {args.batch_size} "
        f"x {args.seq_len} tokens, bf16={args.bf16}, seed {args.seed}; calibration "
        f"{args.calib_samples} x {args.calib_seq_len}"
    )
    cols = [
        "method",
        "trains",
        "lr",
        "PPL top-k",
        "PPL causal",
        "tokens",
        "time s",
        "align s",
        "peak RSS MB",
        "loss first -> last",
    ]
    table = []
    for r in rows:
        m = r["method"]
        trains = {"dense": "-", "routed": "-", "aligned_routers": "routers"}.get(
            m, args.trainable
        )
        lr = {
            "dense": "-",
            "routed": "-",
            "aligned_routers": f"{args.routers_lr:g}",
        }.get(m, f"{args.lr:g}")
        loss = (
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"
            if r.get("first_loss") is not None
            else "-"
        )
        table.append(
            [
                m,
                trains,
                lr,
                f"{r['ppl_topk']:.2f}",
                f"{r['ppl_causal']:.2f}",
                str(r["tokens"]),
                f"{r['compress_s']:.0f}",
                f"{r['align_s']:.0f}",
                f"{r['peak_rss_mb']:.0f}",
                loss,
            ]
        )
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(t, widths)) + " |")
    print(
        "\n`time s`: the whole oneshot (calibration, routing, alignment, threshold "
        "calibration); "
        f"`align s`: the alignment stage alone. Total wall time {wall_s:.0f} s."
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.calib_seq_len is None:
        args.calib_seq_len = args.seq_len
    if args.run_method is not None:  # child
        result = run_method(args, args.run_method)
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        return

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {METHODS}")
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            out = os.path.join(tmp, f"{method}.json")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *child_argv,
                "--run-method",
                method,
                "--result-file",
                out,
            ]
            print(f"=== {method}", flush=True)
            subprocess.run(cmd, check=True)
            with open(out) as f:
                rows.append(json.load(f))
    wall = time.perf_counter() - start
    print_table(args, rows, wall)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "wall_s": wall}, f, indent=2)


if __name__ == "__main__":
    main()
