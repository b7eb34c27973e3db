"""Skip paths and kept keys/values survive save -> from_pretrained exactly, alone and
stacked with GPTQ; sidecars that would load a different model are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_causal_routing import incremental_logits, left_padded
from test_checkpoint_save_load import logits_of
from test_routing import positions
from tiny_models import (
    ARCHITECTURES,
    DISTINCT_ARCHITECTURES,
    save_tiny_model,
    tiny_model,
    token_dataset,
)
from transformers import AutoModelForCausalLM

import adadsf_modifier
from adadsf_modifier import AdaDSFCheckpointError, AdaDSFModifier
from adadsf_modifier.checkpoint import SIDECAR_NAME, attach_checkpoint_support
from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.routing import (
    SkipPath,
    TokenRouter,
    decoder_layers,
    route_layer,
    routed_layers,
)

# layer 0 dense; full-rank map + K/V; rank-4 map; removed layer with a map; K/V only
SETTINGS = [None, (0.5, None, True), (0.6, 4, False), (0.0, None, False),
            (0.7, False, True)]  # fmt: skip


def variant_model(arch="llama", seed=0):
    model = tiny_model(arch, len(SETTINGS), seed)
    spec, layers = decoder_layers(model)
    g = torch.Generator().manual_seed(seed + 1)
    for i, ((_, layer), setting) in enumerate(zip(layers, SETTINGS)):
        if setting is None:
            continue
        ratio, rank, kv = setting
        skip = None
        if rank is not False:
            skip = SkipPath(model.config.hidden_size, rank)
            with torch.no_grad():
                for p in skip.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        route_layer(layer, TokenRouter(model.config.hidden_size, 16), ratio, i,
                    spec.cache_kwarg, model.config, skip, kv)  # fmt: skip
    batches = [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    calibrate_thresholds(model, batches)
    attach_checkpoint_support(model, similarities=[0.9] * len(SETTINGS))
    return model.eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reload_reproduces_logits_skip_paths_and_kv_settings(arch, tmp_path):
    model = variant_model(arch)
    reference = logits_of(model)
    model.save_pretrained(str(tmp_path / "ckpt"))
    side = json.loads((tmp_path / "ckpt" / SIDECAR_NAME).read_text())
    assert side["format_version"] == 2
    assert [(e["skip_path"], e["skip_path_rank"], e["skipped_tokens_kv"])
            for e in side["layers"]] == [
        ("identity", None, False), ("ridge", None, True), ("ridge", 4, False),
        ("ridge", None, False), ("identity", None, True)]  # fmt: skip

    reloaded = adadsf_modifier.from_pretrained(tmp_path / "ckpt")
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    for a, b in zip(routed_layers(model), routed_layers(reloaded)):
        assert a.skipped_tokens_kv == b.skipped_tokens_kv
        sa, sb = a._modules.get("skip_path"), b._modules.get("skip_path")
        assert (sa is None) == (sb is None)
        if sa is not None:
            assert sb.rank == sa.rank
            for pa, pb in zip(sa.parameters(), sb.parameters()):
                assert torch.equal(pa, pb)
    # the reloaded model decodes from its cache as one full forward
    ids, mask = left_padded(2, 10)
    with torch.no_grad():
        full = reloaded(input_ids=ids, attention_mask=mask, use_cache=False,
                        position_ids=positions(mask)).logits  # fmt: skip
        inc, _ = incremental_logits(reloaded, ids, mask, prefill=4)
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)


def test_a_model_without_the_variants_still_writes_format_version_1(tmp_path):
    model = tiny_model("llama", 2)
    spec, layers = decoder_layers(model)
    route_layer(layers[1][1], TokenRouter(32, 8), 0.5, 1, spec.cache_kwarg,
                model.config)  # fmt: skip
    attach_checkpoint_support(model, similarities=[0.5, 0.5])
    model.save_pretrained(str(tmp_path / "ckpt"))
    side = json.loads((tmp_path / "ckpt" / SIDECAR_NAME).read_text())
    assert side["format_version"] == 1
    assert side["layers"][1]["skip_path"] == "identity"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("variants") / "ckpt"
    variant_model().save_pretrained(str(path))
    return path


def _edit(path: Path, change) -> None:
    data = json.loads((path / SIDECAR_NAME).read_text())
    change(data)
    (path / SIDECAR_NAME).write_text(json.dumps(data))


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda d: d.update(format_version=1), "need format_version 2"),
        (lambda d: d["layers"][0].update(skipped_tokens_kv=True), "only a routed"),
        (lambda d: d["layers"][4].update(skip_path_rank=3), "needs skip_path 'ridge'"),
        (lambda d: d["layers"][1].update(skip_path="linear"), "skip_path"),
        (lambda d: d["layers"][2].update(skip_path_rank=0), "skip_path_rank"),
    ],
)
def test_bad_variant_fields_are_refused_before_loading(saved, tmp_path, change, match):
    path = _copy(saved, tmp_path)
    _edit(path, change)
    with pytest.raises(AdaDSFCheckpointError, match=match):
        adadsf_modifier.from_pretrained(path)


def test_missing_or_unexpected_skip_path_tensors_are_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.2.skip_path.down"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AdaDSFCheckpointError, match="skip path tensor.*layers.2"):
        adadsf_modifier.from_pretrained(path)
    path = _copy(saved, tmp_path / "b")
    _edit(path, lambda d: d["layers"][1].update(skip_path="identity"))
    with pytest.raises(AdaDSFCheckpointError, match="gives layer `model.layers.1` no"):
        adadsf_modifier.from_pretrained(path)


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_gptq_stacks_without_quantizing_the_skip_paths(arch, tmp_path):
    """AdaDSF (ridge skip path + kept K/V) then GPTQ W8A8 in one recipe: the skip paths
    stay float, unquantized, and the checkpoint reloaded (``from_pretrained``, and
    ``AutoModelForCausalLM`` with the package imported) reproduces the compressed
    model's logits exactly."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    base = save_tiny_model(arch, str(tmp_path / "base"), num_layers=3)
    recipe = [
        AdaDSFModifier(retention=0.7, ignore=["re:.*layers\\.0$"], skip_path="ridge",
                       skip_path_rank=8, skipped_tokens_kv=True),
        GPTQModifier(targets="Linear", scheme="W8A8",
                     ignore=["lm_head", "re:.*router.*"]),
    ]  # fmt: skip
    model = oneshot(model=base, dataset=token_dataset(16, 32), recipe=recipe,
                    num_calibration_samples=16, max_seq_length=32,
                    output_dir=str(tmp_path / "out"))  # fmt: skip
    for name, module in model.named_modules():
        if "skip_path" in name:
            assert getattr(module, "quantization_scheme", None) is None
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)
    reference = logits_of(model)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    skip = {k: v for k, v in tensors.items() if ".skip_path." in k}
    partial = [m for m in routed_layers(model) if m.retention_ratio < 1.0]
    assert partial and all(v.is_floating_point() for v in skip.values())
    assert len(skip) == 3 * len(partial)  # down, up, bias
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    assert all(m.skipped_tokens_kv for m in routed_layers(reloaded))
    assert any(  # the decoder's projections were quantized
        getattr(m, "quantization_scheme", None) is not None
        for m in decoder_layers(reloaded)[1][1][1].modules()
    )
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(auto), reference, rtol=0, atol=0)
