"""`adadsf` refuses bad numbers, paths, input files and outputs before any heavy work,
and `run --overwrite` keeps the earlier results until the new ones are complete."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

import adadsf_modifier.cli.commands as commands
from adadsf_modifier.cli import main
from adadsf_modifier.evaluation.report import build_report

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "adadsf.yaml")
RECORD = {"label": "dense", "model": "m", "routed": False, "routing_mode": None}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str) -> str:
    assert code == 2
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "llama"), 2)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if a command gets past its checks."""

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started before the arguments were checked")

    for name in ("compress", "evaluate", "bench", "_main_job"):
        monkeypatch.setattr(commands, name, refuse)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["compress", "--seq-len", "0"], "--seq-len"),
        (["compress", "--seq-len", "-1"], "--seq-len"),
        (["compress", "--calibration-samples", "0"], "--calibration-samples"),
        (["eval", "--limit", "0"], "--limit"),
        (["eval", "--limit", "-1"], "--limit"),
        (["eval", "--ppl-tokens", "0"], "--ppl-tokens"),
        (["bench", "--seq-lens", "-5"], "--seq-lens"),
        (["bench", "--batch-sizes", "0"], "--batch-sizes"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--decode-tokens", "0"], "--decode-tokens"),
        (["bench", "--threads", "-1"], "--threads"),
        (["bench", "--repeats", "two"], "--repeats"),
        (["run", "--limit", "0"], "--limit"),
        (["run", "--seq-len", "-1"], "--seq-len"),
        (["run", "--bench-repeats", "0"], "--bench-repeats"),
        (["compress", "--align-samples", "-1"], "--align-samples"),
        (["run", "--align-samples", "some"], "--align-samples"),
        (["compress", "--dtype", "float16"], "--dtype"),
        (["eval", "--dtype", "half"], "--dtype"),
        (["bench", "--dtype", "fp8"], "--dtype"),
    ],
)
def test_bad_numbers_fail_at_parse_time(capsys, tmp_path, no_heavy_work, argv, option):
    extra = {
        "compress": ["--output-dir", tmp_path / "out"],
        "bench": ["--routed", tmp_path],
    }.get(argv[0], [])
    err = one_line_error(*run(capsys, *argv, *extra))
    assert f"argument {option}" in err and f"adadsf {argv[0]}" in err
    assert not (tmp_path / "out").exists()


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

    def job(args, recipe, tasks, model_path, work, final):
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


def test_relative_path_like_model_that_does_not_exist(
    capsys, tmp_path, monkeypatch, no_heavy_work
):
    monkeypatch.chdir(tmp_path)  # no `models/` folder here: not a hub id either
    for name in ("models/nope", "./nope", "nope/"):
        err = one_line_error(*run(capsys, "eval", "--model", name, "--no-ppl"))
        assert f"model path does not exist: {name}" in err


def test_bench_refuses_a_dense_model_folder(capsys, dense_dir, no_heavy_work):
    err = one_line_error(*run(capsys, "bench", "--routed", dense_dir))
    assert "not an AdaDSF checkpoint" in err and "adadsf_config.json" in err
    assert "ftp_routing.json" in err  # an FTP checkpoint is accepted as well


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


def test_eval_output_that_is_a_directory(capsys, tmp_path, no_heavy_work):
    err = one_line_error(
        *run(capsys, "eval", "--model", tmp_path, "--output", tmp_path)
    )
    assert "is a directory" in err


def test_missing_eval_extra_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = one_line_error(
        *run(capsys, "eval", "--model", tmp_path, "--tasks", "piqa", "--no-ppl")
    )
    assert "adadsf-modifier[eval]" in err
    record = tmp_path / "r.json"
    record.write_text(json.dumps(RECORD))
    argv = ["report", "--inputs", record, "--output-dir", tmp_path / "rep"]
    assert "adadsf-modifier[eval]" in one_line_error(*run(capsys, *argv))


def test_calibration_problems_stop_before_the_model_loads(
    capsys, tmp_path, dense_dir, monkeypatch
):
    import datasets
    import transformers

    import adadsf_modifier.cli.alignment_rows as alignment_rows
    import adadsf_modifier.evaluation as evaluation

    def no_model(*args, **kwargs):
        raise AssertionError("model loaded before the calibration data was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    argv = ["compress", "--model", dense_dir, "--recipe", RECIPE]
    for data, text in (
        (ValueError("Calibration text too short: need 9 tokens"), "too short"),
        (datasets.Dataset.from_dict({"input_ids": []}), "empty"),
    ):

        def fake(*args, data=data, **kwargs):
            if isinstance(data, Exception):
                raise data
            return data

        # alignment_rows binds its own name: patched too, so the test does not depend
        # on which test imported that module first (alone, it kept the first fake)
        monkeypatch.setattr(evaluation, "calibration_dataset", fake)
        monkeypatch.setattr(alignment_rows, "calibration_dataset", fake)
        out = tmp_path / text.replace(" ", "_")
        err = one_line_error(*run(capsys, *argv, "--output-dir", out))
        assert f"calibration data: {text}" in err or text in err
