"""The study judged by the time a method saves: test perplexity against *measured*
prefill and decode speedup (each run's model timed beside its dense twin in the same
run, :func:`~adadsf_lab.study.measure.measure_speed`), the Pareto frontier of those
points over every method and budget, and the shipped method's paired verdict against
healed layer removal at each budget.

Everything here goes into ``results.json``'s ``wall_clock``; :mod:`.render` and
:mod:`.plots` only read it.

* A point is one method at one budget: its mean test PPL over seeds, and its mean
  speedup at the smallest timed batch over the seeds that were timed (the study times
  its first ``speed_seeds`` seeds). The dense model is the point (its PPL, 1.0x).
* The frontier (:func:`pareto_front`) is that of lower test PPL and higher speedup, for
  prefill and decode separately, over every point of every budget.
* The verdict (:func:`speed_verdict`): method ``a`` *dominates* ``b`` when its mean
  prefill and decode speedups are at least ``b``'s and its test PPL is lower by the
  paired difference over seeds, 95% interval below 0 (:func:`.stats.paired_difference`,
  as the study's other verdicts); otherwise the sentence says by how much it misses.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.stats import PairedDiff, paired_difference

__all__ = [
    "BASELINE",
    "KINDS",
    "dominates",
    "pareto_front",
    "speed_verdict",
    "wall_clock",
]

KINDS = ("prefill", "decode")
BASELINE = "layer_drop_healed"
"""What the shipped method must beat on wall-clock: healed layer removal, the method a
user who wants speed would otherwise pick."""


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def pareto_front(points: Sequence[tuple[float | None, float | None]]) -> list[bool]:
    """Which ``(ppl, speedup)`` points are on the frontier of lower perplexity and
    higher speedup. A point is off it when another is at least as good on both and
    strictly better on one; equal points do not dominate each other (they are on it or
    off it together). A point with a missing or non-finite coordinate is never on it
    and dominates nothing."""
    ok = [_finite(p) and _finite(s) for p, s in points]
    out = []
    for i, (p, s) in enumerate(points):
        if not ok[i]:
            out.append(False)
            continue
        out.append(
            not any(
                ok[j] and q <= p and t >= s and (q < p or t > s)
                for j, (q, t) in enumerate(points)
                if j != i
            )
        )
    return out


def _mean(metric: dict | None) -> float | None:
    if not metric or not metric.get("n") or not _finite(metric.get("mean")):
        return None
    return float(metric["mean"])


def _point(row: dict, runs: list[dict]) -> dict[str, Any]:
    """One summary row as a point of the picture."""
    m = row["metrics"]
    reference = METHODS.get(row["method"]) is not None and (
        METHODS[row["method"]].allocation is None
    )
    timed = [r for r in runs if r.get("speed")]
    point = {
        "method": row["method"],
        "label": row["label"],
        "budget": row["budget"],
        "seeds": list(row["seeds"]),
        "ppl_test": m.get("ppl_test"),
        "normalized_flops": m.get("normalized_flops"),
        # dense (and a dense control) is the speed reference itself: 1.0x by definition
        "reference": reference,
        "timed_seeds": sorted(r["seed"] for r in timed),
        "timed_on": sorted(
            {(r.get("hardware") or {}).get("cpu") or "unknown" for r in timed}
        ),
    }
    for kind in KINDS:
        stat = m.get(f"{kind}_speedup")
        point[f"{kind}_speedup"] = (
            {"mean": 1.0, "ci95": None, "n": len(row["seeds"]), "sd": None}
            if reference
            else stat
        )
    return point


def dominates(a: dict, b: dict, diff: PairedDiff | None) -> bool | None:
    """Whether point ``a`` dominates ``b`` on wall-clock: at least ``b``'s mean
    prefill and decode speedup, and a test PPL lower by the paired difference ``diff``
    (``a - b`` over seeds) with its 95% interval below 0. None when a speedup is
    missing or there is no paired PPL."""
    speeds = [(_mean(a[f"{k}_speedup"]), _mean(b[f"{k}_speedup"])) for k in KINDS]
    if diff is None or any(x is None or y is None for x, y in speeds):
        return None
    faster = all(x >= y for x, y in speeds)
    lower = bool(diff.significant) and diff.mean_diff < 0
    return faster and lower


def _ppl_text(diff: PairedDiff, a_label: str, b_label: str) -> str:
    """``a - b`` in the study's words (:func:`.stats.verdict`'s)."""
    if diff.ci95 is None:
        return f"{diff.mean_diff:+.2f} (1 seed): no confidence interval"
    body = f"{diff.mean_diff:+.2f} ± {diff.ci95:.2f} ({diff.n_seeds} seeds)"
    if not diff.significant:
        return f"{body}, not significant"
    return (
        f"{body}, significant: {a_label if diff.mean_diff < 0 else b_label} is better"
    )


def _timed(a: dict, b: dict) -> str:
    na, nb = len(a["timed_seeds"]), len(b["timed_seeds"])
    if na == nb:
        return f"{na} timed seed{'s' * (na != 1)} each"
    return f"{na} and {nb} timed seeds"


def _gaps(a: dict, b: dict) -> str:
    """Each kind's mean speedup of ``a`` and ``b``."""
    return ", ".join(
        f"{k} {_mean(a[f'{k}_speedup']):.3f}x vs {_mean(b[f'{k}_speedup']):.3f}x"
        for k in KINDS
    )


def _speeds(a: dict, b: dict, batch: int) -> str:
    return f"speedup over dense at batch {batch} ({_timed(a, b)}): {_gaps(a, b)}"


def _misses(a: dict, b: dict, diff: PairedDiff) -> list[str]:
    """What keeps ``a`` from dominating ``b``, each with its size."""
    out = []
    for k in KINDS:
        x, y = _mean(a[f"{k}_speedup"]), _mean(b[f"{k}_speedup"])
        if x < y:
            out.append(f"{k} speedup {y - x:.3f} lower")
    if diff.ci95 is None:
        out.append("lower test PPL not established (1 seed)")
    elif not diff.significant:
        out.append("test PPL not significantly lower")
    elif diff.mean_diff > 0:
        out.append(f"test PPL higher by {diff.mean_diff:.2f}")
    return out


def speed_verdict(
    a: dict,
    b: dict,
    diff: PairedDiff | None,
    batch: int,
    others: Sequence[tuple[dict, PairedDiff | None]] = (),
) -> dict[str, Any]:
    """The verdict of point ``a`` (the shipped method) against ``b`` (healed layer
    removal) at one budget, with its sentence; ``others``: the other points of that
    budget with their paired PPL difference against ``b``, for which of them, if any,
    dominates ``b`` when ``a`` does not."""
    head = f"{a['label']} vs {b['label']} at {a['budget']:g}, on wall-clock"
    out: dict[str, Any] = {
        "a": a["method"],
        "b": b["method"],
        "budget": a["budget"],
        "batch_size": batch,
        "ppl_diff": diff.as_dict() if diff is not None else None,
    }
    for k in KINDS:
        x, y = _mean(a[f"{k}_speedup"]), _mean(b[f"{k}_speedup"])
        out[f"{k}_gap"] = None if x is None or y is None else x - y
    result = dominates(a, b, diff)
    out["dominates"] = result
    out["dominated_by"] = [o["method"] for o, d in others if dominates(o, b, d)]
    if result is None:
        what = "no paired test PPL" if diff is None else "no measured speed"
        out["sentence"] = f"{head}: {what}, no verdict"
        return out
    facts = (
        f"{_speeds(a, b, batch)}; test PPL {_ppl_text(diff, a['label'], b['label'])}"
    )
    if result:
        out["sentence"] = f"{head}: dominates. {facts[0].upper()}{facts[1:]}."
        return out
    out["sentence"] = (
        f"{head}: misses: {', '.join(_misses(a, b, diff))}."
        f" {facts[0].upper()}{facts[1:]}. {_who_dominates(b, others)}"
    )
    return out


def _who_dominates(b: dict, others: Sequence[tuple[dict, PairedDiff | None]]) -> str:
    budget = f"{b['budget']:g}"
    wins = [(o, d) for o, d in others if dominates(o, b, d)]
    if wins:
        names = "; ".join(
            f"{o['label']} ({_gaps(o, b)}; test PPL"
            f" {d.mean_diff:+.2f} ± {d.ci95:.2f}, {d.n_seeds} seeds)"
            for o, d in wins
        )
        return f"Dominating {b['label']} at {budget}: {names}."
    # at least as fast, lower mean PPL, but the difference is not established
    near = [
        (o, d)
        for o, d in others
        if d is not None
        and d.mean_diff < 0
        and all(
            (x := _mean(o[f"{k}_speedup"])) is not None
            and (y := _mean(b[f"{k}_speedup"])) is not None
            and x >= y
            for k in KINDS
        )
    ]
    if not near:
        return f"No method at {budget} dominates {b['label']}."
    names = "; ".join(
        f"{o['label']} (test PPL {_ppl_text(d, o['label'], b['label'])})"
        for o, d in near
    )
    return (
        f"No method at {budget} is shown to dominate {b['label']}; at least as fast"
        f" with a lower mean test PPL, not established: {names}."
    )


def _below_dense(p: dict, dense: dict | None) -> bool | None:
    """Whether the dense model itself (the point (its PPL, 1.0x)) dominates point
    ``p`` at prefill and at decode alike: ``p`` is faster at neither, has no lower mean
    PPL, and is worse on one. None for dense or a point without a speed or a PPL."""
    if dense is None or p["reference"]:
        return None
    ppl, ref = _mean(p["ppl_test"]), _mean(dense["ppl_test"])
    speeds = [_mean(p[f"{k}_speedup"]) for k in KINDS]
    if ppl is None or ref is None or None in speeds:
        return None
    return all(ref <= ppl and x <= 1.0 and (ref < ppl or x < 1.0) for x in speeds)


def wall_clock(
    summary: list[dict], runs: list[dict], settings: dict[str, Any]
) -> dict[str, Any]:
    """``results.json``'s ``wall_clock``: every summary row as a point (frontier
    membership per kind), and the verdicts of ``settings['flops_reference']`` (the
    shipped method: the one layer removal matches in FLOPs) against
    :data:`BASELINE` at each budget that has both."""
    by: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in runs:
        by[(r["method"], r["budget"])].append(r)
    points = [_point(row, by[(row["method"], row["budget"])]) for row in summary]
    for k in KINDS:
        front = pareto_front(
            [(_mean(p["ppl_test"]), _mean(p[f"{k}_speedup"])) for p in points]
        )
        for p, on in zip(points, front, strict=True):
            timed = _mean(p[f"{k}_speedup"]) is not None
            p.setdefault("frontier", {})[k] = on if timed else None
    dense = next((p for p in points if p["method"] == "dense"), None)
    for p in points:
        p["dominated_by_dense"] = _below_dense(p, dense)
    batch = min(settings.get("speed_batch_sizes") or [1])
    shipped = settings.get("flops_reference") or "adadsf"

    def ppl_diff(a: dict, b: dict) -> PairedDiff | None:
        def ppl(p: dict) -> dict[int, Any]:
            return {
                r["seed"]: r.get("ppl_test") for r in by[(p["method"], p["budget"])]
            }

        return paired_difference(ppl(a), ppl(b))

    verdicts = []
    budgets = sorted({p["budget"] for p in points if not p["reference"]}, reverse=True)
    for budget in budgets:
        at = {p["method"]: p for p in points if p["budget"] == budget}
        a, b = at.get(shipped), at.get(BASELINE)
        if a is None or b is None:
            continue
        others = [
            (p, ppl_diff(p, b))
            for m, p in at.items()
            if m not in (shipped, BASELINE) and not p["reference"]
        ]
        verdicts.append(speed_verdict(a, b, ppl_diff(a, b), batch, others))
    return {
        "batch_size": batch,
        "shipped": shipped,
        "baseline": BASELINE,
        "points": points,
        "verdicts": verdicts,
    }
