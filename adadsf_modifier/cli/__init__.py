"""``adadsf``: compress, evaluate, benchmark and report from the command line.

    adadsf compress --recipe recipes/adadsf_w8a8.yaml --output-dir out/sparse
    adadsf eval --model out/sparse --tasks piqa,arc_easy --limit 50 --output out/s.json
    adadsf bench --routed out/sparse --output out/speed.json
    adadsf calibrate --routed out/sparse --text my_text.txt --output-dir out/mine

The lab (``adadsf-lab``) adds its commands through the ``adadsf.commands`` entry-point
group (see :func:`add_command`), so this package never imports it. Every command checks
its arguments before any heavy work and exits with status 2 and a one-line reason when
one is wrong; non-empty outputs are never overwritten without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

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
    calibrate,
    cmd_bench,
    cmd_calibrate,
    cmd_compress,
    cmd_eval,
    compress,
    evaluate,
)
from adadsf_modifier.constraints import InputError
from adadsf_modifier.precision import DTYPES

__all__ = [
    "COMMAND_GROUP",
    "CLIError",
    "RECIPE_HELP",
    "add_align_samples_argument",
    "add_command",
    "add_dataset_arguments",
    "add_dtype_argument",
    "add_model_argument",
    "bench",
    "build_parser",
    "calibrate",
    "compress",
    "evaluate",
    "main",
]

COMMAND_GROUP = "adadsf.commands"  # entry points through which the lab adds commands

RECIPE_HELP = "YAML recipe (default recipes/adadsf_w8a8.yaml)"


def add_command(
    sub: argparse._SubParsersAction, name: str, help_: str, func: Callable
) -> argparse.ArgumentParser:
    """A subcommand whose parsed arguments are passed to ``func``."""
    sp = sub.add_parser(name, help=help_)
    sp.set_defaults(func=func)
    return sp


def add_model_argument(
    sp: argparse.ArgumentParser,
    help_: str = "folder, hub id or `embedded` (default: embedded SmolLM2)",
) -> None:
    sp.add_argument("--model", type=model_name, default=None, help=help_)


def add_dtype_argument(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="precision the models are loaded in (default auto: bfloat16 where "
        "the GPU or CPU has bfloat16 instructions, much faster on such a CPU; "
        "else float32)",
    )


def add_align_samples_argument(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--align-samples",
        type=non_negative_int,
        default=None,
        help="rows of calibration text (each align_seq_len tokens) the recipe's "
        "alignment trains on (default: align_steps x align_batch_size, one pass; "
        "0: cycle through the calibration rows)",
    )


DATASET_HELP = (
    "a .txt, .jsonl, .json, .csv or .parquet file, a save_to_disk folder, or a "
    "dataset name; a chat column (e.g. `messages`) is rendered through the model's "
    "chat template"
)


def add_dataset_arguments(
    sp: argparse.ArgumentParser, what: str, dataset_in: Any = None
) -> None:
    """``--dataset`` (``what`` it is for; added to ``dataset_in``, a mutually exclusive
    group, when given), ``--split`` and ``--text-column``: llm-compressor's words."""
    (dataset_in or sp).add_argument(
        "--dataset", default=None, help=f"{what}: {DATASET_HELP}"
    )
    sp.add_argument("--split", default="train", help="the --dataset split to read")
    sp.add_argument(
        "--text-column",
        default="text",
        help="the --dataset column holding the text or chat messages (default: "
        "text, else messages)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="adadsf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    add, model, dtype = add_command, add_model_argument, add_dtype_argument
    align_samples = add_align_samples_argument

    def routed(sp: argparse.ArgumentParser) -> None:
        help_ = "AdaDSF or FTP checkpoint directory (e.g. `adadsf compress` output)"
        sp.add_argument("--routed", type=model_name, required=True, help=help_)

    c = add(
        sub, "compress", "model + recipe -> compressed AdaDSF checkpoint", cmd_compress
    )
    model(c)
    c.add_argument("--recipe", default=None, help=RECIPE_HELP)
    c.add_argument("--output-dir", required=True)
    c.add_argument("--calibration-samples", type=positive_int, default=64)
    c.add_argument("--seq-len", type=positive_int, default=256)
    c.add_argument("--seed", type=int, default=0)
    add_dataset_arguments(
        c, "your calibration and alignment text (default: the embedded English text)"
    )
    dtype(c)
    align_samples(c)
    c.add_argument("--overwrite", action="store_true")

    e = add(sub, "eval", "perplexity and/or lm-eval tasks -> JSON", cmd_eval)
    model(e, "model, AdaDSF or FTP checkpoint (default: the embedded SmolLM2)")
    e.add_argument("--label", default=None)
    e.add_argument(
        "--tasks", default=None, help="comma list of lm-eval tasks, or 'all'"
    )
    e.add_argument("--limit", type=positive_int, default=None, help="examples per task")
    e.add_argument("--no-ppl", action="store_true")
    own = e.add_mutually_exclusive_group()
    own.add_argument(
        "--text",
        nargs="+",
        default=None,
        help="UTF-8 text file(s) to measure perplexity and FLOPs on (default: the "
        "embedded test split)",
    )
    add_dataset_arguments(e, "or your text to measure them on", own)
    e.add_argument("--ppl-tokens", type=token_count, default=16384)
    e.add_argument(
        "--routing-mode",
        choices=["causal", "topk"],
        default=None,
        help="causal: the calibrated thresholds, what generate() uses (default: the "
        "mode the checkpoint was saved in); topk: each row's best tokens, the "
        "paper's rule (scoring only, not causal)",
    )
    dtype(e)
    e.add_argument("--output", default=None, help="JSON file (default: stdout)")
    e.add_argument("--overwrite", action="store_true")

    b = add(sub, "bench", "speed: routed checkpoint vs its dense twin", cmd_bench)
    routed(b)
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

    k = add(
        sub,
        "calibrate",
        "refit a routed checkpoint's thresholds on your own text (weights untouched)",
        cmd_calibrate,
    )
    routed(k)
    texts = k.add_mutually_exclusive_group(required=True)
    texts.add_argument("--text", nargs="+", help="UTF-8 text file(s) of your traffic")
    add_dataset_arguments(k, "or your traffic", texts)
    k.add_argument(
        "--output-dir",
        required=True,
        help="the recalibrated checkpoint (the --routed folder with --overwrite: "
        "in place)",
    )
    k.add_argument("--rows", type=positive_int, default=64)
    k.add_argument("--seq-len", type=positive_int, default=512)
    dtype(k)
    k.add_argument("--overwrite", action="store_true")
    k.add_argument(
        "--allow-missed-plan",
        action="store_true",
        help="write the refit even where a layer's kept share misses its plan",
    )

    for entry in importlib.metadata.entry_points(group=COMMAND_GROUP):
        entry.load()(sub)
    return p


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # SIGTERM (a scheduler, torchrun taking a failed job down) becomes an exception, so
    # that what the command wrote half-way is removed on the way out
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        args = parser.parse_args(argv)
        args.func(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except (CLIError, InputError) as e:  # InputError: found by the modifier, the data
        print(f"adadsf {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
