"""The README's first-screen table, rendered from the shipped study's ``results.json``.

One table: the shipped recipe against the dense model and healed layer removal at the
recipe's budget, in quality, measured FLOPs and wall-clock, so a first-time reader sees
what the tool buys and what it costs without opening the study. It is generated from
the study's numbers, never typed: ``make results`` renders the study and then this.

    python -m adadsf_lab.readme_table [--results RESULTS_JSON] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loguru import logger

from adadsf_lab.study.aggregate import SHIPPED_METHOD, headline_budget
from adadsf_lab.study.per_text import worst_other_text
from adadsf_modifier.atomic import atomic_write_text

__all__ = ["BEGIN", "END", "ROWS", "block", "render_into"]

BEGIN = "<!-- results-table: rendered by python -m adadsf_lab.readme_table -->"
END = "<!-- /results-table -->"

#: (study method, README label), in table order
ROWS: tuple[tuple[str, str], ...] = (
    ("dense", "dense"),
    (SHIPPED_METHOD, "**AdaDSF, the shipped recipe**"),
    ("layer_drop_healed", "layer removal (ShortGPT) + healing"),
)


def _with_ci(stat: dict[str, Any] | None, fmt: str) -> str:
    """``mean ± ci``; the ``±`` part left out where it rounds to zero at ``fmt``
    (one seed, or a quantity that does not depend on the seed)."""
    if not stat or stat.get("mean") is None:
        return "-"
    text = format(stat["mean"], fmt)
    ci = stat.get("ci95")
    if ci is not None and float(format(ci, fmt)) != 0.0:
        text += f" ± {format(ci, fmt)}"
    return text


def _older_rows(results: dict[str, Any]) -> bool:
    """Whether an older plug-in computed any run of the table's rows (results written
    before the headline counts: whether it computed any run at all)."""
    h = results.get("headline")
    if h is None:
        return bool(results.get("older_algorithm"))
    return any(method in h["older"] for method, _ in ROWS)


def block(results: dict[str, Any]) -> list[str]:
    """The lines between the markers."""
    budget = headline_budget(results)
    rows = {
        s["method"]: s
        for s in results["summary"]
        if s["method"] == "dense" or s["budget"] == budget
    }
    dense_ppl = rows["dense"]["metrics"]["ppl_test"]["mean"]
    lines = [
        f"SmolLM2-135M-Instruct at budget {budget:g}, bfloat16, test split, mean ± 95% "
        "CI over seeds; speed (seed 0) on 2 CPU threads at batch 1, prefill of 1024 "
        "tokens and decode after a 128-token prompt, each model timed beside its "
        "dense twin in one run"
        + (
            " (runs computed by an older plug-in than this one: the header of "
            "`docs/results/RESULTS.md` says which parts changed since):"
            if _older_rows(results)
            else ":"
        ),
        "",
        "| model | seeds | test PPL | x dense | 7-task mean | measured FLOPs |"
        " prefill x dense | decode x dense | worst other text: PPL x dense (FLOPs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_text = results.get("quality_per_text") or []
    for method, label in ROWS:
        if method not in rows:
            continue
        m = rows[method]["metrics"]
        cells = [
            label,
            str(len(rows[method]["seeds"])),
            _with_ci(m["ppl_test"], ".2f"),
            format(m["ppl_test"]["mean"] / dense_ppl, ".2f"),
            _with_ci(m["task_mean"], ".3f"),
            format(m["normalized_flops"]["mean"], ".3f"),
            _with_ci(m.get("prefill_speedup"), ".2f"),
            _with_ci(m.get("decode_speedup"), ".2f"),
            _worst(per_text, method, rows[method]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _worst(per_text: list[dict[str, Any]], method: str, row: dict[str, Any]) -> str:
    """The out-of-domain text on which ``method`` loses most to dense, or ``-``; the
    seeds that measured it where fewer than the row's."""
    w = worst_other_text(per_text, method, row["budget"])
    if w is None:
        return "-"
    n = w["seeds"]
    seeds = f"; {n} seed{'s' if n != 1 else ''}" if n < len(row["seeds"]) else ""
    flops = w["normalized_flops"]["mean"]
    return f"{w['x_dense']:.2f} on {w['text']} ({flops:.3f}{seeds})"


def render_into(readme: str, results: dict[str, Any]) -> str:
    """``readme`` with the text between the markers replaced by :func:`block`."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + "\n".join([BEGIN, *block(results), END]) + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("docs/results/results.json"))
    ap.add_argument("--readme", type=Path, default=Path("README.md"))
    args = ap.parse_args()
    results = json.loads(args.results.read_text())
    atomic_write_text(args.readme, render_into(args.readme.read_text(), results))
    logger.info(f"{args.readme}: results table rendered from {args.results}")


if __name__ == "__main__":
    main()
