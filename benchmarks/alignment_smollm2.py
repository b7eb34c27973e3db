"""Does the alignment stage recover dense quality? SmolLM2-135M, retention 0.8, held-out perplexity.

Rows of the table (same calibration data, steps, learning rate and seed for every trained row):

* ``dense``            - the unmodified model
* ``routed``           - AdaDSF routing without alignment (``align_steps=0``)
* ``aligned``          - alignment with KL + hidden-state terms (the paper's loss)
* ``lm_only``          - alignment with the causal-LM loss only (the paper's ablation)

Perplexity is measured on the ``test`` split of :func:`~adadsf_modifier.evaluation.load_text_splits`
(disjoint from the calibration split that calibration and alignment train on); use
``--split validation`` while choosing hyper-parameters. Each method runs in its own subprocess so
that "peak RSS" is that method's own peak (``ru_maxrss`` only ever grows within a process) and
one method's allocations cannot slow the next.

Example (about 10 minutes on 2 CPU cores)::

    python benchmarks/alignment_smollm2.py --steps 40 --lr 1e-3 --batch-size 4 --seq-len 256

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

METHODS = ("dense", "routed", "aligned", "lm_only")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=40, help="alignment steps (aligned, lm_only)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="alignment row length")
    p.add_argument("--trainable", default="routers", choices=("routers", "routers_and_layers"))
    p.add_argument("--w-kl", type=float, default=1.0, help="KL weight of the `aligned` row")
    p.add_argument("--w-hidden", type=float, default=1.0, help="hidden weight of the `aligned` row")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--calib-samples", type=int, default=64, help="calibration (= training) rows")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--split", default="test", choices=("test", "validation"))
    p.add_argument("--eval-tokens", type=int, default=4096, help="tokens of held-out text scored")
    p.add_argument("--eval-max-length", type=int, default=512)
    p.add_argument("--eval-stride", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
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

    torch.set_num_threads(args.threads)
    path = args.model or embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    result: dict[str, Any] = {"method": method, "compress_s": 0.0, "align_s": 0.0}
    if method != "dense":
        align: dict[str, Any] = {}
        if method in ("aligned", "lm_only"):
            align = dict(
                align_steps=args.steps,
                align_lr=args.lr,
                align_batch_size=args.batch_size,
                align_seq_len=args.seq_len,
                align_trainable=args.trainable,
                align_grad_clip=args.grad_clip,
                align_seed=args.seed,
            )
            if method == "aligned":
                align.update(align_w_kl=args.w_kl, align_w_hidden=args.w_hidden, align_w_lm=0.0)
            else:
                align.update(align_w_kl=0.0, align_w_hidden=0.0, align_w_lm=1.0)
        modifier = AdaDSFModifier(retention=args.retention, seed=args.seed, **align)
        data = calibration_dataset(tokenizer, args.calib_samples, args.calib_seq_len, seed=args.seed)
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
    ppl = perplexity(
        model,
        tokenizer,
        texts,
        max_length=args.eval_max_length,
        stride=args.eval_stride,
        max_tokens=args.eval_tokens,
        show_progress=False,
    )
    result.update(ppl=ppl.ppl, tokens=ppl.tokens, peak_rss_mb=peak_rss_mb())
    logger.info(f"[{method}] {result}")
    return result


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]], wall_s: float) -> None:
    print()
    print(
        f"SmolLM2-135M, retention {args.retention}, {args.split} split, {args.steps} steps x "
        f"batch {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g}, trainable "
        f"{args.trainable}, calibration {args.calib_samples} x {args.calib_seq_len}, seed {args.seed}"
    )
    header = f"| {'method':<8} | {'PPL':>8} | {'tokens':>6} | {'time s':>7} | {'align s':>7} | {'peak RSS MB':>11} | loss first -> last |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        loss = (
            f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}" if r.get("first_loss") is not None else ""
        )
        print(
            f"| {r['method']:<8} | {r['ppl']:>8.3f} | {r['tokens']:>6} | {r['compress_s']:>7.1f} | "
            f"{r['align_s']:>7.1f} | {r['peak_rss_mb']:>11.0f} | {loss:<18} |"
        )
    print(f"\n`time s` = oneshot (calibration + routing + alignment); total wall time {wall_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
            cmd = [sys.executable, os.path.abspath(__file__), *child_argv,
                   "--run-method", method, "--result-file", out]
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
