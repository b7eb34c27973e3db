"""``route_target`` through the modifier and the checkpoint: oneshot routes the chosen
sub-block, save -> from_pretrained reproduces the logits exactly, the sidecar records
it (format version 3) and older sidecars load as whole-layer routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_save_load import logits_of
from test_route_target import calibrated, route_target_model
from tiny_models import save_tiny_model, token_dataset

import adadsf_modifier
from adadsf_modifier import AdaDSFCheckpointError, AdaDSFModifier
from adadsf_modifier.checkpoint import SIDECAR_NAME, attach_checkpoint_support
from adadsf_modifier.routing import UnsupportedArchitectureError, routed_layers


def _saved(tmp_path: Path, target: str, kv: bool = False) -> tuple[Path, torch.Tensor]:
    model = calibrated(route_target_model("llama", target, kv=kv))
    attach_checkpoint_support(model, similarities=[0.9] * 4)
    path = tmp_path / f"{target}{int(kv)}"
    model.save_pretrained(str(path))
    return path, logits_of(model)


@pytest.mark.parametrize("target,kv", [("attention", False), ("attention", True),
                                       ("mlp", False), ("layer", False)])  # fmt: skip
def test_reload_reproduces_logits_and_route_target(tmp_path, target, kv):
    path, reference = _saved(tmp_path, target, kv)
    side = json.loads((path / SIDECAR_NAME).read_text())
    expected = {"layer": 1, "attention": 3, "mlp": 3}[target]
    assert side["format_version"] == expected
    assert {e["route_target"] for e in side["layers"]} == {target}
    reloaded = adadsf_modifier.from_pretrained(path)
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    assert {m.route_target for m in routed_layers(reloaded)} == {target}


def _edit(path: Path, change) -> None:
    data = json.loads((path / SIDECAR_NAME).read_text())
    change(data)
    (path / SIDECAR_NAME).write_text(json.dumps(data))


def test_sidecar_without_route_target_loads_as_whole_layer_routing(tmp_path):
    """A sidecar written before route_target existed (no key) routes whole layers."""
    path, _ = _saved(tmp_path, "layer")

    def drop(d):
        for e in d["layers"]:
            e.pop("route_target")

    _edit(path, drop)
    reloaded = adadsf_modifier.from_pretrained(path)
    assert {m.route_target for m in routed_layers(reloaded)} == {"layer"}


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda d: d.update(format_version=2), "needs format_version 3"),
        (lambda d: d["layers"][0].update(route_target="attn"), "route_target"),
    ],
)
def test_bad_route_target_fields_are_refused_before_loading(tmp_path, change, match):
    path, _ = _saved(tmp_path, "attention")
    _edit(path, change)
    with pytest.raises(AdaDSFCheckpointError, match=match):
        adadsf_modifier.from_pretrained(path)


def test_an_unrouted_layer_with_a_route_target_is_refused(tmp_path):
    path, _ = _saved(tmp_path, "attention")

    def unroute(d):
        d["layers"][2].update(routed=False, router_hidden_size=None)

    _edit(path, unroute)
    with pytest.raises(AdaDSFCheckpointError, match="only a routed layer"):
        adadsf_modifier.from_pretrained(path)


@pytest.mark.parametrize("target", ["attention", "mlp"])
def test_oneshot_routes_the_sub_block_and_the_checkpoint_keeps_it(tmp_path, target):
    from llmcompressor import oneshot

    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=3)
    mod = AdaDSFModifier(retention=0.5, ignore=["re:.*layers\\.0$"],
                         route_target=target)  # fmt: skip
    model = oneshot(model=base, dataset=token_dataset(16, 32), recipe=[mod],
                    num_calibration_samples=16, max_seq_length=32,
                    output_dir=str(tmp_path / "out"))  # fmt: skip
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)
    assert [m.route_target for m in routed_layers(model)] == [target, target]
    assert len(mod.similarities) == 3
    reference = logits_of(model)
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)


@pytest.mark.parametrize(
    "arch,fields,error",
    [
        ("gpt_neox", {"route_target": "attention"}, UnsupportedArchitectureError),
        ("llama", {"route_target": "attention", "skip_path": "ridge"}, ValueError),
        ("llama", {"route_target": "mlp", "skipped_tokens_kv": True}, ValueError),
    ],
)
def test_modifier_refuses_before_calibration(
    tmp_path, monkeypatch, arch, fields, error
):
    from llmcompressor import oneshot

    import adadsf_modifier.modifier as modifier_module

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran before the refusal")

    monkeypatch.setattr(modifier_module, "run_calibration_batches", no_calibration)
    base = save_tiny_model(arch, str(tmp_path / "base"), num_layers=2)
    with pytest.raises(error, match="route_target"):
        oneshot(model=base, dataset=token_dataset(4, 16),
                recipe=[AdaDSFModifier(retention=0.5, **fields)],
                num_calibration_samples=4, max_seq_length=16)  # fmt: skip
