"""`adadsf` refuses bad numbers, paths, input files and outputs before any heavy work,
and `run --overwrite` keeps the earlier results until the new ones are complete."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cli_helpers import one_line_error, refuse_heavy_work, run
from tiny_models import save_tiny_model

import adadsf_modifier.cli.commands as commands

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "adadsf.yaml")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "llama"), 2)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if a command gets past its checks."""
    refuse_heavy_work(monkeypatch, commands, ("compress", "evaluate", "bench"))


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
        (["compress", "--align-samples", "-1"], "--align-samples"),
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


def test_eval_output_that_is_a_directory(capsys, tmp_path, no_heavy_work):
    err = one_line_error(
        *run(capsys, "eval", "--model", tmp_path, "--output", tmp_path)
    )
    assert "is a directory" in err


def test_missing_eval_extra_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    err = one_line_error(
        *run(capsys, "eval", "--model", tmp_path, "--tasks", "piqa", "--no-ppl")
    )
    assert "adadsf-modifier[eval]" in err


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


@pytest.mark.parametrize("command", ["compress", "eval", "bench"])
def test_a_model_path_that_is_no_model_folder_is_one_line(
    capsys, tmp_path, dense_dir, no_heavy_work, command, monkeypatch
):
    no_config = tmp_path / "empty"
    no_config.mkdir()
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    no_tokenizer = tmp_path / "no_tok"
    no_tokenizer.mkdir()
    config = (Path(dense_dir) / "config.json").read_text()
    (no_tokenizer / "config.json").write_text(config)
    monkeypatch.chdir(tmp_path)  # a bare file name is not taken for a hub id
    option = "--routed" if command == "bench" else "--model"
    extra = ["--output-dir", tmp_path / "out"] if command == "compress" else []
    for path, message in (
        (no_config, "has no config.json"),
        (a_file, "is a file, not a model"),
        ("weights.safetensors", "is a file, not a model"),
        (no_tokenizer, "has no tokenizer"),
    ):
        err = one_line_error(*run(capsys, command, option, path, *extra))
        assert message in err and str(path) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "block, message",
    [({"retention": 0.5, "targets": ["re:nothing.*"]}, "match no decoder layer"),
     ({"retention": 1e-9}, "cannot reach a retention ratio")],
)  # fmt: skip
def test_a_modifier_error_inside_compress_is_one_line(
    capsys, tmp_path, dense_dir, block, message
):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    stage = {"AdaDSFModifier": {**block, "router_init_steps": 2}}
    recipe.write_text(yaml.safe_dump({"sparsity_stage": {"sparsity_modifiers": stage}}))
    argv = ["compress", "--model", dense_dir, "--recipe", recipe,
            "--output-dir", tmp_path / "out", "--calibration-samples", "4",
            "--seq-len", "16"]  # fmt: skip
    code, err = run(capsys, *argv)
    # the work had started (its log lines come first): the error is one line, last
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("adadsf compress: error:") and message in last
