"""Quality, compute and budget per text: is a method's picture the same off the
text it was fitted on?

Every study run measures its perplexity and FLOPs on each offline text outside the
calibration corpus (:func:`~adadsf_lab.study.measure.measure_other_texts`), and every
routed run its kept share on each offline text
(:func:`~adadsf_lab.study.measure.measure_budget_per_text`). This module summarises
both over seeds for ``results.json``: per method, budget and text the perplexity (and
its ratio to dense on the same tokens) and measured FLOPs; per method, budget and
text the kept share in prefill and decoding beside the planned one, and the largest
gap over the texts against :data:`HOLDS_WITHIN`.
"""

from __future__ import annotations

import math
from typing import Any

from adadsf_lab.study.methods import by_method_and_budget
from adadsf_lab.study.stats import mean_ci

__all__ = [
    "HOLDS_WITHIN",
    "IN_DOMAIN",
    "budget_per_text",
    "quality_per_text",
    "worst_other_text",
]

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
            if mode != "causal":
                continue  # rank routing, measured by runs of an earlier plug-in
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


def budget_per_text(runs: list[dict]) -> dict[str, Any]:
    """``{"holds_within", "rows", "held"}`` over the runs that measured their kept
    share per text (runs computed before the check existed are left out)."""
    rows = []
    for (method, budget), rs in by_method_and_budget(runs):
        rows += _rows(method, budget, rs)
    return {"holds_within": HOLDS_WITHIN, "rows": rows, "held": _held(rows)}


#: The name of the in-domain text (the test split of the calibration corpus).
IN_DOMAIN = "test (in-domain)"


def _texts(run: dict) -> dict[str, dict[str, Any]]:
    """A run's cells per text: the in-domain test split, then each other text."""
    cells = {
        IN_DOMAIN: {
            "ppl": run.get("ppl_test"),
            "normalized_flops": run.get("normalized_flops"),
            "sha256": "test",
        }
    }
    return {**cells, **(run.get("other_texts") or {})}


def quality_per_text(dense: dict | None, runs: list[dict]) -> list[dict[str, Any]]:
    """Per method, budget and text over the runs that measured the other texts: the
    perplexity (mean ± 95% CI over seeds), its ratio to the dense model's on the same
    tokens (``None`` without a dense run on them), and the measured FLOPs. Runs
    computed before the other texts were measured are left out, so that every row
    of a method counts the same seeds."""
    dense_cells = _texts(dense) if dense and dense.get("other_texts") else {}
    rows: list[dict[str, Any]] = []
    for (method, budget), rs in by_method_and_budget(
        [*([dense] if dense else []), *runs]
    ):
        measured = [r for r in rs if r.get("other_texts")]
        if not measured:
            continue
        for text, first in _texts(measured[0]).items():
            cells = [_texts(r).get(text) for r in measured]
            cells = [c for c in cells if c and c["sha256"] == first["sha256"]]
            ppl = mean_ci([c["ppl"] for c in cells])
            ref = dense_cells.get(text)
            same = ref is not None and ref["sha256"] == first["sha256"]
            rows.append(
                {
                    "method": method,
                    "budget": budget,
                    "text": text,
                    "seeds": len(cells),
                    "ppl": ppl.as_dict(),
                    "x_dense": ppl.mean / ref["ppl"] if same else None,
                    "normalized_flops": mean_ci(
                        [c["normalized_flops"] for c in cells]
                    ).as_dict(),
                }
            )
    return rows


def worst_other_text(rows: list[dict[str, Any]], method: str, budget: float):
    """The out-of-domain row of ``method`` at ``budget`` whose perplexity is furthest
    above dense (the README's column), or ``None``."""
    other = [
        r
        for r in rows
        if r["method"] == method
        and r["budget"] == budget
        and r["text"] != IN_DOMAIN
        and r["x_dense"] is not None
    ]
    return max(other, key=lambda r: r["x_dense"], default=None)
