"""The study's four figures, drawn from ``results.json``'s summary (matplotlib, Agg).

* ``results_ppl_vs_flops.png``: test perplexity (causal routing) against *measured*
  normalized FLOPs, one line per method over the budgets, 95% intervals as whiskers in
  both directions: the Pareto picture (lower left is better), with the quality
  targets (``targets.PPL_TARGETS``, multiples of the dense model's perplexity) drawn
  as dashed limits where they fall inside the plotted FLOPs range.
* ``results_acc_vs_speedup.png``: 7-task mean accuracy against measured prefill speedup
  (batch 1), for the runs whose speed was measured.
* ``results_layer_ratios.png``: each method's per-layer retention ratios at the tuning
  budget (seed 0): AdaDSF's similarity allocation (the paper's and the shipped
  variant's) beside FTP's genetic schedule, uniform and layer removal.
* ``results_ppl_vs_speed.png``: test perplexity against measured prefill and decode
  speedup (batch 1), two panels, every method at every budget (each point labelled with
  its budget), dense at (its PPL, 1.0x), and the Pareto frontier of lower PPL and higher
  speedup (``results.json``'s ``wall_clock``, :mod:`.wall_clock`) as a staircase.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.targets import PPL_TARGETS
from adadsf_modifier.atomic import atomic_write_bytes

__all__ = ["PLOT_FILES", "styles", "target_segments", "write_plots"]

PLOT_FILES = (
    "results_ppl_vs_flops.png",
    "results_acc_vs_speedup.png",
    "results_layer_ratios.png",
    "results_ppl_vs_speed.png",
)
_RATIO_METHODS = (
    "adadsf",
    "adadsf_ridge_kv_err",  # the shipped AdaDSF: the same allocation, its own run
    "ftp",
    "ftp_ridge_kv",
    "uniform",
    "layer_drop",
)


def _xy(row: dict, x: str, y: str) -> tuple[float, float, float, float] | None:
    mx, my = row["metrics"].get(x), row["metrics"].get(y)
    if not mx or not my or mx["n"] == 0 or my["n"] == 0:
        return None
    return mx["mean"], my["mean"], mx["ci95"] or 0.0, my["ci95"] or 0.0


def _draw(ax, rows: list[dict], x: str, y: str, style: dict) -> int:
    by_method: dict[str, list[tuple]] = {}
    labels: dict[str, str] = {}
    for row in rows:
        pt = _xy(row, x, y)
        if pt is not None:
            by_method.setdefault(row["method"], []).append(pt)
            labels[row["method"]] = row["label"]
    for method, pts in by_method.items():
        pts.sort()
        xs, ys, ex, ey = zip(*pts)
        color, marker = style[method]
        ax.errorbar(
            xs,
            ys,
            xerr=ex,
            yerr=ey,
            color=color,
            marker=marker,
            capsize=3,
            label=labels[method],
        )
    return len(by_method)


def styles(methods: set[str]) -> dict[str, tuple[Any, str]]:
    """Each method's colour and marker, the same in every figure of one study: dense a
    black star, the others in the registry's order through the 20 colours of tab20
    (the 10 dark shades first, then the 10 light ones with another marker): the study
    has more than 10 methods, and two alike would read as one."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    out: dict[str, tuple[Any, str]] = {"dense": ("black", "*")}
    others = [m for m in METHODS if m in methods and m != "dense"]
    others += sorted(methods - set(METHODS) - {"dense"})
    for i, m in enumerate(others):
        out[m] = (tab20((2 * i + i // 10) % 20), "osD^v"[i // 10 % 5])
    return out


def target_segments(
    dense_ppl: float, x_lo: float, x_hi: float
) -> list[tuple[float, float, float, float]]:
    """``(x_from, x_to, ppl_limit, max_ratio)`` of each quality target inside the FLOPs
    range ``[x_lo, x_hi]``: target ``i`` holds from the previous target's ``max_flops``
    (exclusive) to its own, at ``max_ratio`` times the dense perplexity."""
    out, start = [], float("-inf")
    for t in PPL_TARGETS:
        a, b = max(start, x_lo), min(t.max_flops, x_hi)
        if a < b:
            out.append((a, b, dense_ppl * t.max_ratio, t.max_ratio))
        start = t.max_flops
    return out


def _draw_targets(ax, rows: list[dict]) -> None:
    """Each target's limit over its FLOPs range within the points' x-range (kept);
    the y-axis grows to show a limit that lies above or below every point."""
    dense = next((r for r in rows if r["method"] == "dense"), None)
    ppl = (dense or {}).get("metrics", {}).get("ppl_test") or {}
    if not ppl.get("n"):
        return
    x_lo, x_hi = ax.get_xlim()
    for a, b, y, ratio in target_segments(ppl["mean"], x_lo, x_hi):
        ax.hlines(y, a, b, colors="0.4", linestyles="dashed", linewidth=1)
        ax.annotate(
            f"target {ratio:.2f}x dense",
            (a, y),
            textcoords="offset points",
            xytext=(2, 3),
            fontsize=7,
            color="0.3",
        )
    ax.set_xlim(x_lo, x_hi)


def _draw_speed(ax, points: list[dict], kind: str, style: dict) -> int:
    """One panel of the wall-clock picture: each method's points joined from its
    highest budget down (95% intervals as whiskers where there are several seeds), the
    budget beside each point, and the frontier as a staircase: a point above and left of
    it is dominated."""
    x = f"{kind}_speedup"
    by_method: dict[str, list[tuple[float, tuple]]] = {}
    labels: dict[str, str] = {}
    for p in points:
        pt = _xy({"metrics": p}, x, "ppl_test")
        if pt is None:
            continue
        by_method.setdefault(p["method"], []).append((-p["budget"], pt))
        labels[p["method"]] = p["label"]
        if not p["reference"]:
            ax.annotate(
                f"{p['budget']:g}",
                pt[:2],
                textcoords="offset points",
                xytext=(4, -8),
                fontsize=6,
                color="0.35",
            )
    for method, pts in by_method.items():
        xs, ys, ex, ey = zip(*(pt for _, pt in sorted(pts)))
        color, marker = style[method]
        ax.errorbar(
            xs,
            ys,
            xerr=ex,
            yerr=ey,
            color=color,
            marker=marker,
            markersize=9 if method == "dense" else 6,
            capsize=3,
            label=labels[method],
        )
    front = sorted(
        _xy({"metrics": p}, x, "ppl_test")[:2]
        for p in points
        if (p.get("frontier") or {}).get(kind)
    )
    if front:
        xs, ys = zip(*front)
        ax.step(
            xs,
            ys,
            where="pre",
            color="0.2",
            linestyle="dashed",
            linewidth=1.2,
            label="Pareto frontier",
            zorder=0,
        )
    ax.axvline(1.0, color="0.6", linewidth=0.8, linestyle="dotted")
    return len(by_method)


def _save(fig, path: Path) -> None:
    """Atomically, through an unpredictable temporary name (a reader never sees half a
    PNG, and a link planted at a fixed name is never followed)."""
    image = io.BytesIO()
    fig.savefig(image, dpi=120, format="png")
    atomic_write_bytes(path, image.getvalue())


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]
    model = results.get("model", {}).get("name", "")
    style = styles(
        {r["method"] for r in rows} | {r["method"] for r in results.get("runs", [])}
    )
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5.5))
    n = _draw(ax, rows, "normalized_flops", "ppl_test", style)
    ax.set_xlabel("measured normalized FLOPs (decoder stack + routers)")
    ax.set_ylabel("test perplexity (causal routing)")
    if n:
        ax.set_yscale("log")
        _draw_targets(ax, rows)
        ax.legend(fontsize=8)
    ax.set_title(f"{model}\nperplexity vs measured FLOPs (95% CI over seeds)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / PLOT_FILES[0])
    _save(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5.5))
    n = _draw(ax, rows, "prefill_speedup", "task_mean", style)
    ax.set_xlabel("measured prefill speedup vs the dense twin (batch 1)")
    ax.set_ylabel("mean accuracy over the lm-eval tasks")
    if n:
        ax.legend(fontsize=8)
    ax.set_title(f"{model}\naccuracy vs measured speedup")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / PLOT_FILES[1])
    _save(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    budget = results.get("settings", {}).get("tune_budget")
    for run in results.get("runs", []):
        ratios = run.get("retention_ratios")
        ok = run["method"] in _RATIO_METHODS and run["seed"] == 0
        if ok and ratios and run["budget"] == budget:
            color = style[run["method"]][0]
            ax.step(
                range(len(ratios)),
                ratios,
                where="mid",
                label=run["method"],
                color=color,
            )
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("retention ratio (fraction of tokens that run it)")
    ax.set_title(f"{model}\nper-layer ratios at budget {budget} (seed 0)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / PLOT_FILES[2])
    _save(fig, paths[-1])
    plt.close(fig)

    wc = results.get("wall_clock") or {}
    points = wc.get("points") or []
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5), sharey=True)
    for ax, kind in zip(axes, ("prefill", "decode"), strict=True):
        n = _draw_speed(ax, points, kind, style)
        ax.set_xlabel(
            f"measured {kind} speedup vs the dense twin"
            f" (batch {wc.get('batch_size', 1)})"
        )
        ax.set_title(kind)
        if n:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("test perplexity (causal routing)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"{model}\nperplexity vs measured speedup, every method and budget (95% CI"
        " over seeds; lower right is better)"
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    paths.append(out_dir / PLOT_FILES[3])
    _save(fig, paths[-1])
    plt.close(fig)
    return paths
