"""The lab's commands (`adadsf run`, `adadsf report`): bad input is refused up front
(exit status 2, one line, nothing written), `run --overwrite` keeps the earlier results
until the new ones are complete, and the report names the lab when matplotlib is
missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_helpers import RECORD, one_line_error, refuse_heavy_work, run
from tiny_models import save_tiny_model

import adadsf_lab.commands as commands
from adadsf_lab.report import build_report, plot_report
from adadsf_modifier.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "adadsf.yaml")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "llama"), 2)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if a command gets past its checks."""
    refuse_heavy_work(
        monkeypatch, commands, ("compress", "evaluate", "bench", "_main_job")
    )


@pytest.mark.parametrize(
    "argv, option",
    [
        (["run", "--limit", "0"], "--limit"),
        (["run", "--seq-len", "-1"], "--seq-len"),
        (["run", "--bench-repeats", "0"], "--bench-repeats"),
        (["run", "--align-samples", "some"], "--align-samples"),
    ],
)
def test_bad_numbers_fail_at_parse_time(capsys, tmp_path, no_heavy_work, argv, option):
    err = one_line_error(*run(capsys, *argv))
    assert f"argument {option}" in err and f"adadsf {argv[0]}" in err


def test_missing_matplotlib_is_one_line_naming_the_lab(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    record = tmp_path / "r.json"
    record.write_text(json.dumps(RECORD))
    argv = ["report", "--inputs", record, "--output-dir", tmp_path / "rep"]
    assert "pip install -e lab" in one_line_error(*run(capsys, *argv))


def test_report_missing_inputs(capsys, tmp_path):
    code, err = run(
        capsys, "report", "--inputs", tmp_path / "x.json", "--output-dir", tmp_path
    )
    assert code == 2 and "not found" in err


def test_run_overwrite_with_a_bad_argument_keeps_earlier_results(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("earlier")
    argv = ["run", "--recipe", RECIPE, "--output-dir", out, "--overwrite"]
    one_line_error(*run(capsys, *argv, "--seq-len", "-1"))
    assert (out / "report.json").read_text() == "earlier"


def test_run_failure_midway_keeps_earlier_results_and_leaves_no_litter(
    capsys, tmp_path, dense_dir, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("earlier")

    def crash(*args, **kwargs):
        raise RuntimeError("out of memory halfway")

    monkeypatch.setattr(commands, "compress", crash)
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--output-dir", out]
    with pytest.raises(RuntimeError, match="halfway"):
        main([str(a) for a in [*argv, "--overwrite", "--tasks", ""]])
    assert (out / "report.json").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_run_overwrite_replaces_results_once_complete(
    capsys, tmp_path, dense_dir, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.json").write_text("earlier")

    def job(args, recipe, tasks, model_path, work, final, expected, texts):
        assert final == out and work.parent == out.parent and work != out
        assert (out / "stale.json").is_file()  # still there while the job runs
        (work / "report.json").write_text("new")
        record = {"label": "dense", "routed": False}
        return build_report([record], [], {"timings": {"total_s": 1.0}})

    monkeypatch.setattr(commands, "_main_job", job)
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--output-dir", out]
    assert main([str(a) for a in [*argv, "--overwrite", "--tasks", ""]]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_report_refuses_bad_inputs_and_outputs(capsys, tmp_path):
    good = tmp_path / "dense.json"
    good.write_text(json.dumps(RECORD))
    text = tmp_path / "notes.txt"
    text.write_text("not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"results": []}))
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"results": [{"kind": "prefill"}]}))
    a_file = tmp_path / "file"
    a_file.write_text("")
    out = ["--output-dir", tmp_path / "rep"]
    cases = [
        (["--inputs", text, *out], "is not JSON"),
        (["--inputs", wrong, *out], "is not an `adadsf eval` record"),
        (["--inputs", good, "--speed", speed, *out], "not an `adadsf bench` result"),
        (["--inputs", good, "--speed", good, *out], "not an `adadsf bench` result"),
        (["--inputs", good, "--output-dir", a_file], "not a directory"),
        (["--inputs", good, "--output-dir", a_file / "sub"], "not a directory"),
    ]
    for argv, text_ in cases:
        err = one_line_error(*run(capsys, "report", *argv))
        assert text_ in err
    assert not (tmp_path / "rep").exists()


def test_report_plot_names_the_extra_when_matplotlib_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = build_report([{"label": "dense", "routed": False}])
    with pytest.raises(ModuleNotFoundError, match="pip install -e lab"):
        plot_report(report, tmp_path / "report.png")


@pytest.mark.parametrize(
    "field, value",
    [("ppl", float("nan")), ("ppl", -3.0), ("normalized_flops", float("nan")),
     ("normalized_flops", -0.5), ("normalized_flops", float("inf"))],
)  # fmt: skip
def test_report_refuses_a_record_whose_numbers_are_not_measurements(
    capsys, tmp_path, field, value
):
    record = tmp_path / "r.json"
    record.write_text(json.dumps({**RECORD, field: value}))  # NaN/Infinity tokens
    argv = ["report", "--inputs", record, "--output-dir", tmp_path / "rep"]
    err = one_line_error(*run(capsys, *argv))
    assert "is not an `adadsf eval` record" in err and field in err
    assert not (tmp_path / "rep").exists()


def test_report_refuses_a_speed_row_with_a_negative_speedup(capsys, tmp_path):
    record = tmp_path / "r.json"
    record.write_text(json.dumps(RECORD))
    row = {"kind": "prefill", "batch_size": 1, "seq_len": 8, "new_tokens": 0,
           "dense_s": 1.0, "routed_s": 1.0, "speedup": -1.0, "flops_ideal": 1.2,
           "flops_ideal_with_lm_head": 1.1, "normalized_flops": 0.8}  # fmt: skip
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"results": [row]}))
    argv = ["report", "--inputs", record, "--speed", speed]
    err = one_line_error(*run(capsys, *argv, "--output-dir", tmp_path / "rep"))
    assert "not an `adadsf bench` result" in err and "speedup" in err


def test_the_report_file_is_strict_json(tmp_path):
    from adadsf_lab.report import write_report

    report = build_report([{**RECORD, "ppl": float("nan")}])
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_report(report, tmp_path)


def test_the_report_files_are_written_atomically_not_through_planted_links(tmp_path):
    """``adadsf report`` writes into a folder that already exists: a link planted at
    ``report.json`` or ``report.png`` (or at their old temporary names) must not send
    the write to its target; the files are replaced whole."""
    from adadsf_lab.report import write_report

    victims = {}
    for name in ("report.json", "report.png", ".report.png.tmp"):
        victims[name] = tmp_path / f"victim_{name.strip('.')}"
        victims[name].write_text("keep me")
        (tmp_path / name).symlink_to(victims[name])
    js, png = write_report(build_report([RECORD]), tmp_path)
    assert all(v.read_text() == "keep me" for v in victims.values())
    assert not js.is_symlink() and json.loads(js.read_text())["rows"]
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")


SLOW_RUN = """
import sys, time
import adadsf_lab.commands as commands
from adadsf_modifier.cli import main

def job(args, recipe, tasks, model_path, work, final, expected, texts):
    (work / "checkpoint.bin").write_bytes(b"half")
    print("WORKING", flush=True)
    time.sleep(60)

commands._main_job = job
sys.exit(main(sys.argv[1:]))
"""


def test_run_stopped_by_sigterm_leaves_no_half_written_folder(tmp_path, dense_dir):
    import os
    import signal
    import subprocess

    out = tmp_path / "out"
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--output-dir", out,
            "--tasks", ""]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, *map(str, argv)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        for line in proc.stdout:  # log lines may come first
            if line.strip() == "WORKING":
                break
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".new")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


SIZES = dict(
    dtype="bfloat16", calibration_samples=128, seq_len=512, ppl_tokens=16384,
    limit=50, bench_seq_lens=[256, 1024], bench_repeats=3, decode_tokens=32,
)  # fmt: skip
"""``adadsf run``'s defaults, in bfloat16 (what ``auto`` picks on the project's CPU)."""


def test_run_prints_its_expected_time_before_any_work(
    capsys, tmp_path, dense_dir, monkeypatch
):
    """The main job says up front how long it should take (the cost model's measured
    rates at its sizes): an aligned recipe costs more than the same without alignment,
    and a tiny model less than one of SmolLM2's size."""
    import argparse

    sizes = argparse.Namespace(**SIZES)
    unaligned = tmp_path / "no_align.yaml"
    unaligned.write_text(
        Path(RECIPE).read_text().replace("align_steps: 100", "align_steps: 0")
    )
    smollm2 = str(tmp_path / "not-a-folder")  # unreadable config: SmolLM2's size
    aligned = commands.expected_minutes(sizes, RECIPE, ["piqa"], smollm2)
    assert commands.expected_minutes(sizes, str(unaligned), ["piqa"], smollm2) < (
        aligned
    )
    assert commands.expected_minutes(sizes, RECIPE, ["piqa"], dense_dir) < aligned

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after the estimate")

    monkeypatch.setattr(commands, "_main_job", stop)
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--output-dir",
            tmp_path / "out", "--tasks", ""]  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped after the estimate"):
        main([str(a) for a in argv])
    assert "expected to take about" in capsys.readouterr().out


def test_the_default_main_job_announces_what_it_took_on_a_quiet_machine():
    """``make main`` (SmolLM2, recipes/adadsf_w8a8.yaml, bfloat16) took 70.1 min on
    the quiet 2-core EPYC (lab/NOTEBOOK.md §38): the stage rates of study/cost.py,
    each measured on its own, must add up to within 15% of that, and the line names
    the alignment as the part that dominates."""
    import argparse

    from adadsf_modifier.cli.checks import check_tasks, default_recipe

    sizes = argparse.Namespace(**SIZES)
    smollm2 = "/nonexistent/smollm2"  # unreadable config: SmolLM2's size
    stages = commands.expected_seconds(
        sizes, default_recipe(), check_tasks("all"), smollm2
    )
    total = sum(stages.values()) / 60
    assert total == pytest.approx(70.1, rel=0.15)
    assert max(stages, key=stages.get) == "alignment"
    assert stages["alignment"] > 0.5 * sum(stages.values())
    line = commands.announcement(stages, "bfloat16")
    assert f"about {total:.0f} min in bfloat16" in line
    assert line.index("alignment") < line.index("evaluation") < line.index("speed")


def test_run_announces_each_stage_as_it_starts(
    capsys, tmp_path, dense_dir, monkeypatch
):
    """Between the stages' own progress bars the job says which of its four steps
    runs and how long it should take, and keeps the estimate beside the timings."""
    calls = []

    def fake(name, value):
        def f(*args, **kwargs):
            calls.append(name)
            return value

        return f

    record = {"label": "x", "model": "m", "routed": False, "routing_mode": None}
    compressed = {"dtype": "float32", "alignment_rows": 0, "dataset": "embedded"}
    monkeypatch.setattr(commands, "compress", fake("compress", compressed))
    monkeypatch.setattr(commands, "evaluate", fake("evaluate", record))
    monkeypatch.setattr(commands, "bench", fake("bench", {"results": []}))
    monkeypatch.setattr("adadsf_lab.report.write_report", lambda report, out: None)
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--output-dir",
            tmp_path / "out", "--tasks", ""]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("adadsf run [")]
    assert [line[:16] for line in steps] == [
        f"adadsf run [{i}/4]" for i in (1, 2, 3, 4)
    ]
    assert all("expected ~" in line for line in steps)
    assert calls == ["compress", "evaluate", "evaluate", "bench"]
    assert "(expected " in out.splitlines()[-1]


def test_run_compresses_on_the_users_dataset_and_refuses_a_bad_one_first(
    capsys, tmp_path, dense_dir, monkeypatch
):
    """``run --dataset``: compression calibrates and aligns on the user's documents
    (the report names them); one that cannot be read stops the job before any work."""
    seen = {}

    def compress(*args):
        seen["texts"], seen["source"] = args[8], args[9]
        raise RuntimeError("stop after compress")

    monkeypatch.setattr(commands, "compress", compress)
    docs = ["first document", "second document"]
    source = tmp_path / "mine.jsonl"
    source.write_text("\n".join(json.dumps({"body": d}) for d in docs))
    argv = ["run", "--model", dense_dir, "--recipe", RECIPE, "--tasks", "",
            "--output-dir", tmp_path / "out", "--dataset", source]  # fmt: skip
    with pytest.raises(RuntimeError, match="stop after compress"):
        main([str(a) for a in [*argv, "--text-column", "body"]])
    assert seen == {"texts": docs, "source": str(source)}
    seen.clear()
    one_line_error(*run(capsys, *argv))  # no `text` column
    assert not seen
