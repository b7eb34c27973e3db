"""A checkpoint's tensors are read from its own folder, whole and finite, or the load
refuses in one line: a corrupt router, a missing base tensor, a shard outside the folder
or a malformed shard index never gives a silently different model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_save_load import routed_model

import adadsf_modifier
from adadsf_modifier import AdaDSFCheckpointError

pytestmark = pytest.mark.usefixtures("single_thread")

INDEX = "model.safetensors.index.json"


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    routed_model().save_pretrained(path)
    return path


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_router_weight_that_is_not_finite_is_refused(saved, bad):
    def poison(tensors):
        key = next(k for k in tensors if k.endswith("router.fc1.weight"))
        tensors[key] = torch.full_like(tensors[key], bad)

    _rewrite(saved, poison)
    with pytest.raises(AdaDSFCheckpointError, match="NaN or infinite"):
        adadsf_modifier.from_pretrained(saved)


def test_a_missing_base_tensor_is_refused_not_initialised_at_random(saved):
    def drop(tensors):
        del tensors[next(k for k in tensors if k.endswith("mlp.down_proj.weight"))]

    _rewrite(saved, drop)
    with pytest.raises(AdaDSFCheckpointError, match="lack 1 tensor"):
        adadsf_modifier.from_pretrained(saved)


def test_a_shard_outside_the_folder_is_refused(saved, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (saved / "model.safetensors").rename(outside)
    keys = list(load_file(outside))
    weight_map = {k: "../elsewhere.safetensors" for k in keys}
    (saved / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(AdaDSFCheckpointError, match="outside"):
        adadsf_modifier.from_pretrained(saved)


@pytest.mark.parametrize(
    "text, message",
    [("{not json", "not valid JSON"), ('{"metadata": {}}', "no `weight_map`"),
     ('{"weight_map": {"a": 3}}', "no `weight_map`"), ("", "is empty"),
     ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested")],
)  # fmt: skip
def test_a_malformed_shard_index_names_the_file(saved, text, message):
    (saved / INDEX).write_text(text)
    with pytest.raises(AdaDSFCheckpointError, match=message) as err:
        adadsf_modifier.from_pretrained(saved)
    assert INDEX in str(err.value)


def test_a_routed_checkpoint_without_its_sidecar_is_not_taken_for_a_dense_model(
    saved, capsys
):
    from tiny_models import tiny_tokenizer

    from adadsf_modifier.checkpoint import SIDECAR_NAME
    from adadsf_modifier.cli import main

    tiny_tokenizer().save_pretrained(saved)  # a complete model folder otherwise
    (saved / SIDECAR_NAME).unlink()
    with pytest.raises(AdaDSFCheckpointError, match="routing data is missing"):
        adadsf_modifier.from_pretrained(saved)
    assert main(["eval", "--model", str(saved), "--ppl-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "routing data is missing" in err


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_a_damaged_weights_file_is_named_before_any_weight_loads(saved, damage):
    file = saved / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-100] if damage == "truncated" else b"")
    with pytest.raises(AdaDSFCheckpointError, match="model.safetensors is not a"):
        adadsf_modifier.from_pretrained(saved)


def test_a_missing_shard_of_an_index_is_named(saved):
    keys = list(load_file(saved / "model.safetensors"))
    (saved / INDEX).write_text(
        json.dumps(
            {"weight_map": {k: "model-00002-of-00002.safetensors" for k in keys}}
        )
    )
    with pytest.raises(AdaDSFCheckpointError, match="model-00002-of-00002.safetensors"):
        adadsf_modifier.from_pretrained(saved)


def test_the_command_line_reports_a_damaged_checkpoint_in_one_line(saved, capsys):
    from tiny_models import tiny_tokenizer

    from adadsf_modifier.cli import main

    tiny_tokenizer().save_pretrained(saved)
    file = saved / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    assert main(["eval", "--model", str(saved), "--ppl-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "is not a readable safetensors file" in err and "Traceback" not in err
