"""The lab's commands, added to ``adadsf`` through the ``adadsf.commands`` entry point:
``run`` (the README's main job), ``report`` and ``study``.

They live here, not in the plug-in, because they need the evaluation stack (lm-eval,
matplotlib, scipy) and the study; the plug-in's ``compress`` / ``eval`` / ``bench`` do
the work and this module only strings them together and reports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from loguru import logger

from adadsf_lab.report import LAB_INSTALL, REPORT_FILES
from adadsf_modifier.cli import (
    RECIPE_HELP,
    add_align_samples_argument,
    add_command,
    add_dtype_argument,
    add_model_argument,
    bench,
    compress,
    evaluate,
)
from adadsf_modifier.cli.checks import (
    CLIError,
    check_model,
    check_output_dir,
    check_recipe,
    check_tasks,
    default_recipe,
    positive_int,
    require,
    token_count,
    write_json,
)

__all__ = ["add_lab_commands"]


def add_lab_commands(sub: argparse._SubParsersAction) -> None:
    """The ``adadsf.commands`` entry point: adds ``report``, ``run`` and ``study``."""
    from adadsf_lab.study import add_study_arguments, run_study_command

    r = add_command(
        sub,
        "report",
        "eval JSONs (+ speed JSON) -> report.json + report.png",
        cmd_report,
    )
    r.add_argument("--inputs", nargs="+", required=True)
    r.add_argument("--speed", default=None)
    r.add_argument("--output-dir", required=True)
    r.add_argument("--overwrite", action="store_true")

    m = add_command(
        sub,
        "run",
        "main job: compress + eval (dense, sparse) + bench + report",
        cmd_run,
    )
    add_model_argument(m)
    m.add_argument("--recipe", default=None, help=RECIPE_HELP)
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
    add_dtype_argument(m)
    add_align_samples_argument(m)
    m.add_argument("--overwrite", action="store_true")

    st = add_command(
        sub,
        "study",
        "results study -> docs/results/ (RESULTS.md, results.json, plots)",
        run_study_command,
    )
    add_study_arguments(st)


def cmd_report(args: argparse.Namespace) -> dict[str, Any]:
    from adadsf_lab.report import (
        build_report,
        read_eval_record,
        read_speed_results,
        summary_table,
        write_report,
    )

    require("matplotlib", "the report plot", LAB_INSTALL)
    try:
        records = [read_eval_record(p) for p in args.inputs]
        speed = read_speed_results(args.speed) if args.speed else []
    except ValueError as e:
        raise CLIError(str(e)) from e
    out = check_output_dir(args.output_dir, args.overwrite, keep=REPORT_FILES)
    report = build_report(records, speed)
    js, png = write_report(report, out)
    print(summary_table(report))
    print(f"\nreport: {js}  plot: {png}")
    return report


def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    """The README main job: compress (AdaDSF + W8A8) -> eval dense and sparse -> bench
    -> report, written to a folder next to the output and swapped in at the end."""
    from adadsf_lab.report import summary_table

    recipe = check_recipe(args.recipe or default_recipe())
    tasks = check_tasks(args.tasks)
    require("matplotlib", "the report plot", LAB_INSTALL)
    out = check_output_dir(args.output_dir, args.overwrite)
    model_path = check_model(args.model)
    minutes = expected_minutes(args, recipe, tasks, model_path)
    print(
        f"adadsf run: expected to take about {minutes:.0f} min on a 2-core CPU like "
        "the project's (the study's cost model, adadsf_lab/study/cost.py; more where "
        "other work shares the cores)",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = sibling_dir(out, ".new")
    try:
        report = _main_job(args, recipe, tasks, model_path, work, out)
        swap_in(work, out)
    except BaseException:
        logger.error(f"`adadsf run` failed; {out} is left as it was")
        shutil.rmtree(work, ignore_errors=True)
        raise
    minutes = report["meta"]["timings"]["total_s"] / 60
    js, png = (out / name for name in REPORT_FILES)
    print("\n" + summary_table(report))
    print(f"\nwall-clock {minutes:.1f} min; report: {js}  plot: {png}")
    return report


def expected_minutes(
    args: argparse.Namespace, recipe: str, tasks: list[str], model_path: str
) -> float:
    """The main job's wall-clock in minutes by the study's cost model: the shipped
    W8A8 arm's run (compression, perplexity, tasks), the dense model's evaluation and
    the speed benchmark, at this job's sizes and the recipe's alignment."""
    from llmcompressor.recipe import Recipe

    from adadsf_lab.study.cost import bench_seconds, estimate_run_seconds, model_params
    from adadsf_lab.study.settings import StudySettings
    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.precision import dtype_name, resolve_dtype

    align = {}
    for mod in Recipe.create_instance(recipe).modifiers:
        if isinstance(mod, AdaDSFModifier):
            align = {
                "align_steps": mod.align_steps,
                "align_batch_size": mod.align_batch_size,
                "align_seq_len": mod.align_seq_len,
            }
    settings = StudySettings(
        dtype=dtype_name(resolve_dtype(args.dtype)),
        calib_samples=args.calibration_samples,
        calib_seq_len=args.seq_len,
        ppl_tokens=args.ppl_tokens,
        tasks=tuple(tasks),
        task_limit=args.limit,
        speed=False,
        **align,
    )
    params = model_params(model_path)
    seconds = sum(
        estimate_run_seconds(settings, "main", method, params, "cpu")
        for method in ("adadsf_ridge_kv_err_w8a8", "dense")
    ) + bench_seconds(
        params, args.bench_seq_lens, (1,), args.bench_repeats, 128, args.decode_tokens
    )
    return seconds / 60


def _main_job(
    args: argparse.Namespace,
    recipe: str,
    tasks: list[str],
    model_path: str,
    work: Path,
    out: Path,
) -> dict[str, Any]:
    """Everything ``run`` does, written into ``work``; paths in the records name
    ``out``, where the files end up."""
    from adadsf_lab.report import build_report, write_report

    t0 = time.perf_counter()
    sparse = "sparse_w8a8"
    timings = {}
    step = time.perf_counter()
    samples, seq_len = args.calibration_samples, args.seq_len
    compressed = compress(
        model_path,
        recipe,
        work / sparse,
        samples,
        seq_len,
        args.seed,
        args.dtype,
        args.align_samples,
    )
    timings["compress_s"] = time.perf_counter() - step
    records = []
    for label, path, name in (
        ("dense", model_path, model_path),
        ("AdaDSF+W8A8", str(work / sparse), str(out / sparse)),
    ):
        step = time.perf_counter()
        rec = evaluate(
            path,
            label,
            tasks,
            args.limit,
            True,
            args.ppl_tokens,
            "causal",
            name,
            compressed["dtype"],  # dense and sparse alike
        )
        write_json(work / f"eval_{'dense' if label == 'dense' else 'sparse'}.json", rec)
        records.append(rec)
        timings[f"eval_{label}_s"] = time.perf_counter() - step
    step = time.perf_counter()
    speed = bench(
        str(work / sparse),
        args.bench_seq_lens,
        [1],
        args.bench_repeats,
        args.decode_tokens,
        dtype=compressed["dtype"],
    )
    speed["model"] = str(out / sparse)
    write_json(work / "speed.json", speed)
    timings["bench_s"] = time.perf_counter() - step
    timings["total_s"] = time.perf_counter() - t0
    meta = {
        "model": model_path,
        "recipe": recipe,
        "dtype": compressed["dtype"],
        "alignment_rows": compressed["alignment_rows"],
        "tasks": tasks,
        "limit": args.limit,
        "ppl_tokens": args.ppl_tokens,
        "timings": timings,
    }
    report = build_report(records, speed["results"], meta)
    write_report(report, work)
    return report


def sibling_dir(out: Path, suffix: str) -> Path:
    """A new empty folder next to ``out`` (a rename swaps it in), with the permissions
    a plain mkdir gives (``mkdtemp`` makes 0700)."""
    path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=suffix, dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    return path


def swap_in(new: Path, out: Path) -> None:
    """Put the complete folder ``new`` in place of ``out``, deleting the earlier one
    only then."""
    old = sibling_dir(out, ".old") if out.exists() else None
    if old is not None:
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
