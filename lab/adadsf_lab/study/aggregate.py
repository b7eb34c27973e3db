"""From finished run records to ``results.json``: per-method summaries with 95%
intervals, paired comparisons and their verdicts. Everything the rendered
``RESULTS.md`` shows is in this dict; nothing there is typed by hand. The wall-clock
picture (frontier, verdicts on speed) is :mod:`.wall_clock`'s."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from adadsf_lab.study.methods import METHODS, by_method_and_budget
from adadsf_lab.study.per_text import budget_per_text, quality_per_text
from adadsf_lab.study.run_cache import OLDER_ALGORITHM
from adadsf_lab.study.stats import (
    mean_ci,
    paired_difference,
    verdict,
)
from adadsf_lab.study.targets import target_rows, target_sentence
from adadsf_lab.study.task_resolution import task_resolution
from adadsf_lab.study.wall_clock import wall_clock

__all__ = [
    "COMPARISONS",
    "HEADLINE_METHODS",
    "PAPER_RESULTS",
    "SUMMARY_METRICS",
    "build_results",
    "headline_budget",
]

COMPARISONS: tuple[tuple[str, str], ...] = (
    ("adadsf", "uniform"),
    ("adadsf", "layer_drop"),
    ("adadsf", "layer_drop_healed"),
    ("reversed", "uniform"),
    ("random", "uniform"),
    ("adadsf", "reversed"),
    ("adadsf", "random"),
    ("uniform", "layer_drop_healed"),
    ("layer_drop_healed", "layer_drop"),
    ("adadsf", "adadsf_no_align"),
    ("adadsf", "adadsf_lm_only"),
    # the LM loss's cost of depth sparsity: against the dense model fine-tuned alike
    # (the LM loss also adapts any model to the calibration text's corpus)
    ("adadsf_lm_only", "dense_lm"),
    ("adadsf_w8a8", "adadsf"),
    ("adadsf_ridge_kv_err_w8a8", "adadsf_ridge_kv_err"),
    ("adadsf_ridge_kv", "adadsf"),
    ("adadsf_ridge_kv", "uniform"),
    ("adadsf_ridge_kv", "layer_drop_healed"),
    ("adadsf_ridge_kv", "layer_drop_ridge"),
    ("adadsf_ridge_kv", "adadsf_ridge_kv_no_align"),
    ("adadsf_ridge_kv_err", "adadsf_ridge_kv"),
    ("adadsf_ridge_kv_err", "uniform"),
    ("adadsf_ridge_kv_err", "layer_drop_healed"),
    ("adadsf_ridge_kv_err", "layer_drop_ridge_healed"),
    ("adadsf_ridge_kv_err", "adadsf_ridge_kv_err_lm_only"),
    ("adadsf_ridge_kv_err_lm_only", "dense_lm_ridge_kv_err"),
    ("layer_drop_ridge", "layer_drop"),
    ("layer_drop_ridge", "layer_drop_healed"),
    ("adadsf_ridge_kv", "layer_drop_ridge_healed"),
    ("layer_drop_ridge_healed", "layer_drop_healed"),
    ("ftp", "adadsf"),
    ("ftp", "adadsf_ridge_kv_err"),  # FTP against the AdaDSF the recipes ship
    ("ftp", "uniform"),
    ("ftp", "layer_drop_healed"),
    ("ftp_quantile", "ftp"),
    ("ftp_ridge_kv", "adadsf_ridge_kv"),
    ("ftp_ridge_kv", "adadsf_ridge_kv_err"),
    ("ftp_ridge_kv", "layer_drop_healed"),
    ("ftp_ridge_kv_quantile", "ftp_ridge_kv"),
    ("ftp_ridge_kv_quantile", "adadsf_ridge_kv_err"),
    ("ftp_ridge_kv_quantile", "layer_drop_healed"),
)
"""``(a, b)``: ``a - b`` per seed. AdaDSF against uniform and against layer removal
first: the questions the method's reviewers asked."""

SHIPPED_METHOD = "adadsf_ridge_kv_err"
#: the runs behind the README's table and the verdicts of AdaDSF against its baselines
HEADLINE_METHODS = (
    "dense",
    SHIPPED_METHOD,
    "layer_drop_healed",
    "uniform",
    "adadsf",
    "reversed",
    "random",
)

COMPARED_METRICS = {"ppl_test": True, "task_mean": False}  # name -> lower is better

SUMMARY_METRICS = (
    "normalized_flops",
    "normalized_flops_with_lm_head",
    "normalized_flops_topk",
    "ppl_test",
    "ppl_test_topk",
    "ppl_val",
    "task_mean",
    "prefill_speedup",
    "decode_speedup",
    "align_seconds",
    "align_peak_memory_mb",
    "seconds",
)

PAPER_RESULTS: list[dict[str, Any]] = [
    # arXiv 2607.21291's reported numbers (single seed, no error bars)
    {
        "setting": "GPT-NeoX-130M, WikiText-103 PPL",
        "method": "dense",
        "result": 17.9,
        "normalized_flops": 1.000,
    },
    {
        "setting": "80% retention",
        "method": "MoD (uniform)",
        "result": 21.6,
        "normalized_flops": 0.778,
    },
    {
        "setting": "80% retention",
        "method": "DLO",
        "result": 19.6,
        "normalized_flops": 0.964,
    },
    {
        "setting": "80% retention",
        "method": "D-LLM",
        "result": 2019,
        "normalized_flops": 0.886,
    },
    {
        "setting": "80% retention",
        "method": "AdaDSF",
        "result": 18.9,
        "normalized_flops": 0.787,
    },
    {
        "setting": "70% retention",
        "method": "AdaDSF",
        "result": 19.9,
        "normalized_flops": 0.680,
    },
    {
        "setting": "Qwen2.5-0.5B, mean of 6 commonsense tasks",
        "method": "dense",
        "result": 51.7,
        "normalized_flops": 1.000,
    },
    {
        "setting": "Qwen2.5-0.5B",
        "method": "MoD",
        "result": 44.4,
        "normalized_flops": 0.784,
    },
    {
        "setting": "Qwen2.5-0.5B",
        "method": "DLO",
        "result": 48.3,
        "normalized_flops": 0.973,
    },
    {
        "setting": "Qwen2.5-0.5B",
        "method": "AdaDSF",
        "result": 49.1,
        "normalized_flops": 0.785,
    },
]


def _summary(runs: list[dict], tasks: list[str]) -> list[dict[str, Any]]:
    out = []
    for (method, budget), rs in by_method_and_budget(runs):
        metrics = {
            m: mean_ci([r.get(m) for r in rs]).as_dict() for m in SUMMARY_METRICS
        }
        for t in tasks:
            metrics[f"task:{t}"] = mean_ci(
                [r.get("tasks", {}).get(t) for r in rs]
            ).as_dict()
        out.append(
            {
                "method": method,
                "label": METHODS[method].label,
                "budget": budget,
                "seeds": sorted(r["seed"] for r in rs),
                "layers_kept": sorted({r.get("layers_kept") for r in rs} - {None}),
                "metrics": metrics,
            }
        )
    return out


def _comparisons(runs: list[dict]) -> tuple[list[dict], list[str]]:
    by: dict[tuple[str, float], dict[int, dict]] = defaultdict(dict)
    for r in runs:
        by[(r["method"], r["budget"])][r["seed"]] = r
    budgets = sorted(
        {r["budget"] for r in runs if r["method"] != "dense"}, reverse=True
    )
    rows, sentences = [], []
    for a, b in COMPARISONS:
        for budget in budgets:
            # a dense control has one budget (1.0): it is paired at every budget
            b_budget = 1.0 if METHODS[b].allocation is None else budget
            ra, rb = by.get((a, budget)), by.get((b, b_budget))
            if not ra or not rb:
                continue
            # a seed pairs only runs one plug-in computed: a difference across two
            # codes would measure the code change as well as the methods
            seeds = {
                s
                for s in set(ra) & set(rb)
                if (OLDER_ALGORITHM in ra[s]) == (OLDER_ALGORITHM in rb[s])
            }
            if not seeds and set(ra) & set(rb):
                sentences.append(
                    f"{METHODS[a].label} vs {METHODS[b].label} at {budget:g}: no seed "
                    "has runs of both computed by the same plug-in, no comparison"
                )
            ra = {s: r for s, r in ra.items() if s in seeds}
            rb = {s: r for s, r in rb.items() if s in seeds}
            for metric, lower in COMPARED_METRICS.items():
                diff = paired_difference(
                    {s: r.get(metric) for s, r in ra.items()},
                    {s: r.get(metric) for s, r in rb.items()},
                )
                if diff is None:
                    continue
                text = verdict(
                    METHODS[a].label, METHODS[b].label, budget, metric, diff, lower
                )
                rows.append(
                    {
                        "a": a,
                        "b": b,
                        "budget": budget,
                        "metric": metric,
                        "lower_is_better": lower,
                        **diff.as_dict(),
                        "verdict": text,
                    }
                )
                sentences.append(text)
    return rows, sentences


def headline_budget(results: dict[str, Any]) -> float:
    """The budget the README's table shows: the study's tuning budget (the shipped
    recipe's) where the shipped recipe has runs, else the shipped recipe's budget with
    the most seeds (ties: the highest)."""
    runs = [s for s in results["summary"] if s["method"] == SHIPPED_METHOD]
    if not runs:
        raise ValueError(
            f"results hold no run of the shipped recipe ({SHIPPED_METHOD})"
        )
    tuned = results.get("settings", {}).get("tune_budget")
    if any(s["budget"] == tuned for s in runs):
        return tuned
    return max(runs, key=lambda s: (len(s["seeds"]), s["budget"]))["budget"]


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    """``{budget, current: {method: runs}, older: {method: runs}}``: how many of the
    :data:`HEADLINE_METHODS` runs at :func:`headline_budget` this plug-in computed,
    and how many an older one did; ``{}`` without a shipped-recipe run."""
    try:
        budget = headline_budget(results)
    except ValueError:
        return {}
    out: dict[str, Any] = {"budget": budget, "current": {}, "older": {}}
    for r in [results["dense"], *results["runs"]]:
        if r and r["method"] in HEADLINE_METHODS and r["budget"] in (budget, 1.0):
            side = out["older" if OLDER_ALGORITHM in r else "current"]
            side[r["method"]] = side.get(r["method"], 0) + 1
    return out


def build_results(
    dense: dict | None,
    runs: list[dict],
    tuning: list[dict],
    tuned: dict[str, Any],
    settings: dict[str, Any],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The ``results.json`` document (see the module docstring of
    :mod:`adadsf_lab.study`)."""
    tasks = list(settings.get("tasks", []))
    with_dense = ([dense] if dense else []) + runs
    comparisons, verdicts = _comparisons(runs)
    targets = target_rows(dense, runs)
    for row in targets:
        row["sentence"] = target_sentence(row)
    task_n = (dense or {}).get("task_n") or next(
        (r.get("task_n") for r in runs if r.get("task_n")), {}
    )
    resolution = task_resolution(task_n, (dense or {}).get("tasks"))
    summary = _summary(with_dense, tasks)
    results = {
        "generator": "adadsf study",
        **meta,
        "settings": settings,
        "tuned": tuned,
        "tuning": tuning,
        "dense": dense,
        "runs": runs,
        "summary": summary,
        "comparisons": comparisons,
        "verdicts": verdicts,
        "targets": targets,
        "wall_clock": wall_clock(summary, with_dense, settings),
        "budget_per_text": budget_per_text(runs),
        "quality_per_text": quality_per_text(dense, runs),
        "task_resolution": resolution,
        "paper": PAPER_RESULTS,
    }
    results["headline"] = _headline(results)
    return results
