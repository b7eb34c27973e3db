"""The `adadsf` CLI refuses bad input up front: exit status 2, one clear line, nothing
written."""

from pathlib import Path

from adadsf_modifier.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "adadsf.yaml")


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_unknown_task_name(capsys, tmp_path):
    code, err = run(
        capsys, "eval", "--model", str(tmp_path), "--tasks", "piqa,mmlu_pro"
    )
    assert code == 2 and "unknown task(s) ['mmlu_pro']" in err and "piqa" in err


def test_missing_model_path(capsys, tmp_path):
    code, err = run(
        capsys,
        "compress",
        "--model",
        str(tmp_path / "nope"),
        "--recipe",
        RECIPE,
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_relative_missing_model_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    code, err = run(capsys, "eval", "--model", "outputs/sparse", "--no-ppl")
    assert code == 2 and "does not exist" in err


def test_non_empty_output_dir_is_refused_and_untouched(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = run(
        capsys,
        "compress",
        "--model",
        str(tmp_path),
        "--recipe",
        RECIPE,
        "--output-dir",
        str(out),
    )
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_recipe_that_does_not_parse(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "sparsity_stage:\n  sparsity_modifiers:\n    AdaDSFModifier:\n"
        "      retention: 2.0\n"
    )
    code, err = run(
        capsys,
        "compress",
        "--model",
        str(tmp_path),
        "--recipe",
        str(bad),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "does not parse" in err and "retention" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("sparsity_stage: [unclosed\n")
    code, err = run(
        capsys,
        "compress",
        "--model",
        str(tmp_path),
        "--recipe",
        str(broken),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "does not parse" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("AdaDSFModifier:\n  retention: 0.8\n")
    code, err = run(
        capsys,
        "compress",
        "--model",
        str(tmp_path),
        "--recipe",
        str(empty),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "no modifiers" in err


def test_existing_eval_output_file_is_not_overwritten(capsys, tmp_path):
    out = tmp_path / "res.json"
    out.write_text("{}")
    code, err = run(
        capsys, "eval", "--model", str(tmp_path), "--no-ppl", "--output", str(out)
    )
    assert code == 2 and "exists" in err
    assert out.read_text() == "{}"
