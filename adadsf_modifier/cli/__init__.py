"""``adadsf``: compress, evaluate, benchmark and report from the command line.

    adadsf run                                # the main job on the embedded SmolLM2
    adadsf compress --recipe recipes/adadsf_w8a8.yaml --output-dir out/sparse
    adadsf eval --model out/sparse --tasks piqa,arc_easy --limit 50 --output out/s.json
    adadsf bench --routed out/sparse --output out/speed.json
    adadsf report --inputs out/d.json out/s.json --speed out/speed.json --output-dir out
    adadsf study --quick                      # the results study (docs/RESULTS.md)

Every command checks its arguments (numbers, model path, recipe, task names, input
files, output location) before any heavy work and exits with status 2 and a one-line
reason when one is wrong. Existing, non-empty outputs are never overwritten without
``--overwrite``; ``run --overwrite`` replaces the earlier results only once the new ones
are complete. ``eval --tasks``, ``report`` and ``run`` need the evaluation extra
(``pip install 'adadsf-modifier[eval]'``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from adadsf_modifier.cli.checks import (
    CLIError,
    Parser,
    UsageError,
    model_name,
    non_negative_int,
    positive_int,
    token_count,
)
from adadsf_modifier.cli.commands import (
    bench,
    cmd_bench,
    cmd_compress,
    cmd_eval,
    cmd_report,
    cmd_run,
    compress,
    evaluate,
)
from adadsf_modifier.precision import DTYPES
from adadsf_modifier.study import (
    StudyInputError,
    add_study_arguments,
    run_study_command,
)

__all__ = ["main", "CLIError", "build_parser", "compress", "evaluate", "bench"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="adadsf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, func: Callable) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.set_defaults(func=func)
        return sp

    def model(sp, help_="folder, hub id or `embedded` (default: embedded SmolLM2)"):
        sp.add_argument("--model", type=model_name, default=None, help=help_)

    def dtype(sp):
        sp.add_argument(
            "--dtype",
            choices=DTYPES,
            default="auto",
            help="precision the models are loaded in (default auto: bfloat16 where "
            "the GPU or CPU has bfloat16 instructions, ~3x faster on such a CPU; "
            "else float32)",
        )

    def align_samples(sp):
        sp.add_argument(
            "--align-samples",
            type=non_negative_int,
            default=None,
            help="rows of calibration text (each align_seq_len tokens) the recipe's "
            "alignment trains on (default: align_steps x align_batch_size, one pass; "
            "0: cycle through the calibration rows)",
        )

    recipe_help = "YAML recipe (default recipes/adadsf_w8a8.yaml)"
    c = add("compress", "model + recipe -> compressed AdaDSF checkpoint", cmd_compress)
    model(c)
    c.add_argument("--recipe", default=None, help=recipe_help)
    c.add_argument("--output-dir", required=True)
    c.add_argument("--calibration-samples", type=positive_int, default=64)
    c.add_argument("--seq-len", type=positive_int, default=256)
    c.add_argument("--seed", type=int, default=0)
    dtype(c)
    align_samples(c)
    c.add_argument("--overwrite", action="store_true")

    e = add("eval", "perplexity and/or lm-eval tasks -> JSON", cmd_eval)
    model(e, "model, AdaDSF or FTP checkpoint (default: the embedded SmolLM2)")
    e.add_argument("--label", default=None)
    e.add_argument(
        "--tasks", default=None, help="comma list of lm-eval tasks, or 'all'"
    )
    e.add_argument("--limit", type=positive_int, default=None, help="examples per task")
    e.add_argument("--no-ppl", action="store_true")
    e.add_argument("--ppl-tokens", type=token_count, default=16384)
    e.add_argument("--routing-mode", choices=["causal", "topk"], default="causal")
    dtype(e)
    e.add_argument("--output", default=None, help="JSON file (default: stdout)")
    e.add_argument("--overwrite", action="store_true")

    b = add("bench", "speed: routed checkpoint vs its dense twin", cmd_bench)
    b.add_argument(
        "--routed",
        type=model_name,
        required=True,
        help="AdaDSF or FTP checkpoint directory (e.g. `adadsf compress` output)",
    )
    b.add_argument(
        "--seq-lens", type=positive_int, nargs="+", default=[256, 1024, 2048]
    )
    b.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8])
    b.add_argument("--repeats", type=positive_int, default=5)
    b.add_argument("--decode-tokens", type=positive_int, default=32)
    b.add_argument("--threads", type=positive_int, default=None)
    dtype(b)
    b.add_argument("--output", default=None)
    b.add_argument("--overwrite", action="store_true")

    r = add(
        "report", "eval JSONs (+ speed JSON) -> report.json + report.png", cmd_report
    )
    r.add_argument("--inputs", nargs="+", required=True)
    r.add_argument("--speed", default=None)
    r.add_argument("--output-dir", required=True)
    r.add_argument("--overwrite", action="store_true")

    m = add(
        "run", "main job: compress + eval (dense, sparse) + bench + report", cmd_run
    )
    model(m)
    m.add_argument("--recipe", default=None, help=recipe_help)
    m.add_argument("--output-dir", default="outputs/main")
    m.add_argument("--tasks", default="all")
    m.add_argument("--limit", type=positive_int, default=50)
    m.add_argument("--ppl-tokens", type=token_count, default=16384)
    m.add_argument("--calibration-samples", type=positive_int, default=128)
    m.add_argument("--seq-len", type=positive_int, default=512)
    m.add_argument(
        "--bench-seq-lens", type=positive_int, nargs="+", default=[256, 1024]
    )
    m.add_argument("--bench-repeats", type=positive_int, default=3)
    m.add_argument("--decode-tokens", type=positive_int, default=32)
    m.add_argument("--seed", type=int, default=0)
    dtype(m)
    align_samples(m)
    m.add_argument("--overwrite", action="store_true")

    st = add(
        "study",
        "results study -> docs/RESULTS.md, docs/results.json and plots",
        run_study_command,
    )
    add_study_arguments(st)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.func(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except (CLIError, StudyInputError) as e:
        print(f"adadsf {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0
