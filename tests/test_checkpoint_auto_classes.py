"""A routed checkpoint is the routed model wherever it is loaded, or it refuses to load
(issue 50).

AdaDSF and FTP checkpoints, unquantized and W8A8 (made by a second ``oneshot`` on the
routed checkpoint's path, which llm-compressor loads through ``AutoModelForCausalLM``):
``config.json`` declares the routed architecture; ``AutoModelForCausalLM`` (after
``import adadsf_modifier``) and ``pipeline`` give exactly what
``adadsf_modifier.from_pretrained`` gives; a process that does not import the package
refuses, or, with ``trust_remote_code=True``, gets the routed model through the
checkpoint's remote code; a checkpoint saved before all this still loads routed, with
a warning. Logits are compared exactly: both sides load the same files with the same
code in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from test_checkpoint_save_load import routed_model
from test_ftp_routing import ftp_model
from tiny_models import tiny_tokenizer, token_dataset
from transformers import AutoConfig, AutoModelForCausalLM, pipeline

import adadsf_modifier
from adadsf_modifier import (
    AdaDSFCheckpointError,
    AdaDSFRoutedConfig,
    RoutedLayer,
    routed_layers,
)
from adadsf_modifier.checkpoint import SIDECAR_NAMES
from adadsf_modifier.checkpoint.routed_config import (
    AUTO_MAP,
    CODE_FILES,
    ROPE_GUARD,
    ROUTED_ARCHITECTURE,
    ROUTED_MODEL_TYPE,
)

pytestmark = pytest.mark.usefixtures("single_thread")

KINDS = ("adadsf", "ftp", "adadsf_w8a8", "ftp_w8a8")
# every routed layer with a causal threshold: generate() keeps the KV cache
CAUSAL = [None, (0.5, 0.0, "causal"), (0.6, 0.1, "auto"), (0.4, -0.1, "causal")]
W8A8 = dict(targets="Linear", scheme="W8A8")
KEEP_ROUTERS = ["lm_head", "re:.*router.*", "re:.*skip_path.*"]


def _save(model, path: Path) -> Path:
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path


def _second_oneshot(source: Path, out: Path) -> Path:
    """GPTQ W8A8 on a routed checkpoint, by path: llm-compressor loads it through
    ``AutoModelForCausalLM`` and saves through the model's save hook."""
    oneshot(
        model=str(source),
        recipe=GPTQModifier(ignore=KEEP_ROUTERS, **W8A8),
        dataset=token_dataset(8, 16),
        num_calibration_samples=8,
        max_seq_length=16,
        output_dir=str(out),
    )
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("auto")
    out = {
        "adadsf": _save(routed_model("llama", CAUSAL), root / "adadsf"),
        "ftp": _save(ftp_model("llama")[0], root / "ftp"),
    }
    for kind in ("adadsf", "ftp"):
        out[f"{kind}_w8a8"] = _second_oneshot(out[kind], root / f"{kind}_w8a8")
    return out


def logits(model) -> torch.Tensor:
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


def _kinds_of_layers(model) -> list[str]:
    return [type(layer).__name__ for layer in model.model.layers]


@pytest.mark.parametrize("kind", KINDS)
def test_saved_config_declares_the_routed_architecture(checkpoints, kind):
    path = checkpoints[kind]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == ROUTED_MODEL_TYPE
    assert config["architectures"] == [ROUTED_ARCHITECTURE]
    assert config["auto_map"] == AUTO_MAP
    assert config["base_model_type"] == "llama"
    assert config["base_architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 32
    assert ("quantization_config" in config) == kind.endswith("w8a8")
    for name in CODE_FILES:
        assert (path / name).is_file()
    assert sum((path / name).is_file() for name in SIDECAR_NAMES) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_auto_model_after_import_equals_from_pretrained(checkpoints, kind):
    path = checkpoints[kind]
    assert isinstance(AutoConfig.from_pretrained(path), AdaDSFRoutedConfig)
    reference = adadsf_modifier.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model) is type(reference)  # the base class, routed
    assert routed_layers(model) and _kinds_of_layers(model) == _kinds_of_layers(
        reference
    )
    assert model.generation_config.use_cache == reference.generation_config.use_cache
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)


def test_second_oneshot_on_a_routed_checkpoint_keeps_the_routing(checkpoints):
    """llm-compressor's own load of the path is the routed model, so GPTQ calibrates
    the routed model and its save writes the sidecar and keeps the routers' tensors
    in full precision."""
    for kind in ("adadsf", "ftp"):
        path = checkpoints[f"{kind}_w8a8"]
        model = adadsf_modifier.from_pretrained(path)
        before = adadsf_modifier.from_pretrained(checkpoints[kind])
        assert _kinds_of_layers(model) == _kinds_of_layers(before)
        q_proj = model.model.layers[1].self_attn.q_proj
        assert q_proj.quantization_scheme is not None
        assert all(
            p.dtype == torch.float32
            for layer in routed_layers(model)
            for p in layer.router.parameters()
        )


def test_a_second_oneshot_that_would_quantize_the_routers_is_refused_first(
    checkpoints, tmp_path, monkeypatch
):
    """A routed model has its routers before any modifier initialises: a recipe that
    would quantize them is refused once oneshot has loaded the model, before GPTQ
    calibrates anything (not at the save, after the work)."""
    from llmcompressor.entrypoints.oneshot import Oneshot

    started = []
    monkeypatch.setattr(Oneshot, "__call__", lambda self: started.append(1))
    for kind in ("adadsf", "ftp"):
        with pytest.raises(ValueError, match="would quantize the AdaDSF router"):
            oneshot(
                model=str(checkpoints[kind]),
                recipe=GPTQModifier(ignore=["lm_head"], **W8A8),
                dataset=token_dataset(8, 16),
                num_calibration_samples=8,
                max_seq_length=16,
                output_dir=str(tmp_path / "out"),
            )
    assert not started and not (tmp_path / "out").exists()


def test_adadsf_compress_of_a_routed_checkpoint_quantizing_its_routers_is_one_line(
    checkpoints, tmp_path, capsys
):
    """The same refusal through the command line: one line, exit 2, no traceback."""
    import yaml

    from adadsf_modifier.cli import main

    recipe = tmp_path / "gptq.yaml"
    gptq = {"GPTQModifier": {"ignore": ["lm_head"], **W8A8}}
    stage = {"quantization_stage": {"quantization_modifiers": gptq}}
    recipe.write_text(yaml.safe_dump(stage))
    out = tmp_path / "out"
    argv = ["compress", "--model", checkpoints["adadsf"], "--recipe", recipe,
            "--output-dir", out, "--calibration-samples", "4",
            "--seq-len", "16"]  # fmt: skip
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "would quantize the AdaDSF router" in err and "Traceback" not in err
    assert not out.exists()


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "m"))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_a_process_without_the_package_refuses_or_trusts_the_remote_code(
    checkpoints, tmp_path
):
    """Without ``import adadsf_modifier`` a plain load refuses (transformers asks for
    ``trust_remote_code=True``: the checkpoint's code must run); with it, the
    checkpoint's remote code imports the package and the model is the routed one,
    equal to ``adadsf_modifier.from_pretrained``'s."""
    paths = {k: str(checkpoints[k]) for k in ("adadsf", "ftp_w8a8")}
    code = f"""
import json, sys, torch
from transformers import AutoModelForCausalLM
paths = {paths!r}
refusals = {{}}
for kind, path in paths.items():
    try:
        AutoModelForCausalLM.from_pretrained(path)
        refusals[kind] = None
    except ValueError as e:
        refusals[kind] = str(e)
assert "adadsf_modifier" not in sys.modules
same = {{}}
for kind, path in paths.items():
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    import adadsf_modifier
    ids = torch.arange(4, 20).view(2, 8)
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = adadsf_modifier.from_pretrained(path)(input_ids=ids).logits
    same[kind] = [bool(adadsf_modifier.routed_layers(model)), bool(torch.equal(a, b))]
print(json.dumps({{"refusals": refusals, "same": same}}))
"""
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, message in result["refusals"].items():
        assert message is not None, f"{kind}: a plain load built a model"
        assert "trust_remote_code=True" in message and paths[kind] in message
    assert result["same"] == {kind: [True, True] for kind in paths}


def test_an_explicit_base_class_refuses_naming_the_loader(checkpoints, tmp_path):
    """``LlamaForCausalLM.from_pretrained(path)`` or a base config handed to the Auto
    class reads the config's fields, not its ``model_type``: the RoPE type the save
    leaves there (:data:`ROPE_GUARD`) makes that load fail, naming the loader, with
    or without the package imported."""
    paths = {k: str(checkpoints[k]) for k in ("adadsf", "ftp_w8a8")}
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
paths = {paths!r}
out = {{}}
for imported in (False, True):
    if imported:
        import adadsf_modifier
    for kind, path in paths.items():
        for how in ("class", "config"):
            try:
                if how == "class":
                    LlamaForCausalLM.from_pretrained(path)
                else:
                    config = LlamaConfig.from_pretrained(path)
                    AutoModelForCausalLM.from_pretrained(path, config=config)
                out[f"{{imported}} {{kind}} {{how}}"] = None
            except Exception as e:
                out[f"{{imported}} {{kind}} {{how}}"] = str(e)
print(json.dumps(out))
"""
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result) == 8
    for case, message in result.items():
        assert message is not None, f"{case}: built the dense-depth model"
        assert "adadsf_modifier.from_pretrained(path)" in message, case
    # the routed config gives the base model its own RoPE parameters back
    config = AutoConfig.from_pretrained(checkpoints["adadsf"]).base_config()
    assert config.rope_parameters["rope_type"] == "default"
    assert ROPE_GUARD not in json.dumps(config.to_dict())


def test_without_the_package_installed_remote_code_names_it_in_one_line(
    checkpoints, tmp_path
):
    code = f"""
import sys
sys.modules["adadsf_modifier"] = None  # as if it were not installed
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(checkpoints["adadsf"])!r},
                                     trust_remote_code=True)
"""
    done = _run(code, tmp_path)
    assert done.returncode != 0
    last = _last_line(done.stderr)
    assert last.startswith("ImportError: ") and "pip install adadsf-modifier" in last


@pytest.mark.parametrize("kind", ["adadsf", "ftp", "adadsf_w8a8"])
def test_pipeline_generates_what_from_pretrained_generates(checkpoints, kind):
    path = checkpoints[kind]
    reference = adadsf_modifier.from_pretrained(path)
    # causal thresholds on every routed layer: both decode with the KV cache
    assert reference.generation_config.use_cache is True
    generate = pipeline("text-generation", model=str(path))
    assert routed_layers(generate.model)
    assert generate.model.generation_config.use_cache is True
    prompt = "w5 w6 w7 w8 w9"
    options = dict(max_new_tokens=6, do_sample=False)
    ids = generate(prompt, return_tensors=True, **options)[0]["generated_token_ids"]
    tokens = generate.tokenizer(prompt, return_tensors="pt")
    expected = reference.generate(**tokens, **options)[0]
    assert list(ids) == expected.tolist()


def test_auto_model_from_config_refuses(checkpoints):
    config = AutoConfig.from_pretrained(checkpoints["adadsf"])
    with pytest.raises(AdaDSFCheckpointError, match="sidecar"):
        AutoModelForCausalLM.from_config(config)


def _as_saved_before(path: Path, dest: Path) -> Path:
    """``path`` as a checkpoint saved before configs declared the routing: the base
    config.json and no remote code."""
    import shutil

    shutil.copytree(path, dest)
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = config.pop("base_model_type")
    config["architectures"] = config.pop("base_architectures")
    config["rope_parameters"] = config.pop("base_rope_parameters")
    del config["auto_map"]
    (dest / "config.json").write_text(json.dumps(config))
    for name in CODE_FILES:
        (dest / name).unlink()
    return dest


def test_a_checkpoint_saved_before_loads_routed_warns_and_upgrades_on_save(
    checkpoints, tmp_path, logged_warnings
):
    old = _as_saved_before(checkpoints["adadsf"], tmp_path / "old")
    model = adadsf_modifier.from_pretrained(old)
    assert routed_layers(model)
    assert any("DENSE-DEPTH" in m and str(old) in m for m in logged_warnings)
    reference = logits(adadsf_modifier.from_pretrained(checkpoints["adadsf"]))
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)
    # what a plain load of such a folder is, and why the warning: no routed layer
    dense = AutoModelForCausalLM.from_pretrained(old)
    assert not any(isinstance(m, RoutedLayer) for m in dense.modules())
    model.save_pretrained(str(tmp_path / "new"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    torch.testing.assert_close(logits(again), reference, rtol=0, atol=0)


def test_cli_eval_bench_and_report_on_new_and_old_checkpoints(checkpoints, tmp_path):
    """``adadsf eval`` / ``bench`` (and the lab's ``report``, when installed) read a
    checkpoint that declares the routed architecture and one saved before, alike."""
    from adadsf_modifier.cli import main

    old = _as_saved_before(checkpoints["adadsf"], tmp_path / "old")
    records = []
    for label, path in (("new", checkpoints["adadsf"]), ("old", old)):
        out = tmp_path / f"eval_{label}.json"
        argv = ["eval", "--model", path, "--no-ppl", "--ppl-tokens", 128,
                "--dtype", "float32", "--label", label, "--output", out]  # fmt: skip
        assert main([str(a) for a in argv]) == 0
        record = json.loads(out.read_text())
        assert record["routed"] is True and record["normalized_flops"] < 1.0
        records.append(out)
        bench = tmp_path / f"bench_{label}.json"
        argv = ["bench", "--routed", path, "--seq-lens", 16, "--batch-sizes", 1,
                "--repeats", 1, "--decode-tokens", 2, "--output", bench]  # fmt: skip
        assert main([str(a) for a in argv]) == 0
        assert json.loads(bench.read_text())["results"]
    new, before = (json.loads(p.read_text()) for p in records)
    assert new["normalized_flops"] == before["normalized_flops"]
    try:
        import adadsf_lab  # noqa: F401  (the report is the lab's command)
    except ImportError:
        return
    argv = ["report", "--inputs", *records, "--speed", tmp_path / "bench_new.json",
            "--output-dir", tmp_path / "report"]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    assert (tmp_path / "report" / "report.json").is_file()
