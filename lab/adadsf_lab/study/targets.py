"""The project's quality targets, checked against the study's runs: by how much each
method meets or misses them.

A user choosing a depth-sparse model asks "how close to dense, at what compute, for how
much training?", so the study answers in those units rather than leaving the reader to
divide table cells: the test perplexity *as a multiple of the dense model's* (per seed,
then mean and 95% interval), against the limit that applies at the run's *measured*
FLOPs, with the alignment wall-clock, the 7-task mean against dense, and the prefill
speedup as a fraction of its FLOPs ideal beside it. A target is judged on the mean of at
least :data:`MIN_SEEDS` seeds; with fewer it is reported, not judged. Whether a method
beats a baseline is the paired comparisons' business (``aggregate.COMPARISONS``), not
this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adadsf_lab.study.methods import METHODS, by_method_and_budget
from adadsf_lab.study.stats import mean_ci

__all__ = [
    "MAX_ALIGN_SECONDS",
    "MAX_TASK_DROP",
    "MIN_PREFILL_OF_IDEAL",
    "MIN_SEEDS",
    "PPL_TARGETS",
    "PplTarget",
    "prefill_of_ideal",
    "target_rows",
    "target_sentence",
    "targets_markdown",
]


@dataclass(frozen=True)
class PplTarget:
    """At measured normalized FLOPs (decoder stack, overheads counted) at most
    ``max_flops``, test perplexity at most ``max_ratio`` times the dense model's."""

    max_flops: float
    max_ratio: float


#: From the tightest compute to the loosest; a run is held to the first whose
#: ``max_flops`` its measured FLOPs fit under (at 0.74 to 1.30x, at 0.84 to 1.10x).
PPL_TARGETS: tuple[PplTarget, ...] = (PplTarget(0.75, 1.30), PplTarget(0.85, 1.10))
MIN_SEEDS = 3
MAX_ALIGN_SECONDS = 30 * 60.0  # on the machine the study ran on (RESULTS.md's hardware)
MAX_TASK_DROP = 0.02  # 7-task mean at most 2 points under dense (where a PPL limit is)
MIN_PREFILL_OF_IDEAL = 0.9  # prefill at seq 1024, batch 1: speedup / (1 / FLOPs)
_PREFILL_CELL = {"kind": "prefill", "batch_size": 1, "seq_len": 1024}


def prefill_of_ideal(run: dict[str, Any]) -> float | None:
    """The run's prefill speedup at seq 1024, batch 1, as a fraction of its FLOPs
    ideal, as the speed benchmark measured it (its ``fraction_of_ideal``: the ideal is
    counted on the benchmark's own prompt); None if that cell was not measured."""
    for cell in (run.get("speed") or {}).get("cells", []):
        if all(cell.get(k) == v for k, v in _PREFILL_CELL.items()):
            return cell.get("fraction_of_ideal")
    return None


def _machine_of(run: dict[str, Any]) -> str:
    """The machine a run was computed on, as its hardware record names it (the GPU, else
    the CPU; ``"unknown"`` for a run without one): alignment wall-clock is a property
    of the run *and* that machine, and a study's seeds may be spread over several."""
    hw = run.get("hardware") or {}
    return hw.get("gpu") or hw.get("cpu") or "unknown"


def _target_for(flops: float) -> PplTarget | None:
    return next((t for t in PPL_TARGETS if flops <= t.max_flops), None)


def _met(value: float | None, limit: float, at_most: bool, judged: bool):
    if value is None or not judged:
        return None
    return value <= limit if at_most else value >= limit


def target_rows(dense: dict | None, runs: list[dict]) -> list[dict[str, Any]]:
    """One row per ``(method, budget)`` with a test perplexity: the measured numbers in
    the targets' units and, with >= ``MIN_SEEDS`` seeds, whether each target is met
    (``None``: not judged, too few seeds or no target at that FLOPs). Empty without a
    dense run to divide by."""
    if not dense or not dense.get("ppl_test"):
        return []
    rows = []
    # a dense control is a reference for its arm, not a compressed model
    scored = [
        r
        for r in runs
        if r.get("ppl_test") is not None and not METHODS[r["method"]].dense_control
    ]
    for (method, budget), rs in by_method_and_budget(scored):
        flops = mean_ci([r.get("normalized_flops") for r in rs])
        ratio = mean_ci([r["ppl_test"] / dense["ppl_test"] for r in rs])
        task = mean_ci(
            [
                r["task_mean"] - dense["task_mean"]
                for r in rs
                if r.get("task_mean") is not None and dense.get("task_mean") is not None
            ]
        )
        prefill = mean_ci([prefill_of_ideal(r) for r in rs])
        by_machine: dict[str, float] = {}
        for r in rs:
            if r.get("align_seconds") is not None:
                m = _machine_of(r)
                by_machine[m] = max(by_machine.get(m, 0.0), r["align_seconds"])
        align_max = max(by_machine.values()) if by_machine else None
        target = _target_for(flops.mean) if flops.n else None
        judged = ratio.n >= MIN_SEEDS
        rows.append(
            {
                "method": method,
                "budget": budget,
                "n_seeds": ratio.n,
                "judged": judged,
                "normalized_flops": flops.as_dict(),
                "ppl_ratio": ratio.as_dict(),
                "max_flops": target.max_flops if target else None,
                "max_ratio": target.max_ratio if target else None,
                "ppl_met": (
                    _met(ratio.mean, target.max_ratio, True, judged) if target else None
                ),
                "align_seconds_max": align_max,
                # the longest per machine: which machine meets the limit, which not
                "align_seconds_max_by_machine": by_machine,
                "align_met": _met(align_max, MAX_ALIGN_SECONDS, True, judged),
                "task_mean_diff": task.as_dict() if task.n else None,
                "task_met": (
                    _met(task.mean, -MAX_TASK_DROP, False, judged)
                    if task.n and target
                    else None
                ),
                "prefill_of_ideal": prefill.as_dict() if prefill.n else None,
                "prefill_met": (
                    _met(prefill.mean, MIN_PREFILL_OF_IDEAL, False, judged)
                    if prefill.n
                    else None
                ),
            }
        )
    return rows


def _judged(met: bool | None, miss: str) -> str:
    return "" if met is None else (": met" if met else f": {miss}")


def target_sentence(row: dict[str, Any]) -> str:
    """The row in plain words, e.g. ``"uniform (MoD) at 0.81 (0.842 measured FLOPs, 3
    seeds): test PPL 1.152 ± 0.010 x dense, limit 1.10 at <= 0.85 FLOPs: missed by
    0.052; alignment 47.5 min at most (limit 30): over; ..."``; with fewer than
    :data:`MIN_SEEDS` seeds the numbers so far, and no verdict."""
    label = METHODS[row["method"]].label
    r, f, n = row["ppl_ratio"], row["normalized_flops"], row["n_seeds"]
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    if not row["judged"]:
        seeds += f", not judged: fewer than {MIN_SEEDS}"
    ci = f" ± {r['ci95']:.3f}" if r["ci95"] is not None else ""
    ppl = (
        f"{label} at {row['budget']:g} ({f['mean']:.3f} measured FLOPs, {seeds}):"
        f" test PPL {r['mean']:.3f}{ci} x dense"
    )
    if row["max_ratio"] is None:
        ppl += f", no target above {PPL_TARGETS[-1].max_flops:g} FLOPs"
    else:
        gap = r["mean"] - row["max_ratio"]
        ppl += f", limit {row['max_ratio']:.2f} at <= {row['max_flops']:g} FLOPs"
        if row["ppl_met"] is None:
            ppl += f" ({abs(gap):.3f} {'over' if gap > 0 else 'under'} so far)"
        elif row["ppl_met"]:
            ppl += f": met with {-gap:.3f} to spare"
        else:
            ppl += f": missed by {gap:.3f}"
    parts = [ppl]
    align = row["align_seconds_max"]
    if align == 0:
        parts.append("no alignment")
    elif align is not None:
        machines = row.get("align_seconds_max_by_machine") or {}
        each = ""
        if len(machines) > 1:
            each = (
                " ("
                + "; ".join(f"{m}: {v / 60.0:.1f}" for m, v in sorted(machines.items()))
                + ")"
            )
        parts.append(
            f"alignment {align / 60.0:.1f} min at most{each} (limit"
            f" {MAX_ALIGN_SECONDS / 60:.0f}){_judged(row['align_met'], 'over')}"
        )
    if row["task_mean_diff"] is not None:
        limit = ""
        if row["max_flops"] is not None:
            limit = f" (limit -{100 * MAX_TASK_DROP:.0f})"
        parts.append(
            f"7-task mean {100.0 * row['task_mean_diff']['mean']:+.1f} points vs dense"
            f"{limit}{_judged(row['task_met'], 'missed')}"
        )
    if row["prefill_of_ideal"] is not None:
        parts.append(
            f"prefill (seq 1024, batch 1) {row['prefill_of_ideal']['mean']:.2f} of its"
            f" FLOPs ideal (target {MIN_PREFILL_OF_IDEAL:g})"
            f"{_judged(row['prefill_met'], 'missed')}"
        )
    return "; ".join(parts)


def targets_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """RESULTS.md's section: what the targets are, then each row's sentence (nothing
    without rows)."""
    if not rows:
        return []
    limits = " and ".join(
        f"<= {t.max_ratio:.2f}x at <= {t.max_flops:g}" for t in reversed(PPL_TARGETS)
    )
    return [
        "## Quality targets",
        "",
        f"Test PPL as a multiple of dense, per seed, then mean ± 95% CI: {limits}"
        f" measured FLOPs, judged on the mean of >= {MIN_SEEDS} seeds; alignment <="
        f" {MAX_ALIGN_SECONDS / 60:.0f} minutes (the longest run, on the machine"
        " that ran it; each machine's longest where the runs were spread); 7-task"
        f" mean at most {100 * MAX_TASK_DROP:.0f} points under dense"
        " where a PPL target applies; prefill at seq 1024, batch 1 >="
        f" {MIN_PREFILL_OF_IDEAL:g} of its FLOPs ideal. Beating the baselines is the"
        " paired verdicts' question.",
        "",
        *[f"- {row['sentence']}" for row in rows],
        "",
    ]
