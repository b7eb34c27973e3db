"""The README's quality table is the study's numbers, not a hand copy of them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    path = ROOT / "benchmarks" / "readme_quality_table.py"
    spec = importlib.util.spec_from_file_location("readme_quality_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_quality_table_is_what_docs_results_json_renders():
    script = _script()
    results = json.loads((ROOT / "docs" / "results.json").read_text())
    readme = (ROOT / "README.md").read_text()
    shown = readme.split(script.BEGIN, 1)[1].split(script.END, 1)[0].strip("\n")
    # stale when docs/results.json changed without benchmarks/readme_quality_table.py
    assert shown.splitlines() == script.block(results)


def test_the_quality_table_drops_an_interval_that_rounds_to_zero():
    script = _script()
    assert script._with_ci({"mean": 61.6, "ci95": 2e-14}, ".2f") == "61.60"
    assert script._with_ci({"mean": 37.15, "ci95": 0.918}, ".2f") == "37.15 ± 0.92"
    assert script._with_ci({"mean": 33.3, "ci95": None}, ".2f") == "33.30"
    assert script._with_ci({"mean": None, "ci95": None}, ".2f") == "-"
