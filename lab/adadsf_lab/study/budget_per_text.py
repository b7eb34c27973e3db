"""Does the budget hold on every offline text, and what does rank routing cost?

Every routed run of the study checks its kept share on each offline text in both
routing modes (:func:`~adadsf_lab.study.measure.measure_budget_per_text`) and measures
its test perplexity under rank routing too (``ppl_test_rank``). This module summarises
both over seeds for ``results.json``: per method, budget, text and mode the kept share
in prefill and in decoding beside the planned one, the largest gap over the texts
against :data:`HOLDS_WITHIN` (the question issue 52 asks), and the paired difference
of rank routing's test perplexity against the calibrated thresholds' on the same runs.
"""

from __future__ import annotations

import math
from typing import Any

from adadsf_lab.study.methods import METHODS, by_method_and_budget
from adadsf_lab.study.stats import mean_ci, paired_difference, verdict

__all__ = ["HOLDS_WITHIN", "budget_per_text"]

#: How far a text's kept share may sit from the plan for the budget to count as held.
HOLDS_WITHIN = 0.02

_PHASES = ("prefill_kept", "decode_kept")


def _rows(method: str, budget: float, runs: list[dict]) -> list[dict[str, Any]]:
    measured = [r for r in runs if r.get("budget_per_text")]
    if not measured:
        return []
    texts = measured[0]["budget_per_text"]["texts"]
    rows = []
    for text, modes in texts.items():
        for mode in modes:
            cells = [
                r["budget_per_text"]["texts"].get(text, {}).get(mode) for r in measured
            ]
            cells = [c for c in cells if c]
            row: dict[str, Any] = {
                "method": method,
                "budget": budget,
                "text": text,
                "mode": mode,
                "seeds": sorted(r["seed"] for r in measured),
                "sizes": measured[0]["budget_per_text"]["sizes"],
                "target": mean_ci([c["target"] for c in cells]).mean,
            }
            for phase in _PHASES:
                row[phase] = mean_ci([c[phase] for c in cells]).as_dict()
            rows.append(row)
    return rows


def _held(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, budget and mode: the largest gap of a seed-mean kept share from
    its plan over the texts and phases, and whether it is within
    :data:`HOLDS_WITHIN`."""
    out: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (row["method"], row["budget"], row["mode"])
        for phase in _PHASES:
            mean, target = row[phase]["mean"], row["target"]
            if not (math.isfinite(mean) and math.isfinite(target)):
                continue
            gap = mean - target
            best = out.setdefault(
                key,
                {"method": key[0], "budget": key[1], "mode": key[2], "gap": 0.0},
            )
            if abs(gap) >= abs(best["gap"]):
                best.update(gap=gap, text=row["text"], phase=phase)
    for entry in out.values():
        entry["holds"] = abs(entry["gap"]) <= HOLDS_WITHIN
    return list(out.values())


def _rank_vs_causal(method: str, budget: float, runs: list[dict]) -> dict | None:
    diff = paired_difference(
        {r["seed"]: r.get("ppl_test_rank") for r in runs},
        {r["seed"]: r.get("ppl_test") for r in runs},
    )
    if diff is None:
        return None
    label = METHODS[method].label
    text = verdict(
        f"{label}, rank routing",
        f"{label}, calibrated thresholds",
        budget,
        "ppl_test",
        diff,
        True,
    )
    return {"method": method, "budget": budget, **diff.as_dict(), "verdict": text}


def budget_per_text(runs: list[dict]) -> dict[str, Any]:
    """``{"rows", "held", "rank_vs_causal"}`` over the runs that measured them (runs
    computed before the check existed have neither and are left out)."""
    rows, rank = [], []
    for (method, budget), rs in by_method_and_budget(runs):
        rows += _rows(method, budget, rs)
        got = _rank_vs_causal(method, budget, rs)
        if got is not None:
            rank.append(got)
    return {
        "holds_within": HOLDS_WITHIN,
        "rows": rows,
        "held": _held(rows),
        "rank_vs_causal": rank,
    }
