"""The ``adadsf_config.json`` schema: round trip, and refusal of bad sidecars before any
weight is loaded, with the file and the field named."""

from __future__ import annotations

import json
import math
import re
import shutil
import typing
from pathlib import Path

import pytest
import torch
from test_checkpoint_save_load import logits_of, routed_model

import adadsf_modifier
from adadsf_modifier.checkpoint.sidecar import (
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    LayerEntry,
    read_sidecar,
    sidecar_for_model,
    write_sidecar,
)
from adadsf_modifier.routing import ROUTING_MODES


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sidecar") / "ckpt"
    routed_model().save_pretrained(str(path))
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the checkpoint, free to edit."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def edit(path: Path, change) -> None:
    data = json.loads((path / SIDECAR_NAME).read_text())
    change(data)
    (path / SIDECAR_NAME).write_text(json.dumps(data))


def set_layer(layer: int, **values):
    return lambda data: data["layers"][layer].update(values)


# ------------------------------------------------------------------------------------
# Round trip
# ------------------------------------------------------------------------------------


def test_sidecar_round_trip_is_lossless(tmp_path):
    model = routed_model()
    sidecar = sidecar_for_model(model)
    write_sidecar(tmp_path, sidecar)
    back = read_sidecar(tmp_path)
    assert back == sidecar
    assert (
        read_sidecar(tmp_path).to_json_dict() == sidecar_for_model(model).to_json_dict()
    )
    assert [e.causal_threshold for e in back.layers] == [None, None, 0.0, math.inf]
    assert [e.routing_mode for e in back.layers] == [None, "auto", "causal", "causal"]
    assert [e.similarity for e in back.layers] == [0.9, 0.8, 0.7, 0.95]
    assert back.routed_layers == back.layers[1:]


def test_schema_routing_modes_are_the_routing_package_modes():
    literal, none = typing.get_args(LayerEntry.model_fields["routing_mode"].annotation)
    assert typing.get_args(literal) == ROUTING_MODES and none is type(None)


# ------------------------------------------------------------------------------------
# Bad sidecars
# ------------------------------------------------------------------------------------

NAN = float("nan")
# (layer, key, bad value, what the error must say after the field name)
BAD_LAYER_VALUES = [
    (2, "causal_threshold", "nan", "NaN"),
    (2, "causal_threshold", NAN, "NaN"),  # a bare NaN token, which json accepts
    (3, "causal_threshold", "banana", "'banana'"),
    (3, "causal_threshold", [1.0], ""),
    (1, "routing_mode", "fast", "'fast'"),
    (1, "retention_ratio", 1.5, "1.5"),
    (2, "retention_ratio", -0.1, "-0.1"),
    (2, "retention_ratio", "0.5", "'0.5'"),
    (2, "retention_ratio", NAN, "finite"),
    (1, "router_hidden_size", 0, "0"),
    (1, "router_eps", -1.0, ""),
    (1, "similarity", "high", ""),
    (1, "routed", "yes", "'yes'"),
    (1, "name", "", ""),
]
BAD_FILES = {
    "routed_without_router_size": (
        lambda d: d["layers"][1].update(router_hidden_size=None),
        r"`layers\[1\]`.*router_hidden_size",
    ),
    "missing_name": (lambda d: d["layers"][1].pop("name"), r"`layers\[1\]\.name`"),
    "wrong_index": (
        lambda d: d["layers"][2].update(index=5),
        r"layers\[2\] has index 5",
    ),
    "layer_count": (lambda d: d["layers"].pop(), r"must list all 4 decoder layers"),
    "no_routed_layer": (
        lambda d: [e.update(routed=False) for e in d["layers"]],
        r"no routed layer",
    ),
    "hidden_size_text": (lambda d: d.update(hidden_size="32"), r"`hidden_size`"),
    "missing_model_type": (lambda d: d.pop("model_type"), r"`model_type`"),
    "version_as_text": (lambda d: d.update(format_version="1"), "format_version '1'"),
    "version_as_bool": (lambda d: d.update(format_version=True), "format_version True"),
    "modifier_not_a_record": (lambda d: d.update(modifier=[1]), r"`modifier`"),
}


def _refused_before_weights(ckpt: Path, monkeypatch) -> str:
    import adadsf_modifier.checkpoint.load as load_mod

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the sidecar was validated")

    monkeypatch.setattr(load_mod, "read_router_tensors", no_weights)
    monkeypatch.setattr(load_mod, "load_with_expected_extra_keys", no_weights)
    with pytest.raises(AdaDSFCheckpointError) as info:
        adadsf_modifier.from_pretrained(ckpt)
    message = str(info.value)
    assert str(ckpt / SIDECAR_NAME) in message and "\n" not in message
    return message


@pytest.mark.parametrize(("layer", "key", "value", "says"), BAD_LAYER_VALUES)
def test_bad_layer_value_is_refused_before_any_weight_loads(
    ckpt, monkeypatch, layer, key, value, says
):
    edit(ckpt, lambda d: d["layers"][layer].update({key: value}))
    message = _refused_before_weights(ckpt, monkeypatch)
    assert f"`layers[{layer}].{key}`" in message
    assert says in message.split(f"`layers[{layer}].{key}`", 1)[1]


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_sidecar_is_refused_before_any_weight_loads(ckpt, monkeypatch, case):
    change, pattern = BAD_FILES[case]
    edit(ckpt, change)
    message = _refused_before_weights(ckpt, monkeypatch)
    assert re.search(pattern, message), message


def test_textual_threshold_error_names_file_and_field_with_intact_weights(ckpt):
    """Today's loader read the weights first and failed later with a bare float()
    error."""
    edit(ckpt, set_layer(3, causal_threshold="banana"))
    with pytest.raises(AdaDSFCheckpointError, match=r"layers\[3\]\.causal_threshold"):
        adadsf_modifier.from_pretrained(ckpt)


def test_nan_threshold_is_refused_instead_of_running_only_the_first_token(ckpt):
    edit(ckpt, set_layer(2, causal_threshold="nan"))
    with pytest.raises(AdaDSFCheckpointError, match=r"causal_threshold"):
        adadsf_modifier.from_pretrained(ckpt)


def test_unknown_routing_mode_is_refused_at_load_not_at_first_forward(ckpt):
    edit(ckpt, set_layer(1, routing_mode="fast"))
    with pytest.raises(AdaDSFCheckpointError, match=r"routing_mode.*'fast'"):
        adadsf_modifier.from_pretrained(ckpt)


def test_a_layer_saved_in_retired_rank_routing_loads_causal_with_a_warning(
    ckpt, logged_warnings
):
    """Rank routing is retired; its checkpoints hold causal thresholds too, so they
    load routing by them (the same logits as a causal save), and say so."""
    reference = logits_of(adadsf_modifier.from_pretrained(ckpt))
    edit(ckpt, set_layer(2, routing_mode="rank"))
    model = adadsf_modifier.from_pretrained(ckpt)
    assert model.model.layers[2].routing_mode == "causal"
    torch.testing.assert_close(logits_of(model), reference, rtol=0, atol=0)
    assert any("saved in rank routing" in m for m in logged_warnings)


def test_unknown_keys_are_ignored_and_optional_keys_default(ckpt):
    reference = logits_of(adadsf_modifier.from_pretrained(ckpt))

    def change(data):
        data["added_in_a_later_version"] = {"x": 1}
        data.pop("router_dtype")
        data["layers"][1]["new_layer_key"] = True
        for key in ("similarity", "router_eps"):
            data["layers"][1].pop(key)

    edit(ckpt, change)
    model = adadsf_modifier.from_pretrained(ckpt)
    torch.testing.assert_close(logits_of(model), reference, rtol=0, atol=0)


def test_sidecar_that_disagrees_with_config_json_is_refused_before_loading(ckpt):
    edit(ckpt, lambda d: d.update(hidden_size=64))
    with pytest.raises(AdaDSFCheckpointError, match=r"hidden_size=32.*says 64"):
        adadsf_modifier.from_pretrained(ckpt)
    edit(ckpt, lambda d: d.update(hidden_size=32, model_type="qwen2"))
    with pytest.raises(AdaDSFCheckpointError, match="model_type 'qwen2'.*'llama'"):
        adadsf_modifier.from_pretrained(ckpt)


@pytest.mark.parametrize(
    ("content", "match"),
    [("{not json", "not valid JSON"), ('{"format": "other"}', "not an AdaDSF sidecar"),
     ('{"format": "adadsf", "format_version": 99}', r"format_version 99.*\[1, 2, 3\]"),
     ("", "is empty"), ("[" * 100_000 + "]" * 100_000, "nested"),
     ('{"format": "adadsf", "modifier": ' + "[" * 200 + "]" * 200 + "}", "nested")],
)  # fmt: skip
def test_unreadable_sidecar(ckpt, content, match):
    (ckpt / SIDECAR_NAME).write_text(content)
    with pytest.raises(AdaDSFCheckpointError, match=match):
        read_sidecar(ckpt)


def test_missing_sidecar_and_missing_folder(ckpt, tmp_path):
    (ckpt / SIDECAR_NAME).unlink()
    # its weights still hold routers: the sidecar was lost (not a plain model)
    with pytest.raises(AdaDSFCheckpointError, match="routing data is missing"):
        adadsf_modifier.from_pretrained(ckpt)
    with pytest.raises(AdaDSFCheckpointError, match="not a local checkpoint folder"):
        read_sidecar(tmp_path / "missing")


def test_router_tensor_of_an_unrouted_layer_is_refused(ckpt):
    edit(ckpt, set_layer(1, routed=False))
    with pytest.raises(
        AdaDSFCheckpointError, match="says layer `model.layers.1` is not"
    ):
        adadsf_modifier.from_pretrained(ckpt)
