"""Pair two sets of one study cache's runs by seed, where the study's own comparisons
cannot: runs of the same method under other settings (issue 13: the shipped variant
with 50 alignment steps against its 100-step runs and the baselines,
lab/NOTEBOOK.md §16.3).

The study pairs methods run with the *same* settings; a run computed with another
``--set`` (``align_steps=50``, ``align_anneal_steps=25``) lives in the same cache under
its own key but is left out of the rendered study. This selects each side by method,
budget and any setting of its run config (``key=value``, looked up in the run's
``modifier`` fields, then its ``data`` fields, then the config itself), pairs the two
sides by seed (a seed fixes the calibration sample, router initialisation and training
order) and reports, with the study's statistics (``study/stats.py``): each side's test
PPL as a multiple of the cache's dense run (mean and 95% interval: issue 13's quality
target), its measured FLOPs and longest alignment, and the paired differences.

    python benchmarks/paired_runs.py docs/results/runs \\
        'adadsf_ridge_kv_err@0.81:align_steps=50' \\
        'adadsf_ridge_kv_err@0.81:align_steps=100'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from adadsf_lab.study.run_cache import RunCache
from adadsf_lab.study.stats import mean_ci, paired_difference, verdict

_METRICS = (  # (record key, lower is better)
    ("ppl_test", True), ("ppl_val", True), ("task_mean", False),
    ("normalized_flops", True), ("align_seconds", True),
)  # fmt: skip


def _parse(spec: str) -> tuple[str, float, dict[str, str]]:
    """``method@budget[:key=value,...]`` -> ``(method, budget, {key: value})``."""
    head, _, rest = spec.partition(":")
    method, at, budget = head.partition("@")
    if not at:
        raise SystemExit(f"{spec!r}: expected method@budget[:key=value,...]")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{spec!r}: {item!r} is not key=value")
        fields[key.strip()] = value.strip()
    return method, float(budget), fields


def _setting(cfg: dict[str, Any], key: str) -> Any:
    for where in (cfg.get("modifier") or {}, cfg.get("data") or {}, cfg):
        if key in where:
            return where[key]
    return None


def _matches(value: Any, wanted: str) -> bool:
    """``value`` (from JSON) equals ``wanted`` (text), numbers compared as numbers."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() == wanted.lower()
    if isinstance(value, int | float):
        try:
            return float(value) == float(wanted)
        except ValueError:
            return False
    return str(value) == wanted


def select(cache: list[dict[str, Any]], spec: str) -> dict[int, dict[str, Any]]:
    """``{seed: record}`` of the main runs ``spec`` names; refuses two runs of one
    seed (the settings given do not single out one configuration)."""
    method, budget, fields = _parse(spec)
    out: dict[int, dict[str, Any]] = {}
    for entry in cache:
        cfg = entry["config"]
        if (cfg["phase"], cfg["method"]) != ("main", method) or cfg["budget"] != budget:
            continue
        if all(_matches(_setting(cfg, k), v) for k, v in fields.items()):
            if cfg["seed"] in out:
                raise SystemExit(
                    f"{spec}: two runs of seed {cfg['seed']}; name the setting that "
                    "tells them apart (e.g. align_steps=100)"
                )
            out[cfg["seed"]] = entry["record"]
    if not out:
        raise SystemExit(f"no main run matches {spec}")
    return out


def summary(runs: dict[int, dict[str, Any]], dense: dict[str, Any]) -> dict[str, Any]:
    """Per seed and overall: test PPL over dense, measured FLOPs, alignment minutes."""
    ratio = [r["ppl_test"] / dense["ppl_test"] for r in runs.values()]
    align = [r.get("align_seconds") or 0.0 for r in runs.values()]
    return {
        "seeds": sorted(runs),
        "x_dense": mean_ci(ratio).as_dict(),
        "normalized_flops": mean_ci(
            [r["normalized_flops"] for r in runs.values()]
        ).as_dict(),
        "align_minutes_max": max(align) / 60.0,
        "per_seed": {s: {k: runs[s].get(k) for k, _ in _METRICS} for s in sorted(runs)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="a study cache (--cache-dir)")
    p.add_argument("a", help="method@budget[:key=value,...]")
    p.add_argument("b", help="the same for the other side")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    cache = list(RunCache(args.cache))
    [dense] = select(cache, "dense@1").values()
    a, b = select(cache, args.a), select(cache, args.b)
    out: dict[str, Any] = {
        "dense": {k: dense.get(k) for k in ("ppl_test", "ppl_val", "task_mean")},
        "a": {"spec": args.a, **summary(a, dense)},
        "b": {"spec": args.b, **summary(b, dense)},
        "comparisons": [],
    }
    budget = _parse(args.a)[1]
    for metric, lower in _METRICS:
        diff = paired_difference(
            {s: r.get(metric) for s, r in a.items()},
            {s: r.get(metric) for s, r in b.items()},
        )
        text = verdict(args.a, args.b, budget, metric, diff, lower)
        if metric == "normalized_flops" and diff is not None and diff.ci95 is not None:
            # the study's sentence rounds to 2 decimals, too coarse for FLOPs
            text = f"{args.a} vs {args.b}: measured FLOPs {diff.mean_diff:+.4f} ± " + (
                f"{diff.ci95:.4f} ({diff.n_seeds} seeds)"
            )
        out["comparisons"].append(
            {"metric": metric, **(diff.as_dict() if diff else {}), "verdict": text}
        )
    print(json.dumps(out, indent=1))
    for side in ("a", "b"):
        s = out[side]
        x = s["x_dense"]
        ci = f" ± {x['ci95']:.3f}" if x["ci95"] is not None else ""
        print(
            f"{s['spec']}: seeds {s['seeds']}, test PPL {x['mean']:.3f}{ci}x dense at "
            f"{s['normalized_flops']['mean']:.3f} measured FLOPs, alignment "
            f"{s['align_minutes_max']:.1f} min at most"
        )
    for c in out["comparisons"]:
        print(c["verdict"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
