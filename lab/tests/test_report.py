"""The main job's report (``adadsf report``, ``adadsf run``) draws what its numbers can
carry: a perplexity panel, accuracy with 95% intervals from lm-eval's standard errors,
a statement of which differences are within noise, and speed on an axis that holds 1.0
and the FLOPs ideal. Checked on the figure's matplotlib objects, not its pixels, with
records shaped as ``adadsf eval`` and ``adadsf bench`` write them (issue 66's numbers:
50 examples a task, the compressed model's mean above dense's only through BoolQ)."""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pytest
from cli_helpers import one_line_error, run
from matplotlib.container import ErrorbarContainer

from adadsf_lab.report import Z95, build_report, report_figure, write_report

TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa",
         "winogrande")  # fmt: skip
DENSE = (0.42, 0.48, 0.24, 0.40, 0.14, 0.68, 0.50)  # mean 0.409
SPARSE = (0.38, 0.50, 0.66, 0.38, 0.16, 0.62, 0.54)  # mean 0.463


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1))  # lm-eval's stderr of a mean of 0/1s


def _record(label: str, routed: bool, ppl: float, accs, n: int = 50, flops=1.0):
    """An ``adadsf eval`` record as the main job writes it."""
    tasks = {
        t: {"acc": a, "acc_stderr": _se(a, n), "acc_norm": a,
            "acc_norm_stderr": _se(a, n), "n": n}
        for t, a in zip(TASKS, accs, strict=True)
    }  # fmt: skip
    return {
        "label": label, "model": f"/m/{label}", "routed": routed,
        "routing_mode": "causal" if routed else None, "text": "test split",
        "ppl": ppl, "ppl_tokens": 16383, "tasks": tasks, "normalized_flops": flops,
        "normalized_flops_with_lm_head": flops, "flops_tokens": 16384,
        "kept_fraction": 0.84 if routed else None,
        "retention_target": 0.81 if routed else None, "seconds": 300.0,
        "dtype": "bfloat16",
    }  # fmt: skip


def _speed(kind: str, seq_len: int, speedup: float, ideal: float, new: int = 0):
    """A row of ``adadsf bench``'s ``results``."""
    return {
        "kind": kind, "batch_size": 1, "seq_len": seq_len, "new_tokens": new,
        "dense_s": 1.0, "routed_s": 1.0 / speedup, "speedup": speedup,
        "flops_ideal": ideal, "flops_ideal_with_lm_head": ideal * 0.97,
        "normalized_flops": 1.0 / ideal, "kept_fraction": 0.85,
        "retention_target": 0.81, "dense_runs": [1.0] * 3,
        "routed_runs": [1.0 / speedup] * 3, "fraction_of_ideal": speedup / ideal,
    }  # fmt: skip


RECORDS = [
    _record("dense", False, 34.68, DENSE),
    _record("AdaDSF+W8A8", True, 63.10, SPARSE, flops=0.84),
]
SPEED = [
    _speed("prefill", 256, 0.93, 1.17),
    _speed("prefill", 1024, 0.97, 1.15),
    _speed("decode", 128, 0.91, 1.16, new=32),
]


@pytest.fixture
def figure():
    figs = []

    def make(report):
        figs.append(report_figure(report))
        return figs[-1]

    yield make
    for f in figs:
        plt.close(f)


def _panel(fig, name):
    (ax,) = [a for a in fig.axes if a.get_label() == name]
    return ax


def test_the_report_reads_the_records_adadsf_eval_and_bench_write(capsys, tmp_path):
    """The constructed records pass the same checks as files from disk, and the
    command prints the statement and writes it into report.json."""
    paths = []
    for r in RECORDS:
        paths.append(tmp_path / f"eval_{r['label']}.json")
        paths[-1].write_text(json.dumps(r))
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"results": SPEED}))
    argv = ["report", "--inputs", *paths, "--speed", speed, "--output-dir"]
    code, err = run(capsys, *argv, tmp_path / "rep")
    assert code == 0, err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert "within noise" in report["noise_statement"]
    for key in ("meta", "rows", "records", "speed", "headline"):  # the older keys
        assert key in report
    assert report["rows"][0]["mean_acc"] == pytest.approx(sum(DENSE) / 7)
    # a bad row is still refused in one line
    speed.write_text(json.dumps({"results": [{**SPEED[0], "speedup": -1}]}))
    one_line_error(*run(capsys, *argv, tmp_path / "rep2"))


def test_the_figure_has_a_perplexity_panel_with_both_models(figure):
    ax = _panel(figure(build_report(RECORDS, SPEED)), "perplexity")
    assert "perplexity" in ax.get_ylabel()
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([34.68, 63.10])
    notes = " ".join(t.get_text() for t in ax.texts)
    assert "1.82x dense" in notes  # the compressed model against the reference


def test_accuracy_has_95_percent_intervals_from_the_stderrs(figure):
    report = build_report(RECORDS, SPEED)
    ax = _panel(figure(report), "accuracy")
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2  # one per model
    for bar, rec, row in zip(bars, RECORDS, report["rows"], strict=True):
        (segments,) = [lc.get_segments() for lc in bar.lines[2]]
        half = [(s[1][1] - s[0][1]) / 2 for s in segments]
        ses = [rec["tasks"][t]["acc_stderr"] for t in TASKS]
        mean_se = math.sqrt(sum(se * se for se in ses)) / len(ses)
        assert half == pytest.approx([Z95 * se for se in ses] + [Z95 * mean_se])
        assert row["mean_acc_stderr"] == pytest.approx(mean_se)
        assert row["mean_acc_ci95"] == pytest.approx(Z95 * mean_se)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[-1] == "mean" and "boolq *" in labels  # * : not within noise


def test_the_statement_says_within_noise_and_names_the_difference_beyond_it(
    figure, tmp_path
):
    report = build_report(RECORDS, SPEED)
    text = report["noise_statement"]
    (c,) = report["comparisons"]
    # the mean gap (+0.054) is smaller than its interval (~0.070): within noise
    assert c["mean_acc"]["diff"] == pytest.approx(0.054, abs=1e-3)
    assert c["mean_acc"]["ci95"] > abs(c["mean_acc"]["diff"])
    assert "+0.054 ± 0.070, within noise" in text
    # boolq's +0.42 is larger than its interval: named as not within noise
    assert c["tasks"]["boolq"]["within_noise"] is False
    assert "Not within noise: boolq +0.420 ± 0.179" in text
    inside = text.split("Within noise: ")[1].split(".")[0].split(", ")
    assert set(inside) == set(TASKS) - {"boolq"}
    assert "perplexity 63.10 against 34.68, 1.82x (worse" in text
    # in report.json and under the plot
    fig = figure(report)
    caption = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    assert "within noise" in caption and "boolq +0.420" in caption
    # and how the intervals were made, the mean's included
    assert "the mean's standard error is sqrt(sum of the tasks' squared standard " in (
        caption
    )
    js, _ = write_report(report, tmp_path)
    assert json.loads(js.read_text())["noise_statement"] == text


def test_a_mean_gap_larger_than_its_interval_is_not_within_noise():
    better = [min(a + 0.2, 0.98) for a in DENSE]
    report = build_report([RECORDS[0], _record("other", True, 30.0, better, n=400)])
    (c,) = report["comparisons"]
    assert c["mean_acc"]["within_noise"] is False
    assert "not within noise (its 95% interval excludes 0)" in report["noise_statement"]
    assert "No task's difference" not in report["noise_statement"]


def test_no_stderr_no_interval_and_no_verdict():
    rec = _record("AdaDSF", True, 40.0, SPARSE)
    for t in rec["tasks"].values():
        del t["acc_stderr"]
    report = build_report([RECORDS[0], rec])
    assert report["rows"][1]["mean_acc_ci95"] is None
    assert report["comparisons"][0]["mean_acc"]["within_noise"] is None
    assert "no interval" in report["noise_statement"]
    assert "within noise" not in report["noise_statement"]


@pytest.mark.parametrize(
    "speedups", [(0.93, 0.97, 0.91), (1.30, 1.35, 1.28)], ids=["slower", "faster"]
)
def test_the_speed_axis_holds_1_and_the_flops_ideal(figure, speedups):
    speed = [{**s, "speedup": v} for s, v in zip(SPEED, speedups, strict=True)]
    report = build_report(RECORDS, speed)
    ax = _panel(figure(report), "speed")
    low, high = ax.get_ylim()
    ideal = 1 / 0.84  # 1 / the compressed model's measured FLOPs
    assert low <= 1.0 <= high and low <= ideal <= high
    assert all(low <= v <= high for v in speedups)
    levels = [
        line.get_ydata()[0] for line in ax.lines if len(set(line.get_ydata())) == 1
    ]
    assert 1.0 in levels and ideal == pytest.approx(max(levels))
    bars = [p.get_height() for p in ax.patches]
    assert bars == pytest.approx(list(speedups))
    ticks = " ".join(t.get_text() for t in ax.get_xticklabels())
    assert "prefill" in ticks and "decode" in ticks


def test_one_model_and_no_speed_still_draw(figure):
    report = build_report([RECORDS[0]])
    assert report["noise_statement"] == "One model: nothing to compare."
    ax = _panel(figure(report), "speed")
    low, high = ax.get_ylim()
    assert low <= 1.0 <= high
