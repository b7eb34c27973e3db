"""The study's wall-clock picture (``study/wall_clock.py``): the Pareto frontier of
test PPL against measured speedup, the shipped method's verdict on speed against
healed layer removal, and their rendering, on small constructed results (never
docs/results)."""

from __future__ import annotations

import json

import pytest

from adadsf_lab.study.aggregate import build_results
from adadsf_lab.study.plots import PLOT_FILES, write_plots
from adadsf_lab.study.render import render_markdown
from adadsf_lab.study.settings import StudySettings
from adadsf_lab.study.stats import paired_difference
from adadsf_lab.study.tuning import Tuned
from adadsf_lab.study.wall_clock import dominates, pareto_front

TUNED = Tuned(3e-4, 0.05, 10.0, "validation split")
SHIPPED, BASELINE = "adadsf_ridge_kv_err", "layer_drop_healed"


# ------------------------------------------------------------------------ the frontier
def test_a_dominated_point_is_off_the_frontier():
    # (ppl, speedup): lower PPL and higher speedup are better
    pts = [(30.0, 1.0), (35.0, 1.3), (40.0, 1.2), (50.0, 1.5), (33.0, 0.9)]
    # (40, 1.2) is beaten by (35, 1.3) on both; (33, 0.9) by (30, 1.0) on both
    assert pareto_front(pts) == [True, True, False, True, False]


def test_frontier_ties_equal_points_stay_and_weakly_dominated_points_go():
    pts = [
        (30.0, 1.2),
        (30.0, 1.2),  # the same point twice: neither dominates the other
        (30.0, 1.1),  # same PPL, slower: dominated
        (32.0, 1.2),  # same speed, higher PPL: dominated
        (25.0, 0.9),
    ]
    assert pareto_front(pts) == [True, True, False, False, True]


def test_frontier_ignores_missing_points():
    pts = [(30.0, None), (float("nan"), 2.0), (40.0, 1.0), (None, None)]
    # an untimed point neither sits on the frontier nor knocks (40, 1.0) off it
    assert pareto_front(pts) == [False, False, True, False]
    assert pareto_front([]) == []


def _point(prefill: float | None, decode: float | None) -> dict:
    def stat(x: float | None) -> dict | None:
        return None if x is None else {"mean": x, "ci95": None, "n": 1}

    return {"prefill_speedup": stat(prefill), "decode_speedup": stat(decode)}


def test_domination_needs_both_speeds_and_a_significantly_lower_ppl():
    lower = paired_difference({0: 30.0, 1: 31.0, 2: 32.0}, {0: 32.0, 1: 33.2, 2: 34.1})
    unsure = paired_difference({0: 30.0, 1: 35.0, 2: 32.0}, {0: 32.0, 1: 33.0, 2: 34.0})
    one_seed = paired_difference({0: 30.0}, {0: 35.0})
    b = _point(1.2, 1.1)
    assert dominates(_point(1.3, 1.1), b, lower) is True  # a tie in decode is enough
    assert dominates(_point(1.3, 1.05), b, lower) is False  # slower at decode
    assert dominates(_point(1.3, 1.2), b, unsure) is False  # PPL not significant
    assert dominates(_point(1.3, 1.2), b, one_seed) is False  # no interval
    assert dominates(_point(None, 1.2), b, lower) is None  # not timed
    assert dominates(_point(1.3, 1.2), b, None) is None  # no paired PPL


# ------------------------------------------------------------------------ results
def _record(method, budget, seed, ppl, flops, prefill=None, decode=None, cpu="A"):
    r = {
        "method": method, "budget": budget, "seed": seed, "ppl_test": ppl,
        "ppl_test_topk": ppl, "ppl_val": ppl, "task_mean": 0.5, "tasks": {},
        "normalized_flops": flops, "normalized_flops_with_lm_head": flops,
        "seconds": 1.0, "prefill_speedup": prefill, "decode_speedup": decode,
        "hardware": {"cpu": cpu},
    }  # fmt: skip
    if prefill is not None:  # only a routed run's speed has cells
        r["speed"] = {"cells": []}
    return r


def _results(shipped: tuple[float, float], ppl_shift: float, seeds: int = 3) -> dict:
    """Dense at PPL 30; at budget 0.8 healed layer removal (PPL 40 + seed, 1.3x /
    1.2x), the shipped method (its PPL ``ppl_shift`` from layer removal's, speedups
    ``shipped``) and uniform (PPL 60, 1.5x / 1.4x); speed timed on seed 0 only."""
    dense = _record("dense", 1.0, 0, 30.0, 1.0, 1.0, 1.0)
    dense.pop("speed")
    runs = []
    for s in range(seeds):
        timed = s == 0
        ld = (1.3, 1.2) if timed else (None, None)
        sh = shipped if timed else (None, None)
        un = (1.5, 1.4) if timed else (None, None)
        jitter = 0.1 * s * s  # paired differences that vary a little from seed to seed
        runs += [
            _record(BASELINE, 0.8, s, 40.0 + s, 0.80, *ld),
            _record(SHIPPED, 0.8, s, 40.0 + s + ppl_shift + jitter, 0.82, *sh),
            _record("uniform", 0.8, s, 60.0 + s, 0.79, *un, cpu="B"),
        ]
    settings = StudySettings(
        tasks=(), methods=("dense", SHIPPED, "uniform", BASELINE), budgets=(0.8,),
        seeds=seeds, flops_reference=SHIPPED,
    ).model_dump(mode="json")  # fmt: skip
    meta = {
        "command": "adadsf study --test",
        "date": "2026-12-01",
        "hardware": {"summary": "test box"},
        "model": {"name": "tiny", "fingerprint": "ab" * 32},
        "runtime": {
            "this_invocation_s": 1.0,
            "sum_of_runs_s": 1.0,
            "runs_total": len(runs) + 1,
            "runs_computed": 0,
            "runs_cached": len(runs) + 1,
        },
    }
    return build_results(dense, runs, [], TUNED.__dict__, settings, meta)


def _verdict(res: dict) -> dict:
    (v,) = res["wall_clock"]["verdicts"]
    return v


def test_shipped_slower_misses_and_says_by_how_much():
    res = _results(shipped=(0.9, 0.8), ppl_shift=-2.0)
    json.dumps(res)  # JSON-able as it stands
    v = _verdict(res)
    assert (v["a"], v["b"], v["budget"], v["dominates"]) == (
        SHIPPED,
        BASELINE,
        0.8,
        False,
    )
    assert v["prefill_gap"] == pytest.approx(-0.4)
    assert v["decode_gap"] == pytest.approx(-0.4)
    s = v["sentence"]
    assert ": misses: prefill speedup 0.400 lower, decode speedup 0.400 lower." in s
    assert ": dominates" not in s
    assert "prefill 0.900x vs 1.300x, decode 0.800x vs 1.200x" in s
    d = v["ppl_diff"]
    assert d["n_seeds"] == 3 and d["mean_diff"] < 0 and d["significant"]
    assert f"test PPL {d['mean_diff']:+.2f} ± {d['ci95']:.2f} (3 seeds)" in s
    # uniform is faster than layer removal but far worse: nobody dominates it
    assert v["dominated_by"] == []
    assert "No method at 0.8 dominates layer removal + healing." in s
    md = render_markdown(res)
    assert "## Verdicts on wall-clock" in md and f"- {s}" in md


def test_shipped_faster_with_lower_ppl_dominates():
    v = _verdict(_results(shipped=(1.4, 1.2), ppl_shift=-2.0))
    assert v["dominates"] is True
    assert ": dominates." in v["sentence"] and "misses" not in v["sentence"]
    assert (
        "significant: AdaDSF + ridge + K/V, skip-error routers is better"
        in (v["sentence"])
    )


def test_shipped_faster_but_worse_ppl_misses_on_ppl_only():
    v = _verdict(_results(shipped=(1.4, 1.3), ppl_shift=+2.0))
    assert v["dominates"] is False
    assert ": misses: test PPL higher by 2.17." in v["sentence"]  # 2 + mean jitter
    assert "lower" not in v["sentence"].split("Speedup")[0]


def test_one_seed_cannot_establish_domination():
    v = _verdict(_results(shipped=(1.4, 1.3), ppl_shift=-2.0, seeds=1))
    assert v["dominates"] is False
    assert ": misses: lower test PPL not established (1 seed)." in v["sentence"]


def test_the_method_that_dominates_layer_removal_is_named():
    res = _results(shipped=(0.9, 0.8), ppl_shift=-2.0)
    for r in res["runs"]:  # uniform: now faster and better than layer removal
        if r["method"] == "uniform":
            r["ppl_test"] = 35.0 + r["seed"] + 0.1 * r["seed"] ** 2
    res = build_results(
        res["dense"], res["runs"], [], TUNED.__dict__, res["settings"], res
    )
    v = _verdict(res)
    assert v["dominated_by"] == ["uniform"]
    assert (
        "Dominating layer removal + healing at 0.8: uniform (MoD) (prefill"
        in (v["sentence"])
    )


def test_pareto_section_marks_frontier_and_counts_timed_seeds(tmp_path):
    res = _results(shipped=(0.9, 0.8), ppl_shift=-2.0)
    points = {p["method"]: p for p in res["wall_clock"]["points"]}
    # dense (30, 1.0x) beats the shipped method (~39, 0.9x / 0.8x) outright
    assert points["dense"]["frontier"] == {"prefill": True, "decode": True}
    assert points[SHIPPED]["frontier"] == {"prefill": False, "decode": False}
    assert points[SHIPPED]["dominated_by_dense"] is True
    assert points[BASELINE]["frontier"] == {"prefill": True, "decode": True}
    assert points["uniform"]["frontier"] == {"prefill": True, "decode": True}
    assert (
        points[BASELINE]["timed_seeds"] == [0] and len(points[BASELINE]["seeds"]) == 3
    )
    md = render_markdown(res)
    assert "## Wall-clock Pareto" in md
    row = next(
        line
        for line in md.splitlines()
        if line.startswith("| 0.8 | layer removal + healing |")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    # budget, method, seeds, PPL, timed seeds, prefill, decode, FLOPs, frontiers
    assert cells[0] == "0.8" and cells[2] == "3" and cells[4] == "1"
    assert cells[5:8] == ["1.300", "1.200", "0.800 ± 0.000"]
    assert cells[8:] == ["**yes**", "**yes**"]
    assert "| - | dense | 1 | 30.00 | reference | 1.000 | 1.000 |" in md
    assert "Timed on B: uniform (MoD) at 0.8. Every other point on A." in md
    assert f"]({PLOT_FILES[3]})" in md
    paths = write_plots(res, tmp_path)
    assert (tmp_path / PLOT_FILES[3]) in paths
    assert (tmp_path / PLOT_FILES[3]).read_bytes()[:4] == b"\x89PNG"
