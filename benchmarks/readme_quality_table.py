"""Render the README's "Where quality stands" table from ``docs/results.json``.

The table repeats the study's per-method summary in the words a first-time reader needs
(which row is the shipped variant, which the paper), so it is generated from the study's
own numbers, never typed: run this after ``benchmarks/results_study_829b1cc_render.sh``.
It replaces the lines between the two ``quality-table`` markers in ``README.md`` with
one table per budget of the study.

    .venv/bin/python benchmarks/readme_quality_table.py [--results docs/results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loguru import logger

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- quality-table: rendered by benchmarks/readme_quality_table.py -->"
END = "<!-- /quality-table -->"

#: README label per study method, in the order the table lists them; a method not
#: named here follows them, under the study's own label
LABELS: dict[str, str] = {
    "dense": "dense",
    "adadsf_ridge_kv_err": "**AdaDSF, the shipped variant**",
    "adadsf_ridge_kv_err_w8a8": "the shipped variant + GPTQ W8A8",
    "adadsf_ridge_kv_err_lm_only": "the shipped variant, LM loss only",
    "layer_drop_healed": "layer removal (ShortGPT) + healing",
    "layer_drop": "layer removal (ShortGPT), no training",
    "adadsf": "AdaDSF, the paper (identity skip path)",
    "adadsf_w8a8": "the paper + GPTQ W8A8",
    "adadsf_lm_only": "the paper, LM loss only (no teacher)",
    "reversed": "the paper, allocation reversed",
    "random": "the paper, allocation in random layer order",
    "uniform": "uniform routing (MoD)",
    "adadsf_no_align": "the paper, no alignment",
    "ftp_ridge_kv": "FTP + ridge skip path + K/V",
    "ftp": "FTP",
}


def _with_ci(stat: dict[str, Any], fmt: str) -> str:
    """``mean ± ci``; the ``±`` part left out where it rounds to zero at ``fmt``
    (one seed, or a method that does not depend on the seed)."""
    if stat.get("mean") is None:
        return "-"
    text = format(stat["mean"], fmt)
    ci = stat.get("ci95")
    if ci is not None and float(format(ci, fmt)) != 0.0:
        text += f" ± {format(ci, fmt)}"
    return text


def table(results: dict[str, Any], budget: float) -> list[str]:
    """The README table's lines for the study's runs at ``budget`` (and dense)."""
    targets = {
        t["method"]: t for t in results.get("targets") or [] if t["budget"] == budget
    }
    rows = {
        s["method"]: s
        for s in results["summary"]
        if s["method"] == "dense" or s["budget"] == budget
    }
    order = [m for m in LABELS if m in rows] + [m for m in rows if m not in LABELS]
    dense_ppl = rows["dense"]["metrics"]["ppl_test"]["mean"]
    lines = [
        "| method | seeds | measured FLOPs | test PPL | x dense | 7-task mean |"
        " alignment (longest) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in order:
        s = rows[m]
        metrics = s["metrics"]
        if m in targets:
            ratio = _with_ci(targets[m]["ppl_ratio"], ".3f")
        else:  # dense, or a study without targets: the mean's ratio
            ratio = format(metrics["ppl_test"]["mean"] / dense_ppl, ".3f")
        align = [
            r["align_seconds"]
            for r in results["runs"]
            if r["method"] == m and r["budget"] == budget and r.get("align_seconds")
        ]
        cells = [
            LABELS.get(m, s["label"]),
            str(len(s["seeds"])),
            format(metrics["normalized_flops"]["mean"], ".3f"),
            _with_ci(metrics["ppl_test"], ".2f"),
            ratio,
            _with_ci(metrics["task_mean"], ".3f"),
            f"{max(align) / 60:.0f} min" if align else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def titled_table(results: dict[str, Any], budget: float) -> list[str]:
    """A blank line, the budget and its alignment steps (the study's own rule,
    ``StudySettings.at_budget``), a blank line, the table."""
    from adadsf_modifier.study.settings import StudySettings

    settings = StudySettings.model_validate(results["settings"])
    steps = settings.at_budget(budget).align_steps
    title = f"Budget {budget:g}, {steps} alignment steps:"
    return ["", title, "", *table(results, budget)]


def block(results: dict[str, Any]) -> list[str]:
    """The lines between the markers: one titled table per budget of the study,
    highest first."""
    budgets = {s["budget"] for s in results["summary"] if s["method"] != "dense"}
    lines = [x for b in sorted(budgets, reverse=True) for x in titled_table(results, b)]
    return lines[1:]  # no blank line after the marker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results.json")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args()
    results = json.loads(args.results.read_text())
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(
            f"{args.readme}: the markers {BEGIN!r} and {END!r} are missing"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = "\n".join([BEGIN, *block(results), END])
    args.readme.write_text(head + body + tail)
    logger.info(f"{args.readme}: quality table rendered from {args.results}")


if __name__ == "__main__":
    main()
