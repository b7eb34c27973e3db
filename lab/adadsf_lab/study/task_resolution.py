"""How finely the lm-eval scores can tell two models apart, and what finer would cost.

``results.json``'s ``task_resolution`` (:func:`task_resolution`) and the sentence under
RESULTS.md's task table (:func:`resolution_note`): with ``n`` examples per task, one
comparison of two runs resolves a difference in the 7-task mean of about ``worst_case``;
the 2-point task target (``targets.MAX_TASK_DROP``) needs that much resolution to be
judged, so the note says what it would take (examples per task, within each task's
file, ``cost.TASK_SIZES``) or that the files cannot give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adadsf_lab.study.cost import TASK_SIZES
from adadsf_lab.study.stats import (
    resolvable_task_mean_difference,
    task_n_to_resolve,
)
from adadsf_lab.study.targets import MAX_TASK_DROP

__all__ = ["resolution_note", "task_resolution"]


def task_resolution(
    task_n: Mapping[str, int], dense_tasks: Mapping[str, float] | None
) -> dict[str, Any]:
    """The ``task_resolution`` entry of ``results.json``."""
    return {
        "task_n": dict(task_n),
        "worst_case": resolvable_task_mean_difference(task_n),
        "wanted": MAX_TASK_DROP,
        "task_n_for_wanted": task_n_to_resolve(task_n, MAX_TASK_DROP, TASK_SIZES),
        "at_full_files": resolvable_task_mean_difference(
            {t: TASK_SIZES[t] for t in task_n if t in TASK_SIZES}
        ),
        "at_dense_accuracy": (
            resolvable_task_mean_difference(task_n, dense_tasks)
            if dense_tasks
            else None
        ),
    }


def resolution_note(res: dict[str, Any]) -> str:
    """The sentence under RESULTS.md's task table."""
    n = res["task_n"]
    if not n:
        return "No task was scored."
    dense = res.get("at_dense_accuracy")
    return (
        f"Examples per task (n): {', '.join(f'{t} {n[t]}' for t in n)}. With these n,"
        " one comparison of two runs resolves a difference in the mean accuracy of"
        f" about {res['worst_case']:.3f} (95%, two independent binomial estimates per"
        " task, worst case p = 0.5"
        + (
            f"; {dense:.3f} at the dense model's accuracies"
            if dense is not None
            else ""
        )
        + "). Paired seeds make the comparisons below finer than this."
        + _wanted(res)
    )


def _wanted(res: dict[str, Any]) -> str:
    """What resolving the wanted difference would take, where these n fall short."""
    wanted, n = res.get("wanted"), res["task_n"]
    if not wanted or res["worst_case"] is None or res["worst_case"] <= wanted:
        return ""
    need = res.get("task_n_for_wanted")
    if not need:
        full = res.get("at_full_files")
        return f" Resolving {wanted:.3f} is out of reach with these tasks' files" + (
            f": all of their examples resolve {full:.3f}." if full else "."
        )
    scale = sum(need.values()) / max(sum(n.values()), 1)
    return (
        f" Resolving {wanted:.3f} the same way would take n = "
        f"{', '.join(f'{t} {need[t]}' for t in need)} ({scale:.1f}x the examples"
        " scored here, and about as much more lm-eval time in every run)."
    )
