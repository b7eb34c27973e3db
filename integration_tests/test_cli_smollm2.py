"""The CLI end to end on the real SmolLM2-135M, kept short: compress (AdaDSF + W8A8) ->
reload -> perplexity against dense -> one lm-eval task offline -> `run` on that
checkpoint. Runs in CI."""

import json
import math
import shutil

import pytest
import yaml

import adadsf_lab.commands as lab_commands
from adadsf_modifier import RoutedLayer, from_pretrained
from adadsf_modifier.cli import main

pytestmark = pytest.mark.integration

RECIPE = {
    "sparsity_stage": {
        "sparsity_modifiers": {
            "AdaDSFModifier": {
                "retention": 0.9,
                "ignore": ["re:.*layers\\.0$"],
                "align_steps": 2,
                "align_batch_size": 2,
                "align_seq_len": 64,
                "router_init_steps": 20,
            }
        }
    },
    "quantization_stage": {
        "quantization_modifiers": {
            "GPTQModifier": {
                "targets": ["Linear"],
                "scheme": "W8A8",
                "ignore": ["lm_head", "re:.*router.*"],
            }
        }
    },
}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("cli")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = root / "sparse"
    code = main(
        [
            "compress",
            "--recipe",
            str(recipe),
            "--output-dir",
            str(out),
            "--calibration-samples",
            "8",
            "--seq-len",
            "128",
        ]
    )
    assert code == 0
    return root, out


def test_compress_writes_a_reloadable_quantized_sparse_checkpoint(compressed):
    _, out = compressed
    assert (out / "adadsf_config.json").is_file() and (out / "recipe.yaml").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]
    model = from_pretrained(out)
    routed = [m for m in model.modules() if isinstance(m, RoutedLayer)]
    assert len(routed) == model.config.num_hidden_layers - 1  # layer 0 ignored
    assert all(r.causal_threshold is not None for r in routed if r.retention_ratio < 1)


def test_eval_perplexity_is_finite_and_near_dense(compressed):
    root, out = compressed
    for label, model in (("dense", "embedded"), ("sparse", str(out))):
        assert (
            main(
                [
                    "eval",
                    "--model",
                    model,
                    "--ppl-tokens",
                    "1024",
                    "--output",
                    str(root / f"{label}.json"),
                ]
            )
            == 0
        )
    dense = json.loads((root / "dense.json").read_text())
    sparse = json.loads((root / "sparse.json").read_text())
    assert dense["ppl_tokens"] == sparse["ppl_tokens"] == 1023
    assert math.isfinite(sparse["ppl"]) and math.isfinite(dense["ppl"])
    # a broken pipeline (wrong routing, double-scaled weights) lands at 10^3..10^5
    assert sparse["ppl"] < 10 * dense["ppl"]
    assert sparse["routed"] and 0.5 < sparse["normalized_flops"] < 1.0
    assert dense["normalized_flops"] == 1.0


def test_one_lm_eval_task_runs_offline_on_the_sparse_model(compressed):
    root, out = compressed
    res = root / "tasks.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(out),
                "--no-ppl",
                "--tasks",
                "piqa",
                "--limit",
                "10",
                "--output",
                str(res),
            ]
        )
        == 0
    )
    piqa = json.loads(res.read_text())["tasks"]["piqa"]
    assert piqa["n"] == 10 and 0.0 <= piqa["acc"] <= 1.0


def test_run_overwrite_swaps_in_complete_results(compressed, monkeypatch):
    root, sparse_dir = compressed
    out = root / "main"
    out.mkdir()
    (out / "stale.txt").write_text("earlier run")

    def reuse(model_path, recipe, target, *args):  # compress itself: the fixture
        shutil.copytree(sparse_dir, target)
        return {"dtype": "float32", "alignment_rows": None, "dataset": "embedded"}

    monkeypatch.setattr(lab_commands, "compress", reuse)  # `adadsf run` is the lab's
    argv = ["run", "--recipe", root / "recipe.yaml", "--output-dir", out]
    argv += ["--overwrite", "--tasks", "", "--ppl-tokens", "128"]  # lm-eval: above
    argv += ["--bench-seq-lens", "32", "--bench-repeats", "1", "--decode-tokens", "2"]
    assert main([str(a) for a in argv]) == 0
    names = {p.name for p in out.iterdir()}
    assert "stale.txt" not in names
    assert {"sparse_w8a8", "eval_dense.json", "eval_sparse.json"} <= names
    assert {"speed.json", "report.json", "report.png"} <= names
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    sparse = json.loads((out / "eval_sparse.json").read_text())
    assert sparse["model"] == str(out / "sparse_w8a8") and sparse["routed"]
    assert json.loads((out / "speed.json").read_text())["model"] == sparse["model"]
    report = json.loads((out / "report.json").read_text())
    assert [row["label"] for row in report["rows"]] == ["dense", "AdaDSF+W8A8"]
    # dense and sparse evaluated and timed in the precision the model was compressed in
    dense = json.loads((out / "eval_dense.json").read_text())
    assert dense["dtype"] == sparse["dtype"] == "float32"
    assert json.loads((out / "speed.json").read_text())["dtype"] == "float32"
