"""The README's results table is rendered from a study's results.json, not typed."""

from __future__ import annotations

import pytest

from adadsf_lab.readme_table import BEGIN, END, _with_ci, block, render_into


def _stat(mean, ci=None):
    return {"mean": mean, "ci95": ci}


def _summary(method, budget, seeds, ppl, flops, prefill, decode):
    metrics = {
        "ppl_test": _stat(*ppl),
        "task_mean": _stat(0.4),
        "normalized_flops": _stat(flops),
        "prefill_speedup": _stat(prefill),
        "decode_speedup": _stat(decode),
    }
    return {"method": method, "budget": budget, "seeds": seeds, "metrics": metrics}


RESULTS = {
    "summary": [
        _summary("dense", 1.0, [0], (30.0,), 1.0, 1.0, 1.0),
        _summary("adadsf_ridge_kv_err", 0.9, [0], (31.0,), 0.93, 0.8, 0.9),
        _summary("adadsf_ridge_kv_err", 0.8, [0, 1, 2], (33.0, 0.5), 0.84, 0.88, 0.78),
        _summary("layer_drop_healed", 0.8, [0, 1, 2], (36.0, 0.2), 0.83, 1.26, 1.17),
        _summary("uniform", 0.8, [0], (50.0,), 0.8, 1.0, 1.0),
    ]
}


def test_the_table_shows_the_shipped_budget_with_the_most_seeds():
    lines = block(RESULTS)
    assert "budget 0.8," in lines[0]
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| dense",
        "| **AdaDSF, the shipped recipe**",
        "| layer removal (ShortGPT) + healing",
    ]
    assert "33.00 ± 0.50 | 1.10 |" in rows[2] and "| 0.88 | 0.78 |" in rows[2]


def test_rendering_replaces_only_the_text_between_the_markers():
    readme = f"intro\n{BEGIN}\nold table\n{END}\noutro\n"
    out = render_into(readme, RESULTS)
    assert out.startswith("intro\n" + BEGIN) and out.endswith(END + "\noutro\n")
    assert "old table" not in out
    with pytest.raises(ValueError, match="markers"):
        render_into("no markers", RESULTS)


def test_the_table_drops_an_interval_that_rounds_to_zero():
    assert _with_ci({"mean": 61.6, "ci95": 2e-14}, ".2f") == "61.60"
    assert _with_ci({"mean": 37.15, "ci95": 0.918}, ".2f") == "37.15 ± 0.92"
    assert _with_ci({"mean": 33.3, "ci95": None}, ".2f") == "33.30"
    assert _with_ci({"mean": None, "ci95": None}, ".2f") == "-"


def test_the_caption_says_when_an_older_plugin_computed_the_runs():
    assert "older plug-in" not in block(RESULTS)[0]
    older = {**RESULTS, "older_algorithm": {"runs": 2, "areas": {"adadsf": [2]}}}
    assert "runs computed by an older plug-in than this one" in block(older)[0]
    # with the headline counts: only the table's own rows count
    counted = {**older, "headline": {"current": {}, "older": {"uniform": 2}}}
    assert "older plug-in" not in block(counted)[0]
    counted["headline"]["older"]["layer_drop_healed"] = 1
    assert "older plug-in" in block(counted)[0]


def test_the_table_shows_the_tuning_budget_where_the_shipped_recipe_ran():
    tuned = {**RESULTS, "settings": {"tune_budget": 0.9}}
    assert "budget 0.9," in block(tuned)[0]
