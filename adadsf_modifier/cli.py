"""``adadsf``: compress, evaluate, benchmark and report from the command line.

    adadsf run                        # the main job on the embedded SmolLM2 (see
    README) adadsf compress --recipe recipes/adadsf_w8a8.yaml --output-dir out/sparse
    adadsf eval --model out/sparse --tasks piqa,arc_easy --limit 50 --output
    out/sparse.json adadsf bench --routed out/sparse --output out/speed.json
    adadsf report --inputs out/dense.json out/sparse.json --speed out/speed.json
    --output-dir out

Every command checks its inputs (model path, recipe, task names, output location) before
doing any heavy work and exits with status 2 and a one-line reason when they are wrong;
existing, non-empty outputs are never overwritten without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger

__all__ = ["main", "CLIError"]

DEFAULT_TASKS = (
    "piqa",
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "winogrande",
    "openbookqa",
    "boolq",
)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------- input
# checks
def _default_recipe() -> str:
    candidate = Path(__file__).resolve().parents[1] / "recipes" / "adadsf_w8a8.yaml"
    if not candidate.is_file():
        raise CLIError(
            "no default recipe found next to the package; pass --recipe PATH"
        )
    return str(candidate)


def _check_recipe(path: str) -> str:
    from llmcompressor.recipe import Recipe

    import adadsf_modifier  # noqa: F401  (registers AdaDSFModifier for the recipe parser)

    if not os.path.isfile(path):
        raise CLIError(f"recipe file not found: {path}")
    try:
        recipe = Recipe.create_instance(path)
    except Exception as e:  # yaml errors, unknown modifiers, pydantic validation errors
        detail = " ".join(
            line.strip() for line in str(e).splitlines()[:4] if line.strip()
        )
        raise CLIError(f"recipe {path} does not parse: {detail}") from e
    if not recipe.modifiers:
        raise CLIError(
            f"recipe {path} defines no modifiers (groups must end in _stage / "
            "_modifiers)"
        )
    return path


def _check_tasks(tasks: str | None) -> list[str]:
    if not tasks:
        return []
    from adadsf_modifier.evaluation.lm_eval_tasks import SUPPORTED_TASKS

    names = (
        list(SUPPORTED_TASKS)
        if tasks == "all"
        else [t.strip() for t in tasks.split(",") if t.strip()]
    )
    unknown = [t for t in names if t not in SUPPORTED_TASKS]
    if unknown:
        raise CLIError(
            f"unknown task(s) {unknown}; supported: {', '.join(SUPPORTED_TASKS)}"
        )
    return names


def _check_model(name: str | None) -> str:
    """A local path must exist; ``org/name`` is left to the hub unless ``org`` is a
    local folder."""
    from adadsf_modifier.evaluation.assets import resolve_model

    if name and not os.path.exists(os.path.expanduser(name)):
        looks_local = (
            name.startswith((".", "/", "~"))
            or name.count("/") != 1
            or os.path.isdir(name.split("/")[0])
        )
        if looks_local and name not in ("smollm2", "embedded"):
            raise CLIError(f"model path does not exist: {name}")
    try:
        return resolve_model(name)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e


def _check_output_dir(path: str, overwrite: bool) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"output path exists and is not a directory: {out}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CLIError(
            f"output directory {out} exists and is not empty (use --overwrite)"
        )
    return out


def _check_output_file(path: str | None, overwrite: bool) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not overwrite:
        raise CLIError(f"output file {out} exists (use --overwrite)")
    return out


def _write_json(path: Path | None, data: Any) -> None:
    if path is None:
        print(json.dumps(data, indent=2))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
    logger.info(f"wrote {path}")


# ---------------------------------------------------------------------------- commands
def cmd_compress(args: argparse.Namespace) -> dict[str, Any]:
    recipe = _check_recipe(args.recipe or _default_recipe())
    model_path = _check_model(args.model)
    out = _check_output_dir(args.output_dir, args.overwrite)
    return compress(
        model_path, recipe, out, args.calibration_samples, args.seq_len, args.seed
    )


def compress(
    model_path: str, recipe: str, out: Path, samples: int, seq_len: int, seed: int
) -> dict[str, Any]:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import adadsf_modifier  # noqa: F401
    from adadsf_modifier.evaluation.assets import calibration_dataset

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_path)
    data = calibration_dataset(tok, samples, seq_len, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if out.is_dir() and any(
        out.iterdir()
    ):  # --overwrite: the atomic save replaces it in one step
        logger.warning(f"--overwrite: replacing the checkpoint in {out}")
    oneshot(
        model=model,
        processor=tok,
        dataset=data,
        recipe=recipe,
        output_dir=str(out),
        num_calibration_samples=samples,
        max_seq_length=seq_len,
    )
    seconds = time.perf_counter() - t0
    logger.info(f"compressed {model_path} with {recipe} into {out} in {seconds:.0f}s")
    return {
        "model": model_path,
        "recipe": recipe,
        "output_dir": str(out),
        "seconds": seconds,
    }


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    tasks = _check_tasks(args.tasks)
    model_path = _check_model(args.model)
    out = _check_output_file(args.output, args.overwrite)
    record = evaluate(
        model_path,
        args.label,
        tasks,
        args.limit,
        not args.no_ppl,
        args.ppl_tokens,
        args.routing_mode,
    )
    _write_json(out, record)
    return record


def evaluate(
    model_path: str,
    label: str | None,
    tasks: list[str],
    limit: int | None,
    ppl: bool,
    ppl_tokens: int | None,
    routing_mode: str,
) -> dict[str, Any]:
    from adadsf_modifier.evaluation.evaluate import evaluate_model, load_for_eval

    model, tok, routed = load_for_eval(model_path)
    label = label or ("sparse" if routed else "dense")
    record = evaluate_model(
        model,
        tok,
        label=label,
        model_name=model_path,
        ppl=ppl,
        ppl_max_tokens=ppl_tokens,
        tasks=tasks,
        limit=limit,
        routing_mode=routing_mode,
    )
    return record.as_dict()


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.routed is None:
        raise CLIError(
            "--routed PATH (an AdaDSF checkpoint, e.g. from `adadsf compress`) is required"
        )
    routed_path = _check_model(args.routed)
    out = _check_output_file(args.output, args.overwrite)
    result = bench(
        routed_path,
        args.seq_lens,
        args.batch_sizes,
        args.repeats,
        args.decode_tokens,
        args.threads,
    )
    _write_json(out, result)
    return result


def bench(
    routed_path: str,
    seq_lens,
    batch_sizes,
    repeats: int,
    decode_tokens: int,
    threads: int | None = None,
) -> dict[str, Any]:
    """Routed checkpoint vs the same checkpoint with routing removed (identical
    weights)."""
    import torch
    from transformers import AutoTokenizer

    from adadsf_modifier.evaluation.assets import load_text_splits
    from adadsf_modifier.evaluation.speed import (
        format_table,
        load_pair,
        run_speed_benchmark,
    )

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(routed_path)
    dense, routed = load_pair(routed_path, dtype=torch.float32)
    text = "\n\n".join(load_text_splits()["test"]["text"])
    stream = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    results = run_speed_benchmark(
        dense,
        routed,
        stream,
        seq_lens=tuple(seq_lens),
        batch_sizes=tuple(batch_sizes),
        decode_tokens=decode_tokens,
        repeats=repeats,
    )
    table = format_table(results)
    print(table)
    return {
        "model": routed_path,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "results": [r.as_dict() for r in results],
        "table": table,
    }


def cmd_report(args: argparse.Namespace) -> dict[str, Any]:
    from adadsf_modifier.evaluation.report import (
        build_report,
        summary_table,
        write_report,
    )

    records = []
    for p in args.inputs:
        if not os.path.isfile(p):
            raise CLIError(f"evaluation file not found: {p}")
        records.append(json.loads(Path(p).read_text()))
    speed = []
    if args.speed:
        if not os.path.isfile(args.speed):
            raise CLIError(f"speed file not found: {args.speed}")
        speed = json.loads(Path(args.speed).read_text())["results"]
    out = Path(args.output_dir)
    for name in ("report.json", "report.png"):
        if (out / name).exists() and not args.overwrite:
            raise CLIError(f"{out / name} exists (use --overwrite)")
    report = build_report(records, speed)
    js, png = write_report(report, out)
    print(summary_table(report))
    print(f"\nreport: {js}  plot: {png}")
    return report


def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    """The README main job: compress (AdaDSF + W8A8) -> eval dense and sparse -> bench
    -> report."""
    from adadsf_modifier.evaluation.report import (
        build_report,
        summary_table,
        write_report,
    )

    t0 = time.perf_counter()
    recipe = _check_recipe(args.recipe or _default_recipe())
    tasks = _check_tasks(args.tasks)
    model_path = _check_model(args.model)
    out = _check_output_dir(args.output_dir, args.overwrite)
    if out.is_dir() and args.overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sparse_dir = out / "sparse_w8a8"
    timings = {}

    step = time.perf_counter()
    compress(
        model_path,
        recipe,
        sparse_dir,
        args.calibration_samples,
        args.seq_len,
        args.seed,
    )
    timings["compress_s"] = time.perf_counter() - step
    records = []
    for label, path in (("dense", model_path), ("AdaDSF+W8A8", str(sparse_dir))):
        step = time.perf_counter()
        rec = evaluate(path, label, tasks, args.limit, True, args.ppl_tokens, "causal")
        _write_json(out / f"eval_{'dense' if label == 'dense' else 'sparse'}.json", rec)
        records.append(rec)
        timings[f"eval_{label}_s"] = time.perf_counter() - step
    step = time.perf_counter()
    speed = bench(
        str(sparse_dir),
        args.bench_seq_lens,
        [1],
        args.bench_repeats,
        args.decode_tokens,
    )
    _write_json(out / "speed.json", speed)
    timings["bench_s"] = time.perf_counter() - step
    timings["total_s"] = time.perf_counter() - t0
    meta = {
        "model": model_path,
        "recipe": recipe,
        "tasks": tasks,
        "limit": args.limit,
        "ppl_tokens": args.ppl_tokens,
        "timings": timings,
    }
    report = build_report(records, speed["results"], meta)
    js, png = write_report(report, out)
    print("\n" + summary_table(report))
    print(f"\nwall-clock {timings['total_s'] / 60:.1f} min; report: {js}  plot: {png}")
    return report


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adadsf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    def model_arg(
        sp, help_="local path or hub id (default: the embedded SmolLM2-135M-Instruct)"
    ):
        sp.add_argument("--model", default=None, help=help_)

    c = sub.add_parser(
        "compress", help="model + recipe -> compressed AdaDSF checkpoint"
    )
    model_arg(c)
    c.add_argument(
        "--recipe", default=None, help="YAML recipe (default recipes/adadsf_w8a8.yaml)"
    )
    c.add_argument("--output-dir", required=True)
    c.add_argument("--calibration-samples", type=int, default=64)
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_compress)

    e = sub.add_parser("eval", help="perplexity and/or lm-eval tasks -> JSON")
    model_arg(e, "model or AdaDSF checkpoint (default: the embedded SmolLM2)")
    e.add_argument("--label", default=None)
    e.add_argument(
        "--tasks",
        default=None,
        help=f"comma list or 'all' ({', '.join(DEFAULT_TASKS)})",
    )
    e.add_argument(
        "--limit", type=int, default=None, help="examples per task (quick runs)"
    )
    e.add_argument("--no-ppl", action="store_true")
    e.add_argument("--ppl-tokens", type=int, default=16384)
    e.add_argument("--routing-mode", choices=["causal", "topk"], default="causal")
    e.add_argument("--output", default=None, help="JSON file (default: stdout)")
    e.add_argument("--overwrite", action="store_true")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="speed: routed checkpoint vs its dense twin")
    b.add_argument("--routed", default=None, help="AdaDSF checkpoint directory")
    b.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 2048])
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--decode-tokens", type=int, default=32)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--output", default=None)
    b.add_argument("--overwrite", action="store_true")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser(
        "report", help="evaluation JSONs (+ speed JSON) -> report.json + report.png"
    )
    r.add_argument("--inputs", nargs="+", required=True)
    r.add_argument("--speed", default=None)
    r.add_argument("--output-dir", required=True)
    r.add_argument("--overwrite", action="store_true")
    r.set_defaults(func=cmd_report)

    m = sub.add_parser(
        "run", help="main job: compress + eval (dense, sparse) + bench + report"
    )
    model_arg(m)
    m.add_argument("--recipe", default=None)
    m.add_argument("--output-dir", default="outputs/main")
    m.add_argument("--tasks", default="all")
    m.add_argument("--limit", type=int, default=50)
    m.add_argument("--ppl-tokens", type=int, default=16384)
    m.add_argument("--calibration-samples", type=int, default=64)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--bench-seq-lens", type=int, nargs="+", default=[256, 1024])
    m.add_argument("--bench-repeats", type=int, default=3)
    m.add_argument("--decode-tokens", type=int, default=32)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except CLIError as e:
        print(f"adadsf {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
