"""AdaDSF stacked with GPTQ (W8A8 / W4A16) in one recipe: oneshot -> checkpoint ->
from_pretrained.

Tiny random Llama and Qwen2 models, offline. The recipes are the shipped YAML files; the
W8A8 one runs verbatim on Llama (as a user would call it, by path) and with its
alignment stage cut to 2 steps on Qwen2, only to save CPU time.

Tolerance: the reloaded model must reproduce the in-memory compressed model's logits
*exactly* (``rtol=atol=0``). Both hold the same int8 / packed-int4 weights and scales,
  decompress them with
the same compressed-tensors code, quantize activations with the same dynamic per-token
code, and run the same deterministic CPU kernels in one process; the routers are
bit-identical float tensors. Any nonzero difference is therefore a bug, not noise; and a
loose tolerance would hide the dangerous kind: a router in another dtype or a wrong
ratio flips top-k/threshold decisions, which changes whole tokens' paths. The router
scores are compared exactly as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor.recipe import Recipe  # noqa: E402
from tiny_models import save_tiny_model, token_dataset  # noqa: E402

import adadsf_modifier  # noqa: E402
from adadsf_modifier import AdaDSFCheckpointError, AdaDSFModifier, RoutedLayer  # noqa: E402
from adadsf_modifier.checkpoint import SIDECAR_NAME  # noqa: E402
from adadsf_modifier.checkpoint.sidecar import SKIP_PATH_FORMAT_VERSION  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "w8a8": ROOT / "recipes" / "adadsf_w8a8.yaml",
    "w4a16": ROOT / "recipes" / "adadsf_w4a16.yaml",
}
CASES = [("llama", "w8a8"), ("qwen2", "w8a8"), ("llama", "w4a16"), ("qwen2", "w4a16")]
NUM_LAYERS = 4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def recipe_for(arch: str, scheme: str) -> str:
    """The shipped recipe, its skip maps' rank cut to 8 (the tiny models' hidden sizes,
    32 and 64, are not above the shipped 64), alignment also shortened for qwen2 (CPU
    time only)."""
    data = yaml.safe_load(RECIPES[scheme].read_text())
    ada = data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    if ada.get("skip_path_rank"):
        ada["skip_path_rank"] = 8
    if arch != "llama" and ada.get("align_steps"):
        ada["align_steps"] = 2
    return yaml.safe_dump(data, sort_keys=False)


def inputs():
    ids = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # one left-padded row
    return ids, mask


def forward_record(model):
    """Logits and every router's scores on the fixed inputs (eval mode, no grad)."""
    ids, mask = inputs()
    scores, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, RoutedLayer):
            handles.append(
                module.router.register_forward_hook(
                    lambda m, a, out, name=name: scores.setdefault(
                        name, out.detach().clone()
                    )
                )
            )
    try:
        with torch.no_grad():
            logits = model.eval()(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    return logits, scores


def run_oneshot(model_path, recipe, **kwargs):
    return oneshot(
        model=model_path,
        dataset=token_dataset(8, 16),
        recipe=recipe,
        num_calibration_samples=8,
        max_seq_length=16,
        **kwargs,
    )


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    return {
        a: save_tiny_model(a, str(root / a), num_layers=NUM_LAYERS)
        for a in ("llama", "qwen2")
    }


@pytest.fixture(scope="module")
def compressed(base_dirs, tmp_path_factory):
    """(arch, scheme) -> dict(path, logits, scores, ratios, modes) of the in-memory
    model."""
    out = {}
    for arch, scheme in CASES:
        path = tmp_path_factory.mktemp(f"{arch}-{scheme}") / "ckpt"
        model = run_oneshot(
            base_dirs[arch], recipe_for(arch, scheme), output_dir=str(path)
        )
        logits, scores = forward_record(model)
        layers = [m for m in model.modules() if isinstance(m, RoutedLayer)]
        out[(arch, scheme)] = dict(
            path=path,
            logits=logits,
            scores=scores,
            ratios=[layer.retention_ratio for layer in layers],
            modes=[layer.resolved_routing_mode() for layer in layers],
        )
        del model
    return out


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ------------------------------------------------------------------------------------
# Round trip
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,scheme", CASES)
def test_reload_reproduces_in_memory_compressed_model_exactly(compressed, arch, scheme):
    ref = compressed[(arch, scheme)]
    model = adadsf_modifier.from_pretrained(ref["path"])
    assert (
        type(model).__name__
        == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    )
    layers = [m for m in model.modules() if isinstance(m, RoutedLayer)]
    assert [layer.retention_ratio for layer in layers] == ref["ratios"]
    logits, scores = forward_record(model)
    assert [layer.resolved_routing_mode() for layer in layers] == ref["modes"]
    assert scores.keys() == ref["scores"].keys()
    for name in scores:
        torch.testing.assert_close(scores[name], ref["scores"][name], rtol=0, atol=0)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("arch,scheme", CASES)
def test_linears_are_quantized_and_routers_are_not(compressed, arch, scheme):
    path = compressed[(arch, scheme)]["path"]
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    assert qcfg["quant_method"] == "compressed-tensors"
    assert (
        qcfg["format"] == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[scheme]
    )
    assert group["weights"]["num_bits"] == {"w8a8": 8, "w4a16": 4}[scheme]
    assert (group["input_activations"] or {}).get("num_bits") == {
        "w8a8": 8,
        "w4a16": None,
    }[scheme]
    side = json.loads((path / SIDECAR_NAME).read_text())
    routed = [e["index"] for e in side["layers"] if e["routed"]]
    routers = {f"model.layers.{i}.router.{p}" for i in routed for p in ("fc1", "fc2")}
    assert routers <= set(qcfg["ignore"]) and "lm_head" in qcfg["ignore"]

    tensors = tensors_of(path)
    for i in range(NUM_LAYERS):
        for lin in LINEARS:
            part = (
                "self_attn"
                if lin.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else "mlp"
            )
            key = f"model.layers.{i}.{part}.{lin}"
            if scheme == "w8a8":
                assert tensors[f"{key}.weight"].dtype == torch.int8, key
            else:
                assert tensors[f"{key}.weight_packed"].dtype == torch.int32, key
                assert f"{key}.weight" not in tensors
            assert f"{key}.weight_scale" in tensors
        for part in ("fc1", "fc2") if i in routed else ():
            key = f"model.layers.{i}.router.{part}"
            assert tensors[f"{key}.weight"].dtype == torch.float32, key
            assert not any(k.startswith(f"{key}.weight_") for k in tensors), key

    model = adadsf_modifier.from_pretrained(path)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            has_scheme = getattr(module, "quantization_scheme", None) is not None
            assert has_scheme == (name.split(".")[-1] in LINEARS), name


@pytest.mark.parametrize("arch,scheme", [("llama", "w8a8"), ("qwen2", "w4a16")])
def test_generate_after_reload(compressed, arch, scheme):
    model = adadsf_modifier.from_pretrained(compressed[(arch, scheme)]["path"])
    prompt = torch.randint(4, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # use_cache=False always works: every step re-runs the whole sequence. (Top-k
        # routing cannot continue from a KV cache; the causal routing mode can.)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            do_sample=False,
            use_cache=False,
        )
        ids = prompt
        for _ in range(4):  # greedy by hand: argmax of a full forward at each step
            nxt = (
                model(input_ids=ids, use_cache=False)
                .logits[:, -1]
                .argmax(-1, keepdim=True)
            )
            ids = torch.cat([ids, nxt], dim=1)
        assert torch.equal(out, ids)
        # The default generate() works too (cache in causal mode, or use_cache=False set
        # by from_pretrained when a layer would route top-k).
        default = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            do_sample=False,
        )
    assert default.shape == (1, 10)


def test_sidecar_recipe_and_config(compressed):
    path = compressed[("llama", "w8a8")]["path"]
    files = {p.name for p in path.iterdir()}
    assert {
        SIDECAR_NAME,
        "config.json",
        "model.safetensors",
        "recipe.yaml",
        "tokenizer.json",
    } <= files
    assert not [p for p in path.parent.iterdir() if ".adadsf-tmp-" in p.name]
    side = json.loads((path / SIDECAR_NAME).read_text())
    # the shipped recipe's skip maps and kept keys/values need format version 2
    assert side["format"] == "adadsf"
    assert side["format_version"] == SKIP_PATH_FORMAT_VERSION
    assert side["model_type"] == "llama" and side["num_hidden_layers"] == NUM_LAYERS
    assert [e["index"] for e in side["layers"]] == list(range(NUM_LAYERS))
    assert [e["routed"] for e in side["layers"]] == [False] + [True] * (NUM_LAYERS - 1)
    for e in side["layers"][1:]:  # the recipe keeps layer 0 dense
        assert 0 < e["retention_ratio"] <= 1 and e["router_hidden_size"] == 64
        assert isinstance(e["similarity"], float) and "causal_threshold" in e
    shipped = yaml.safe_load(recipe_for("llama", "w8a8"))
    shipped = shipped["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    ratios = [e["retention_ratio"] for e in side["layers"][1:]]
    assert sum(ratios) / len(ratios) == pytest.approx(shipped["retention"], abs=1e-6)
    settings = side["modifier"]["settings"]
    assert side["modifier"]["class"] == "AdaDSFModifier"
    for field, value in shipped.items():  # the verbatim recipe
        assert settings[field] == value, field
    # config.json declares the routed architecture (so that no loader builds the
    # dense-depth model) over the base config, quantization_config kept; the routing
    # data is the sidecar's alone
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "adadsf_routed"
    assert config["base_model_type"] == "llama" and config["quantization_config"]
    assert "layers" not in config
    # recipe.yaml is plain YAML (llm-compressor writes !!python tags that its own
    # safe_load rejects) and names all the modifiers
    recipe = Recipe.create_instance(str(path / "recipe.yaml"))
    assert [type(m).__name__ for m in recipe.modifiers] == [
        "AdaDSFModifier",
        "GPTQModifier",
    ]
    for case in CASES:
        text = (compressed[case]["path"] / "recipe.yaml").read_text()
        assert "!!python" not in text and yaml.safe_load(text)


# ------------------------------------------------------------------------------------
# GPTQ calibrates on what the sparse model feeds each layer
# ------------------------------------------------------------------------------------


def test_gptq_hessians_see_only_routed_tokens_in_the_mlp(base_dirs, monkeypatch):
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    seen: dict[str, int] = {}  # GPTQ: tokens accumulated into each module's Hessian
    expected: dict[
        str, int
    ] = {}  # tokens the layer's router selected, in the same passes
    names: dict[torch.nn.Module, str] = {}
    real_calibrate = GPTQModifier.calibrate_module
    real_start = GPTQModifier.on_calibration_start

    def calibrate(self, module, args, output):
        key = names[module]
        seen[key] = seen.get(key, 0) + args[0].shape[:-1].numel()
        return real_calibrate(self, module, args, output)

    def count_selected(layer, args, kwargs):
        if (
            HooksMixin._HOOKS_DISABLED
        ):  # the pipeline's propagation pass: GPTQ is not listening
            return
        x = args[0] if args else kwargs["hidden_states"]
        scores = layer.router(x)
        if layer.retention_ratio >= 1.0:
            n = scores.numel()
        else:  # the layer's own rule (mode, threshold or top-k, attention-sink token)
            n = int(layer.selected_mask(x, kwargs.get("attention_mask")).sum())
        expected[names[layer]] = expected.get(names[layer], 0) + n

    handles = []

    def start(self, state, event, **kwargs):
        for name, module in state.model.named_modules():
            names[module] = name
            if isinstance(module, RoutedLayer):
                handles.append(
                    module.register_forward_pre_hook(count_selected, with_kwargs=True)
                )
        return real_start(self, state, event, **kwargs)

    monkeypatch.setattr(GPTQModifier, "calibrate_module", calibrate)
    monkeypatch.setattr(GPTQModifier, "on_calibration_start", start)
    model = run_oneshot(base_dirs["llama"], recipe_for("llama", "w4a16"))
    for h in handles:
        h.remove()

    dense = 8 * 16
    layers = [m for m in model.modules() if isinstance(m, RoutedLayer)]
    assert any(layer.retention_ratio < 1 for layer in layers)
    for layer in layers:
        name = names[layer]
        assert expected[name] <= dense
        for lin in ("mlp.gate_proj", "mlp.down_proj"):
            assert seen[f"{name}.{lin}"] == expected[name], (name, lin)
        # a layer keeping skipped tokens' keys/values runs its attention sub-block on
        # every token (routed_layer.run_kept_mlp), as the dense layer does
        assert layer.skipped_tokens_kv
        assert seen[f"{name}.self_attn.q_proj"] == dense, name
    assert sum(expected.values()) < dense * len(
        layers
    )  # sparse, not the dense activations


def test_quantizing_routers_is_refused_before_calibration(base_dirs):
    recipe = [
        AdaDSFModifier(retention=0.8),
        GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    ]
    with pytest.raises(ValueError, match=r"router.*re:\.\*router\.\*"):
        run_oneshot(base_dirs["llama"], recipe)


# ------------------------------------------------------------------------------------
# Other ways of saving
# ------------------------------------------------------------------------------------


def test_save_pretrained_after_oneshot_and_resave_after_reload(base_dirs, tmp_path):
    model = run_oneshot(base_dirs["qwen2"], recipe_for("qwen2", "w4a16"))
    before, _ = forward_record(model)  # fake-quantized (frozen) weights
    model.save_pretrained(str(tmp_path / "a"), save_compressed=True)
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "a")
    logits_a, _ = forward_record(reloaded)
    torch.testing.assert_close(logits_a, before, rtol=0, atol=0)

    # A reloaded (still compressed, never run) model saves again and reloads
    # identically.
    again = adadsf_modifier.from_pretrained(tmp_path / "a")
    again.save_pretrained(str(tmp_path / "b"))
    logits_again, _ = forward_record(
        again
    )  # also: saving did not disturb the in-memory model
    torch.testing.assert_close(logits_again, before, rtol=0, atol=0)
    logits_b, _ = forward_record(adadsf_modifier.from_pretrained(tmp_path / "b"))
    torch.testing.assert_close(logits_b, before, rtol=0, atol=0)


# ------------------------------------------------------------------------------------
# Atomic saving
# ------------------------------------------------------------------------------------


def snapshot(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def fail_midway(monkeypatch):
    """Make llm-compressor's save wrapper raise after it wrote weights and
    config.json."""
    import llmcompressor.transformers.compression.compressed_tensors_utils as ctu

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ctu, "update_and_save_recipe", boom)


def test_failed_save_leaves_no_checkpoint_and_keeps_an_existing_one(
    compressed, tmp_path, monkeypatch
):
    model = adadsf_modifier.from_pretrained(compressed[("llama", "w4a16")]["path"])
    reference, _ = forward_record(model)
    fail_midway(monkeypatch)

    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(str(fresh))
    assert not fresh.exists()
    assert os.listdir(tmp_path) == []  # no temporary folder left behind either

    existing = tmp_path / "existing"
    shutil.copytree(compressed[("llama", "w8a8")]["path"], existing)
    before = snapshot(existing)
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(str(existing))
    assert snapshot(existing) == before
    assert sorted(os.listdir(tmp_path)) == ["existing"]
    assert adadsf_modifier.from_pretrained(existing) is not None

    # the model survived the failed saves: it still saves and matches
    monkeypatch.undo()
    model.save_pretrained(str(existing))
    torch.testing.assert_close(forward_record(model)[0], reference, rtol=0, atol=0)
    assert (
        json.loads((existing / "config.json").read_text())["quantization_config"][
            "format"
        ]
        == "pack-quantized"
    )
    assert "tokenizer.json" in os.listdir(
        existing
    )  # files the model save does not own stay
    reloaded, _ = forward_record(adadsf_modifier.from_pretrained(existing))
    torch.testing.assert_close(reloaded, reference, rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == ["existing"]


# ------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------


@pytest.fixture
def ckpt_copy(compressed, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(compressed[("llama", "w8a8")]["path"], path)
    return path


def edit_sidecar(path: Path, **changes):
    side = json.loads((path / SIDECAR_NAME).read_text())
    side.update(changes)
    (path / SIDECAR_NAME).write_text(json.dumps(side))


def edit_tensors(path: Path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_path_without_adadsf_data(base_dirs, tmp_path):
    with pytest.raises(
        AdaDSFCheckpointError, match=f"no AdaDSF data in {base_dirs['llama']}"
    ):
        adadsf_modifier.from_pretrained(base_dirs["llama"])
    with pytest.raises(AdaDSFCheckpointError, match="no AdaDSF data in"):
        adadsf_modifier.from_pretrained(tmp_path / "missing")


def test_unknown_format_version(ckpt_copy):
    edit_sidecar(ckpt_copy, format_version=99)
    with pytest.raises(
        AdaDSFCheckpointError, match=r"unknown AdaDSF format_version 99.*\[1, 2, 3\]"
    ):
        adadsf_modifier.from_pretrained(ckpt_copy)


def test_model_type_mismatch(ckpt_copy):
    edit_sidecar(ckpt_copy, model_type="qwen2")
    with pytest.raises(
        AdaDSFCheckpointError, match="model_type 'qwen2'.*config.json says 'llama'"
    ):
        adadsf_modifier.from_pretrained(ckpt_copy)


def test_missing_router_tensor(ckpt_copy):
    edit_tensors(ckpt_copy, lambda t: t.pop("model.layers.2.router.fc1.weight"))
    with pytest.raises(
        AdaDSFCheckpointError,
        match=r"router tensor `model\.layers\.2\.router\.fc1\.weight`.*missing",
    ):
        adadsf_modifier.from_pretrained(ckpt_copy)


def test_misshaped_router_tensor(ckpt_copy):
    def shrink(t):
        t["model.layers.1.router.fc1.weight"] = t["model.layers.1.router.fc1.weight"][
            :16
        ]

    edit_tensors(ckpt_copy, shrink)
    with pytest.raises(
        AdaDSFCheckpointError,
        match=r"`model\.layers\.1\.router\.fc1\.weight`.*shape \(16, 32\), "
        r"expected \(64, 32\)",
    ):
        adadsf_modifier.from_pretrained(ckpt_copy)


def test_saving_a_model_with_a_quantized_router_is_refused(compressed, tmp_path):
    model = adadsf_modifier.from_pretrained(compressed[("qwen2", "w8a8")]["path"])
    model.model.layers[2].router.fc1.quantization_scheme = "W8A8 (simulated)"
    with pytest.raises(
        AdaDSFCheckpointError,
        match=r"router `model\.layers\.2\.router\.fc1` was quantized.*re:\.\*router",
    ):
        model.save_pretrained(str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_recalibrating_a_w8a8_checkpoint_changes_only_its_thresholds(
    compressed, tmp_path
):
    """``adadsf calibrate`` on a GPTQ W8A8 checkpoint: the quantized weights are the
    source's files, the sidecar differs only in thresholds, and the reload (still
    quantized) routes by the new ones."""
    from adadsf_modifier.recalibration import recalibrate_checkpoint

    source = compressed[("llama", "w8a8")]["path"]
    before = snapshot(source)
    rows = torch.randint(100, 103, (48, 32), generator=torch.Generator().manual_seed(3))
    dest = tmp_path / "mine"
    report = recalibrate_checkpoint(source, rows, dest)
    after = snapshot(dest)
    assert snapshot(source) == before
    assert {n for n in before if before[n] != after.get(n)} == {SIDECAR_NAME}
    old = json.loads((source / SIDECAR_NAME).read_text())["layers"]
    new = json.loads((dest / SIDECAR_NAME).read_text())["layers"]
    for a, b in zip(old, new):
        a.pop("causal_threshold"), b.pop("causal_threshold")
        assert a == b
    model = adadsf_modifier.from_pretrained(dest)
    layers = [m for m in model.modules() if isinstance(m, RoutedLayer)]
    assert [m.causal_threshold for m in layers] == pytest.approx(report.new_thresholds)
    assert report.kept_after == pytest.approx(report.target, abs=0.03)
