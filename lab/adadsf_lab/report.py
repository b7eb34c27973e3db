"""The dense-vs-sparse report: one JSON, one summary table, one plot.

The plot has three panels: perplexity (the measure that separates the models at this
size), task accuracy with 95% intervals from lm-eval's standard errors, and measured
speed against the dense twin on an axis that holds 1.0 and the FLOPs ideal. Below them,
and in ``report.json``, a statement in words of which differences are within noise: with
50 examples a task, accuracy gaps of several points are not evidence either way.
"""

from __future__ import annotations

import io
import json
import math
import textwrap
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from adadsf_modifier.atomic import atomic_write_bytes, atomic_write_text
from adadsf_modifier.constraints import first_error

REPORT_FILES = ("report.json", "report.png")
"""What ``write_report`` writes into its folder."""
LAB_INSTALL = "pip install -e lab (from the adadsf-modifier repository)"

__all__ = [
    "LAB_INSTALL",
    "REPORT_FILES",
    "build_report",
    "noise_statement",
    "plot_report",
    "read_eval_record",
    "read_speed_results",
    "report_figure",
    "summary_table",
    "write_report",
]


def _read_json(path: str | Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a JSON file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is not JSON: {e}") from None


def read_eval_record(path: str | Path) -> dict[str, Any]:
    """One ``adadsf eval`` record from ``path``, checked against
    :class:`~adadsf_modifier.evaluation.evaluate.EvalRecord` (``ValueError`` if it is
    not one), so a wrong file fails here in one line rather than deep in the report."""
    from adadsf_modifier.evaluation.evaluate import EvalRecord

    data = _read_json(path, "evaluation file")
    try:
        TypeAdapter(EvalRecord).validate_python(data)
    except ValidationError as e:
        raise ValueError(
            f"evaluation file {path} is not an `adadsf eval` record ({first_error(e)})"
        ) from None
    return data


def read_speed_results(path: str | Path) -> list[dict[str, Any]]:
    """The ``results`` rows of an ``adadsf bench`` JSON file, each checked against
    :class:`~adadsf_modifier.evaluation.speed.SpeedResult` (``ValueError`` if not)."""
    from adadsf_modifier.evaluation.speed import SpeedResult

    data = _read_json(path, "speed file")
    results = data.get("results") if isinstance(data, dict) else None
    try:
        TypeAdapter(list[SpeedResult]).validate_python(results)
    except ValidationError as e:
        raise ValueError(
            f"speed file {path} is not an `adadsf bench` result ({first_error(e)})"
        ) from None
    return results


Z95 = 1.96
"""A 95% interval is ``Z95`` standard errors either side (normal approximation)."""
INTERVALS = (
    "95% intervals: 1.96 x lm-eval's standard error of each task's accuracy; the "
    "mean's standard error is sqrt(sum of the tasks' squared standard errors) / the "
    "number of tasks; a difference's is sqrt(se_a^2 + se_b^2), the two models' "
    "scores treated as independent (they answer the same examples, so a paired "
    "interval would be narrower). A difference is within noise when its interval "
    "includes 0."
)


def _mean_acc(tasks: dict[str, dict[str, Any]]) -> float | None:
    accs = [t["acc"] for t in tasks.values() if t.get("acc") is not None]
    return sum(accs) / len(accs) if accs else None


def _mean_stderr(tasks: dict[str, dict[str, Any]]) -> float | None:
    """The standard error of the mean of the tasks' accuracies: sqrt(sum se^2) / n
    (the tasks' examples are disjoint); ``None`` unless every task has one."""
    rows = [t for t in tasks.values() if t.get("acc") is not None]
    ses = [t.get("acc_stderr") for t in rows]
    if not rows or any(se is None for se in ses):
        return None
    return math.sqrt(sum(se * se for se in ses)) / len(rows)


def _difference(
    a: float | None, se_a: float | None, b: float | None, se_b: float | None
) -> dict[str, Any]:
    """``a - b`` with its 95% interval; ``within_noise``: the interval includes 0
    (``None`` where a standard error is missing)."""
    if a is None or b is None:
        return {"a": a, "b": b, "diff": None, "ci95": None, "within_noise": None}
    if se_a is None or se_b is None:
        return {"a": a, "b": b, "diff": a - b, "ci95": None, "within_noise": None}
    ci = Z95 * math.sqrt(se_a * se_a + se_b * se_b)
    return {"a": a, "b": b, "diff": a - b, "ci95": ci, "within_noise": abs(a - b) <= ci}


def _reference(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The model the others are compared with: the first dense one, else the first."""
    return next((r for r in records if not r["routed"]), records[0])


def _compare(
    rec: dict[str, Any], ref: dict[str, Any], row: int, ref_row: int
) -> dict[str, Any]:
    """``rec`` (the report's row ``row``) against ``ref`` (row ``ref_row``):
    perplexity ratio, and the accuracy differences (each task both scored, and their
    mean) with 95% intervals."""
    a, b = rec.get("tasks", {}), ref.get("tasks", {})
    common = [t for t in sorted(a) if t in b and None not in (
        a[t].get("acc"), b[t].get("acc"))]  # fmt: skip
    tasks = {
        t: _difference(
            a[t]["acc"], a[t].get("acc_stderr"), b[t]["acc"], b[t].get("acc_stderr")
        )
        for t in common
    }
    mean = _difference(
        _mean_acc({t: a[t] for t in common}),
        _mean_stderr({t: a[t] for t in common}),
        _mean_acc({t: b[t] for t in common}),
        _mean_stderr({t: b[t] for t in common}),
    )
    ppl, ref_ppl = rec.get("ppl"), ref.get("ppl")
    return {
        "label": rec["label"],
        "reference": ref["label"],
        "row": row,
        "reference_row": ref_row,
        "ppl_ratio": ppl / ref_ppl if ppl is not None and ref_ppl else None,
        "mean_acc": {**mean, "tasks": len(common)},
        "tasks": tasks,
        "task_n": {t: a[t].get("n") for t in common},
    }


def _fmt_n(ns: list[Any]) -> str:
    known = sorted({n for n in ns if n is not None})
    if not known:
        return ""
    if len(known) == 1:
        return f"{known[0]} examples a task"
    return f"{known[0]}-{known[-1]} examples a task"


def noise_statement(report: dict[str, Any]) -> str:
    """In words, for each model against the reference: the perplexity ratio, and which
    accuracy differences are within noise (their 95% interval includes 0) and which
    are not."""
    rows = report["rows"]
    parts = []
    for c in report.get("comparisons", []):
        row, ref = rows[c["row"]], rows[c["reference_row"]]
        head = f"{c['label']} against {c['reference']}:"
        if c["ppl_ratio"] is not None:
            tokens, ref_tokens = row.get("ppl_tokens"), ref.get("ppl_tokens")
            if tokens and tokens == ref_tokens and row["text"] == ref["text"]:
                on = f"the same {tokens:,} tokens of the {row['text']}"
            else:
                on = f"{row['text']} against {ref['text']}"
            side = (c["ppl_ratio"] > 1) - (c["ppl_ratio"] < 1)
            worse = {1: "worse", 0: "equal", -1: "better"}[side]
            head += (
                f" perplexity {row['ppl']:.2f} against {ref['ppl']:.2f}, "
                f"{c['ppl_ratio']:.2f}x ({worse}; lower is better; {on}; no "
                "interval is recorded for perplexity)."
            )
        m = c["mean_acc"]
        if m["diff"] is None:
            parts.append(head + " No task accuracy to compare.")
            continue
        n = _fmt_n(list(c["task_n"].values()))
        if m["ci95"] is None:
            parts.append(
                head + f" Mean accuracy over {m['tasks']} tasks {m['diff']:+.3f} "
                "(no interval: a task has no recorded standard error)."
            )
            continue
        verdict = (
            "within noise (its 95% interval includes 0): no evidence either model "
            "is more accurate"
            if m["within_noise"]
            else "not within noise (its 95% interval excludes 0)"
        )
        text = (
            f" Mean accuracy over {m['tasks']} tasks ({n}) "
            f"{m['a']:.3f} against {m['b']:.3f}: "
            f"{m['diff']:+.3f} ± {m['ci95']:.3f}, {verdict}."
        )
        tasks = c["tasks"]
        inside = [t for t, d in tasks.items() if d["within_noise"]]
        outside = [t for t, d in tasks.items() if d["within_noise"] is False]
        unknown = [t for t, d in tasks.items() if d["within_noise"] is None]
        if inside:
            text += " Within noise: " + ", ".join(inside) + "."
        if outside:
            named = ", ".join(
                f"{t} {tasks[t]['diff']:+.3f} ± {tasks[t]['ci95']:.3f}" for t in outside
            )
            chance = 1 - 0.95 ** len(tasks)
            text += (
                f" Not within noise: {named} (with {len(tasks)} tasks at 95%, "
                f"{chance:.0%} of comparisons of equal models show at least one "
                "such task by chance)."
            )
        else:
            text += " No task's difference is outside its interval."
        if unknown:
            text += " No interval (no standard error): " + ", ".join(unknown) + "."
        parts.append(head + text)
    if not parts:
        return "One model: nothing to compare."
    return " ".join(parts)


def build_report(
    records: list[dict[str, Any]],
    speed: list[dict[str, Any]] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Combine evaluation records (``EvalRecord.as_dict()``) and speed rows into one
    report: per model its perplexity and accuracies with 95% intervals, each model
    against the reference (the first dense one) and a statement of which differences
    are within noise."""
    if not records:
        raise ValueError("a report needs at least one evaluation record")
    speed = speed or []
    prefill = [s for s in speed if s["kind"] == "prefill"]
    decode = [s for s in speed if s["kind"] == "decode"]
    headline = {
        "prefill_speedup": max(prefill, key=lambda s: s["seq_len"])["speedup"]
        if prefill
        else None,
        "prefill_seq_len": max(s["seq_len"] for s in prefill) if prefill else None,
        "decode_speedup": min(decode, key=lambda s: s["batch_size"])["speedup"]
        if decode
        else None,
    }
    ref = _reference(records)
    rows = []
    for r in records:
        tasks = r.get("tasks", {})
        se = _mean_stderr(tasks)
        rows.append(
            {
                "label": r["label"],
                "routed": r["routed"],
                "ppl": r.get("ppl"),
                "ppl_tokens": r.get("ppl_tokens"),
                "text": r.get("text", "test split"),
                "ppl_x_reference": r["ppl"] / ref["ppl"]
                if r.get("ppl") is not None and ref.get("ppl")
                else None,
                "mean_acc": _mean_acc(tasks),
                "mean_acc_stderr": se,
                "mean_acc_ci95": None if se is None else Z95 * se,
                "tasks": {k: v.get("acc") for k, v in tasks.items()},
                "tasks_stderr": {k: v.get("acc_stderr") for k, v in tasks.items()},
                "tasks_n": {k: v.get("n") for k, v in tasks.items()},
                "normalized_flops": r.get("normalized_flops", 1.0),
                "speedup": (headline["prefill_speedup"] if r["routed"] else 1.0),
            }
        )
    report = {
        "meta": meta or {},
        "rows": rows,
        "records": records,
        "speed": speed,
        "headline": headline,
        "reference": ref["label"],
        "comparisons": [
            _compare(r, ref, i, records.index(ref))
            for i, r in enumerate(records)
            if r is not ref
        ],
        "intervals": INTERVALS,
    }
    report["noise_statement"] = noise_statement(report)
    return report


def summary_table(report: dict[str, Any]) -> str:
    tasks = sorted({t for row in report["rows"] for t in row["tasks"]})
    head = [
        "model", "PPL (test)", "x ref", *tasks, "mean acc ± 95%", "norm. FLOPs",
        "prefill speedup",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    for row in report["rows"]:
        mean = fmt(row["mean_acc"], ".3f")
        if row.get("mean_acc_ci95") is not None:
            mean += f" ± {row['mean_acc_ci95']:.3f}"
        cells = [
            row["label"],
            fmt(row["ppl"], ".2f"),
            fmt(row.get("ppl_x_reference"), ".2f"),
            *[fmt(row["tasks"].get(t), ".3f") for t in tasks],
            mean,
            fmt(row["normalized_flops"], ".3f"),
            fmt(row["speedup"], ".3f") + ("x" if row["speedup"] is not None else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    h = report["headline"]
    if h.get("decode_speedup") is not None:
        lines.append(
            f"\ndecode speedup (batch 1): {h['decode_speedup']:.3f}x; prefill "
            f"speedup at seq {h['prefill_seq_len']}: {h['prefill_speedup']:.3f}x"
        )
    if report.get("noise_statement"):
        lines.append("\n" + textwrap.fill(report["noise_statement"], 100))
    return "\n".join(lines)


def _speed_label(s: dict[str, Any]) -> str:
    if s["kind"] == "prefill":
        return f"prefill\n{s['seq_len']} tok, b{s['batch_size']}"
    return f"decode\n{s['new_tokens']} steps after {s['seq_len']}, b{s['batch_size']}"


def _perplexity_panel(ax, report: dict[str, Any], colors: list[str]) -> None:
    rows = report["rows"]
    ax.set_label("perplexity")
    text = rows[0]["text"] if len({r["text"] for r in rows}) == 1 else "per model"
    ax.set_title(f"Perplexity, {text} (lower is better)", fontsize=10)
    ax.set_ylabel(f"perplexity ({text})")
    shown = [(i, r) for i, r in enumerate(rows) if r["ppl"] is not None]
    if not shown:
        ax.text(0.5, 0.5, "no perplexity recorded", ha="center", transform=ax.transAxes)
        return
    xs = list(range(len(shown)))
    ax.bar(xs, [r["ppl"] for _, r in shown], color=[colors[i] for i, _ in shown])
    for x, (_, r) in zip(xs, shown, strict=True):
        ratio = r.get("ppl_x_reference")
        note = f"{r['ppl']:.2f}" + (
            "" if ratio is None else f"\n{ratio:.2f}x {report['reference']}"
        )
        ax.annotate(note, (x, r["ppl"]), ha="center", va="bottom", fontsize=8,
                    textcoords="offset points", xytext=(0, 2))  # fmt: skip
    ax.set_xticks(xs)
    ax.set_xticklabels(
        [f"{r['label']}\nFLOPs {r['normalized_flops']:.3f}" for _, r in shown],
        fontsize=8,
    )
    ax.set_ylim(0, max(r["ppl"] for _, r in shown) * 1.25)
    ax.grid(axis="y", alpha=0.3)


def _accuracy_panel(ax, report: dict[str, Any], colors: list[str]) -> None:
    rows = report["rows"]
    ax.set_label("accuracy")
    tasks = sorted({t for r in rows for t, v in r["tasks"].items() if v is not None})
    ax.set_ylabel("accuracy (95% interval)")
    if not tasks:
        ax.set_title("Task accuracy", fontsize=10)
        ax.text(0.5, 0.5, "no tasks scored", ha="center", transform=ax.transAxes)
        return
    outside = {
        t
        for c in report.get("comparisons", [])
        for t, d in c["tasks"].items()
        if d["within_noise"] is False
    }
    mean_outside = any(
        c["mean_acc"]["within_noise"] is False for c in report.get("comparisons", [])
    )
    names = [*tasks, "mean"]
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs, ys, errs = [], [], []
        for j, t in enumerate(tasks):
            if r["tasks"].get(t) is None:
                continue
            se = r["tasks_stderr"].get(t)
            xs.append(j + (i - (len(rows) - 1) / 2) * width)
            ys.append(r["tasks"][t])
            errs.append(0.0 if se is None else Z95 * se)
        if r["mean_acc"] is not None:
            xs.append(len(tasks) + (i - (len(rows) - 1) / 2) * width)
            ys.append(r["mean_acc"])
            errs.append(r["mean_acc_ci95"] or 0.0)
        ax.errorbar(xs, ys, yerr=errs, fmt="o", color=colors[i], capsize=3,
                    label=r["label"], markersize=5)  # fmt: skip
    ax.axvline(len(tasks) - 0.5, color="0.7", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(
        [n + (" *" if n in outside or (n == "mean" and mean_outside) else "")
         for n in names], rotation=35, ha="right", fontsize=8,
    )  # fmt: skip
    n = _fmt_n([v for r in rows for v in r["tasks_n"].values()])
    ax.set_title(
        f"Task accuracy ({n}; * not within noise)" if n else "Task accuracy",
        fontsize=10,
    )
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _speed_panel(ax, report: dict[str, Any]) -> None:
    ax.set_label("speed")
    ax.set_title("Speed against the dense twin (higher is faster)", fontsize=10)
    ax.set_ylabel("dense time / routed time (x)")
    speed = report["speed"]
    routed = [r for r in report["rows"] if r["routed"]]
    ideal = 1 / routed[0]["normalized_flops"] if routed else None
    top = max([1.0, *(s["speedup"] for s in speed), *(s["flops_ideal"] for s in speed)]
              + ([ideal] if ideal else []))  # fmt: skip
    ax.axhline(1.0, color="k", lw=1, label="dense (1.0x)")
    if ideal is not None:
        ax.axhline(ideal, color="tab:green", ls="--", lw=1,
                   label=f"FLOPs ideal 1/{routed[0]['normalized_flops']:.3f} = "
                   f"{ideal:.2f}x (test split)")  # fmt: skip
    if speed:
        xs = list(range(len(speed)))
        ax.bar(xs, [s["speedup"] for s in speed], width=0.6, color="tab:orange",
               label="measured")  # fmt: skip
        ax.scatter(xs, [s["flops_ideal"] for s in speed], marker="_", s=600,
                   color="tab:green", zorder=3,
                   label="FLOPs ideal of the benchmark's own tokens")  # fmt: skip
        for x, s in zip(xs, speed, strict=True):
            ax.annotate(f"{s['speedup']:.2f}x", (x, s["speedup"]), ha="center",
                        va="bottom", fontsize=8, textcoords="offset points",
                        xytext=(0, 2))  # fmt: skip
        ax.set_xticks(xs)
        ax.set_xticklabels([_speed_label(s) for s in speed], fontsize=8)
    else:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "no speed measured", ha="center", transform=ax.transAxes)
    ax.set_ylim(0, top * 1.5)  # room for the legend above the bars and lines
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def report_figure(report: dict[str, Any]):
    """The report's figure: perplexity, accuracy with 95% intervals, and speed against
    the dense twin with 1.0 and the FLOPs ideal drawn; the noise statement below."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"matplotlib is not installed; the report plot needs the lab: {LAB_INSTALL}"
        ) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [palette[i % len(palette)] for i in range(len(rows))]
    caption = "\n".join(
        textwrap.fill(p, 190)
        for p in (report.get("noise_statement", ""), report.get("intervals", ""))
        if p
    )
    lines = caption.count("\n") + 1 if caption else 0
    fig, axes = plt.subplots(1, 3, figsize=(16, 5 + 0.17 * lines))
    _perplexity_panel(axes[0], report, colors)
    _accuracy_panel(axes[1], report, colors)
    _speed_panel(axes[2], report)
    fig.suptitle("AdaDSF: quality and speed against the dense model")
    fig.tight_layout(rect=(0, (0.15 + 0.17 * lines) / (5 + 0.17 * lines), 1, 1))
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=8, va="bottom", ha="left",
                 gid="noise_statement")  # fmt: skip
    return fig


def plot_report(report: dict[str, Any], png: str | Path) -> None:
    """:func:`report_figure`, written to ``png``."""
    fig = report_figure(report)  # names the lab if matplotlib is missing
    import matplotlib.pyplot as plt

    image = io.BytesIO()  # rendered first, then written atomically
    fig.savefig(image, dpi=120, format="png")
    plt.close(fig)
    atomic_write_bytes(Path(png), image.getvalue())


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, png = (out / name for name in REPORT_FILES)
    # strict JSON: the inputs were checked, so a non-finite number here is a bug
    atomic_write_text(js, json.dumps(report, indent=2, allow_nan=False))
    plot_report(report, png)
    return js, png
