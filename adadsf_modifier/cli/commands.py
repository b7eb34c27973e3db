"""The CLI's commands: each checks its arguments first (:mod:`.checks`), then works."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from adadsf_modifier.cli.checks import (
    CLIError,
    check_model,
    check_output_dir,
    check_output_file,
    check_recipe,
    check_routed,
    check_tasks,
    default_recipe,
    write_json,
)
from adadsf_modifier.constraints import InputError


def cmd_compress(args: argparse.Namespace) -> dict[str, Any]:
    """Also under ``torchrun`` (docs/distributed.md): the process group is set up and
    taken down here."""
    from adadsf_modifier import distributed

    recipe = check_recipe(args.recipe or default_recipe())
    out = check_output_dir(args.output_dir, args.overwrite)
    model_path = check_model(args.model)
    texts = None
    if args.dataset is not None:
        from adadsf_modifier.cli.user_data import load_texts

        texts = load_texts(args.dataset, args.split, args.text_column, model_path)
    created = distributed.init_distributed()
    try:
        return compress(
            model_path,
            recipe,
            out,
            args.calibration_samples,
            args.seq_len,
            args.seed,
            args.dtype,
            args.align_samples,
            texts,
            args.dataset,
        )
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def compress(
    model_path: str,
    recipe: str,
    out: Path,
    samples: int,
    seq_len: int,
    seed: int,
    dtype: str = "float32",
    align_samples: int | None = None,
    texts: list[str] | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """Under ``torchrun`` each rank keeps its own slice of the calibration set, so every
    modifier (GPTQ included) calibrates on its own rows; alignment rows go whole to
    every rank (the trainer splits them). ``dtype``: see
    :func:`adadsf_modifier.precision.resolve_dtype`. ``texts``: the user's documents
    (named ``source``), packed into the calibration and alignment rows instead of the
    embedded text."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adadsf_modifier import distributed
    from adadsf_modifier.cli.alignment_rows import alignment_rows
    from adadsf_modifier.evaluation import calibration_dataset
    from adadsf_modifier.evaluation.text_splits import packed_rows
    from adadsf_modifier.precision import dtype_name, resolve_dtype

    t0 = time.perf_counter()
    torch_dtype = resolve_dtype(dtype)
    tok = AutoTokenizer.from_pretrained(model_path)
    modifiers = Recipe.create_instance(recipe).modifiers
    try:  # before the model loads: too little text, or no rows at all
        if texts is None:
            data = calibration_dataset(tok, samples, seq_len, seed=seed)
        else:
            data = packed_rows(tok, texts, samples, seq_len, f"--dataset {source}")
        aligned = alignment_rows(modifiers, tok, align_samples, seed, texts, source)
    except ValueError as e:
        raise CLIError(f"calibration data: {e}") from e
    if len(data) == 0:
        raise CLIError("calibration data: the calibration set is empty (0 rows)")
    if distributed.world_size() > len(data):
        raise CLIError(
            f"calibration data: {len(data)} rows for {distributed.world_size()} "
            "processes; use --calibration-samples >= the number of processes"
        )
    if distributed.is_distributed():
        data = data.select(range(*distributed.partition_bounds(len(data))))
        samples = len(data)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    if distributed.is_distributed() and torch.cuda.is_available():
        model.to(torch.device("cuda", torch.cuda.current_device()))  # NCCL: own GPU
    writes = distributed.is_source_process()
    if writes and out.is_dir() and any(out.iterdir()):  # the atomic save replaces it
        logger.warning(f"--overwrite: replacing the checkpoint in {out}")
    oneshot(
        model=model,
        processor=tok,
        dataset=data,
        recipe=Recipe(modifiers=modifiers),
        output_dir=str(out),
        num_calibration_samples=samples,
        max_seq_length=seq_len,
    )
    seconds = time.perf_counter() - t0
    if writes:
        logger.info(
            f"compressed {model_path} with {recipe} into {out} in {seconds:.0f}s"
        )
    return {
        "model": model_path,
        "recipe": recipe,
        "output_dir": str(out),
        "dtype": dtype_name(torch_dtype),
        "alignment_rows": aligned,
        "dataset": source or "embedded",
        "seconds": seconds,
    }


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    tasks = check_tasks(args.tasks)
    out = check_output_file(args.output, args.overwrite)
    model_path = check_model(args.model)
    check_routed(model_path, required=False)
    from adadsf_modifier.cli.user_data import load_texts, read_text_file

    texts = {path: read_text_file(path) for path in args.text or ()}
    if args.dataset is not None:
        docs = load_texts(args.dataset, args.split, args.text_column, model_path)
        texts = {args.dataset: "\n\n".join(docs)}
    record = evaluate(
        model_path,
        args.label,
        tasks,
        args.limit,
        not args.no_ppl,
        args.ppl_tokens,
        args.routing_mode,
        dtype=args.dtype,
        texts=texts or None,
    )
    write_json(out, record)
    return record


def evaluate(
    model_path: str,
    label: str | None,
    tasks: list[str],
    limit: int | None,
    ppl: bool,
    ppl_tokens: int | None,
    routing_mode: str | None,
    name: str | None = None,
    dtype: str = "float32",
    texts: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One evaluation record; ``name`` is the model's name in it (default the path);
    ``texts`` (``{file: text}``) replace the embedded test split."""
    from adadsf_modifier.evaluation.evaluate import evaluate_model, load_for_eval
    from adadsf_modifier.precision import dtype_name, resolve_dtype

    torch_dtype = resolve_dtype(dtype)
    model, tok, routed = load_for_eval(model_path, dtype=torch_dtype)
    record = evaluate_model(
        model,
        tok,
        label=label or ("sparse" if routed else "dense"),
        model_name=name or model_path,
        ppl=ppl,
        ppl_max_tokens=ppl_tokens,
        tasks=tasks,
        limit=limit,
        routing_mode=routing_mode,
        texts=texts,
    )
    return {**record.as_dict(), "dtype": dtype_name(torch_dtype)}


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    out = check_output_file(args.output, args.overwrite)
    routed_path = check_model(args.routed)
    check_routed(routed_path)
    result = bench(
        routed_path,
        args.seq_lens,
        args.batch_sizes,
        args.repeats,
        args.decode_tokens,
        args.threads,
        args.dtype,
    )
    write_json(out, result)
    return result


def bench(
    routed_path: str,
    seq_lens: Sequence[int],
    batch_sizes: Sequence[int],
    repeats: int,
    decode_tokens: int,
    threads: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Routed checkpoint (routed as saved) vs the same weights with routing
    removed."""
    import torch
    from transformers import AutoTokenizer

    from adadsf_modifier.evaluation import load_text_splits
    from adadsf_modifier.evaluation.speed import (
        format_table,
        load_pair,
        run_speed_benchmark,
    )
    from adadsf_modifier.precision import dtype_name, resolve_dtype
    from adadsf_modifier.routing import routing_modes_of

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = resolve_dtype(dtype, "cpu")
    tok = AutoTokenizer.from_pretrained(routed_path)
    dense, routed = load_pair(routed_path, dtype=torch_dtype)
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
        "dtype": dtype_name(torch_dtype),
        "routing_mode": routing_modes_of(routed),
        "results": [r.as_dict() for r in results],
        "table": table,
    }


def cmd_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    routed_path = check_model(args.routed)
    check_routed(routed_path)
    from adadsf_modifier.recalibration import check_destination_apart

    try:
        check_destination_apart(Path(routed_path), Path(args.output_dir))
    except InputError as e:
        raise CLIError(str(e)) from e
    if Path(args.output_dir).resolve() == Path(routed_path).resolve() and not (
        args.overwrite
    ):
        raise CLIError(
            f"--output-dir is the checkpoint itself ({routed_path}): pass --overwrite "
            "to replace its thresholds in place"
        )
    out = check_output_dir(args.output_dir, args.overwrite)
    from adadsf_modifier.cli.user_data import load_texts, read_text_file

    if args.dataset is not None:
        texts = load_texts(args.dataset, args.split, args.text_column, routed_path)
    else:
        texts = [read_text_file(path) for path in args.text]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(routed_path)
    rows = text_rows(tok, texts, args.rows, args.seq_len)
    return calibrate(routed_path, rows, out, args.dtype, args.allow_missed_plan)


# Characters read per token needed: far above what tokenizers average (3-6), so it only
# spares tokenizing a huge file's unused tail.
CHARS_PER_TOKEN_CAP = 16


def text_rows(tokenizer: Any, texts: Sequence[str], rows: int, seq_len: int):
    """Up to ``rows`` consecutive ``[n, seq_len]`` token rows of ``texts``, each text
    followed by a blank line (as the calibration set joins documents), no special
    tokens; fewer when the text is short (logged), none is an error."""
    import torch

    needed = rows * seq_len
    ids: list[int] = []
    for text in texts:
        part = text[: needed * CHARS_PER_TOKEN_CAP] + "\n\n"
        ids.extend(tokenizer(part, add_special_tokens=False)["input_ids"])
        if len(ids) >= needed:
            break
    n = min(rows, len(ids) // seq_len)
    if n == 0:
        raise CLIError(
            f"--text holds {len(ids)} tokens, fewer than one row of --seq-len "
            f"{seq_len}: give more text or a shorter --seq-len"
        )
    if n < rows:
        logger.warning(
            f"--text holds {len(ids)} tokens: {n} rows of {seq_len}, not --rows {rows}"
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def calibrate(
    routed_path: str,
    rows: Any,
    out: Path,
    dtype: str = "float32",
    allow_missed_plan: bool = False,
) -> dict[str, Any]:
    """Refit ``routed_path``'s thresholds on ``rows`` into ``out``."""
    from adadsf_modifier.precision import dtype_name, resolve_dtype
    from adadsf_modifier.recalibration import recalibrate_checkpoint

    torch_dtype = resolve_dtype(dtype)
    report = recalibrate_checkpoint(
        routed_path, rows, out, dtype=torch_dtype, allow_missed_plan=allow_missed_plan
    )
    print(
        f"kept share of the text's tokens at the routed layers: "
        f"{report.kept_before:.3f} before, {report.kept_after:.3f} after the refit "
        f"(target {report.target:.3f}; on the rows the thresholds were fitted to); "
        f"checkpoint: {out} (its weight files are hard links to those of "
        f"{routed_path} where the filesystem allows)"
    )
    return {
        "model": routed_path,
        "output_dir": str(out),
        "dtype": dtype_name(torch_dtype),
        "rows": report.rows,
        "tokens": report.tokens,
        "kept_before": report.kept_before,
        "kept_after": report.kept_after,
        "target": report.target,
        "layers": report.layer_indices,
        "old_thresholds": report.old_thresholds,
        "new_thresholds": report.new_thresholds,
    }
