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
    add_dataset_arguments,
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
    add_dataset_arguments(
        m,
        "your calibration and alignment text (default: the embedded English text; "
        "perplexity stays on the embedded test split, apart from it)",
    )
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
    texts = None
    if args.dataset is not None:  # refused before any work if it cannot calibrate
        from adadsf_modifier.cli.user_data import load_texts

        texts = load_texts(args.dataset, args.split, args.text_column, model_path)
    expected = expected_seconds(args, recipe, tasks, model_path)
    print(announcement(expected, _dtype(args)), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = sibling_dir(out, ".new")
    try:
        report = _main_job(args, recipe, tasks, model_path, work, out, expected, texts)
        swap_in(work, out)
    except BaseException:
        logger.error(f"`adadsf run` failed; {out} is left as it was")
        shutil.rmtree(work, ignore_errors=True)
        raise
    total = report["meta"]["timings"]["total_s"]
    js, png = (out / name for name in REPORT_FILES)
    print("\n" + summary_table(report))
    minutes = sum(expected.values()) / 60
    print(
        f"\nwall-clock {total / 60:.1f} min (expected {minutes:.0f}); report: {js}  "
        f"plot: {png}"
    )
    return report


def _dtype(args: argparse.Namespace) -> str:
    from adadsf_modifier.precision import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(args.dtype))


def announcement(expected: dict[str, float], dtype: str) -> str:
    """The line ``run`` prints before it starts: the expected minutes, and the stages
    that take most of them, in their order."""
    total = sum(expected.values())
    named = {
        "alignment": expected["alignment"],
        "compression": expected["build"],
        "GPTQ": expected["quantization"],
        "evaluation": expected["eval_dense"] + expected["eval_compressed"],
        "speed": expected["bench"],
    }
    parts = ", ".join(
        f"{k} {v / 60:.0f}"
        for k, v in sorted(named.items(), key=lambda kv: -kv[1])
        if v >= 30
    )
    return (
        f"adadsf run: expected to take about {total / 60:.0f} min in {dtype} on a "
        f"quiet 2-core CPU like the project's ({parts} min; rates measured there, "
        "adadsf_lab/study/cost.py); longer where other work shares the cores"
    )


def _recipe_work(recipe: str) -> dict[str, Any]:
    """What the estimate needs from the recipe: the AdaDSF alignment's size, whether
    its skip paths are fitted, whether GPTQ runs."""
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.recipe import Recipe

    from adadsf_modifier import AdaDSFModifier

    found = {"align_steps": 0, "align_tokens": 0, "fitted_skip_path": False}
    quantized = False
    for mod in Recipe.create_instance(recipe).modifiers:
        if isinstance(mod, AdaDSFModifier):
            found = {
                "align_steps": mod.align_steps,
                "align_tokens": mod.align_steps
                * mod.align_batch_size
                * mod.align_seq_len,
                "fitted_skip_path": mod.skip_path != "identity",
            }
        quantized = quantized or isinstance(mod, GPTQModifier)
    return {**found, "quantized": quantized}


def expected_seconds(
    args: argparse.Namespace, recipe: str, tasks: list[str], model_path: str
) -> dict[str, float]:
    """The main job's wall-clock per stage (``cost.main_job_seconds``) by the cost
    model's measured rates, at this job's sizes and the recipe's alignment."""
    from adadsf_lab.study.cost import main_job_seconds, model_params, task_requests

    return main_job_seconds(
        model_params(model_path),
        dtype=_dtype(args),
        calib_tokens=args.calibration_samples * args.seq_len,
        ppl_tokens=args.ppl_tokens,
        task_requests=task_requests(tasks, args.limit),
        bench_seq_lens=args.bench_seq_lens,
        bench_repeats=args.bench_repeats,
        decode_tokens=args.decode_tokens,
        **_recipe_work(recipe),
    )


def expected_minutes(
    args: argparse.Namespace, recipe: str, tasks: list[str], model_path: str
) -> float:
    """:func:`expected_seconds` in all, in minutes."""
    return sum(expected_seconds(args, recipe, tasks, model_path).values()) / 60


def _progress(step: int, what: str, expected: float | None) -> None:
    eta = "" if expected is None else f" (expected ~{max(expected / 60, 1):.0f} min)"
    print(f"adadsf run [{step}/4] {what}{eta}", flush=True)


def _main_job(
    args: argparse.Namespace,
    recipe: str,
    tasks: list[str],
    model_path: str,
    work: Path,
    out: Path,
    expected: dict[str, float] | None = None,
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """Everything ``run`` does, written into ``work``; paths in the records name
    ``out``, where the files end up. ``expected``: the seconds each stage should take
    (printed as each starts, kept in the report beside what it took); ``texts``: the
    ``--dataset`` documents compression calibrates and aligns on."""
    from adadsf_lab.report import build_report, write_report

    exp = expected or {}
    t0 = time.perf_counter()
    sparse = "sparse_w8a8"
    timings = {}
    step = time.perf_counter()
    _progress(
        1,
        "compress: calibration, skip paths, alignment, GPTQ",
        sum(exp[k] for k in ("build", "alignment", "quantization")) if exp else None,
    )
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
        texts,
        args.dataset,
    )
    timings["compress_s"] = time.perf_counter() - step
    records = []
    for label, path, name in (
        ("dense", model_path, model_path),
        ("AdaDSF+W8A8", str(work / sparse), str(out / sparse)),
    ):
        step = time.perf_counter()
        dense = label == "dense"
        _progress(
            2 if dense else 3,
            f"evaluate {label}: perplexity, {len(tasks)} tasks, FLOPs",
            exp.get("eval_dense" if dense else "eval_compressed"),
        )
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
        write_json(work / f"eval_{'dense' if dense else 'sparse'}.json", rec)
        records.append(rec)
        timings[f"eval_{label}_s"] = time.perf_counter() - step
    step = time.perf_counter()
    _progress(4, "speed benchmark against the dense twin", exp.get("bench"))
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
        "dataset": compressed["dataset"],
        "tasks": tasks,
        "limit": args.limit,
        "ppl_tokens": args.ppl_tokens,
        "timings": timings,
        "expected_s": {**exp, "total_s": sum(exp.values())} if exp else None,
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
