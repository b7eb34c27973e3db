"""The dense-vs-sparse report: one JSON, one summary table, one plot.

Accuracy and perplexity are plotted against normalized FLOPs and against measured
speedup, with the dense model as the reference point, so a reader sees at once what the
saving cost.
"""

from __future__ import annotations

import io
import json
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
    "plot_report",
    "read_eval_record",
    "read_speed_results",
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


def _mean_acc(tasks: dict[str, dict[str, Any]]) -> float | None:
    accs = [t["acc"] for t in tasks.values() if t.get("acc") is not None]
    return sum(accs) / len(accs) if accs else None


def build_report(
    records: list[dict[str, Any]],
    speed: list[dict[str, Any]] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Combine evaluation records (``EvalRecord.as_dict()``) and speed rows into one
    report."""
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
    rows = []
    for r in records:
        rows.append(
            {
                "label": r["label"],
                "routed": r["routed"],
                "ppl": r.get("ppl"),
                "mean_acc": _mean_acc(r.get("tasks", {})),
                "tasks": {k: v.get("acc") for k, v in r.get("tasks", {}).items()},
                "normalized_flops": r.get("normalized_flops", 1.0),
                "speedup": (headline["prefill_speedup"] if r["routed"] else 1.0),
            }
        )
    return {
        "meta": meta or {},
        "rows": rows,
        "records": records,
        "speed": speed,
        "headline": headline,
    }


def summary_table(report: dict[str, Any]) -> str:
    tasks = sorted({t for row in report["rows"] for t in row["tasks"]})
    head = ["model", "PPL (test)", *tasks, "mean acc", "norm. FLOPs", "prefill speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    for row in report["rows"]:
        cells = [
            row["label"],
            fmt(row["ppl"], ".2f"),
            *[fmt(row["tasks"].get(t), ".3f") for t in tasks],
            fmt(row["mean_acc"], ".3f"),
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
    return "\n".join(lines)


def plot_report(report: dict[str, Any], png: str | Path) -> None:
    """Two panels: quality vs normalized FLOPs, quality vs measured speedup."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"matplotlib is not installed; the report plot needs the lab: {LAB_INSTALL}"
        ) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    use_acc = any(r["mean_acc"] is not None for r in rows)
    metric = "mean_acc" if use_acc else "ppl"
    ylabel = "mean task accuracy" if use_acc else "perplexity (test)"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, xkey, xlabel in (
        (axes[0], "normalized_flops", "normalized FLOPs (routed / dense)"),
        (axes[1], "speedup", "measured prefill speedup (x)"),
    ):
        for r in rows:
            x, y = r.get(xkey), r.get(metric)
            if x is None or y is None:
                continue
            ax.scatter(
                [x], [y], s=60, marker="o" if r["routed"] else "s", label=r["label"]
            )
            ax.annotate(
                r["label"],
                (x, y),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("AdaDSF: quality vs cost (dense reference included)")
    fig.tight_layout()
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
