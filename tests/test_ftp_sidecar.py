"""``ftp_routing.json`` gets the validation ``adadsf_config.json`` gets, through the
same reader: a sidecar that is not JSON, empty, nested without end, or holds a value the
routed model cannot run with is refused in one line naming the file, before the base
model's weights load; router tensors that do not fit it are refused before too."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_ftp_routing import ftp_model

import adadsf_modifier
import adadsf_modifier.ftp.checkpoint as ftp_checkpoint
from adadsf_modifier import AdaDSFCheckpointError
from adadsf_modifier.checkpoint import FTP_SIDECAR_NAME as FTP_SIDECAR
from adadsf_modifier.constraints import InputError

pytestmark = pytest.mark.usefixtures("single_thread")

NAN = float("nan")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """An FTP checkpoint of 4 layers; layers 0, 1 and 3 have a ridge skip path."""
    path = tmp_path_factory.mktemp("ftp_sidecar") / "ckpt"
    model, _ = ftp_model("llama", skip_path="ridge")
    model.save_pretrained(str(path))
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the checkpoint, free to edit."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def edit(path: Path, change) -> None:
    data = json.loads((path / FTP_SIDECAR).read_text())
    change(data)
    (path / FTP_SIDECAR).write_text(json.dumps(data))


def refused_before_weights(ckpt: Path, monkeypatch) -> str:
    """The one-line error ``from_pretrained`` gives, checked to name the folder and to
    come before the base model loads."""

    def no_weights(*args, **kwargs):
        raise AssertionError("the base model loaded before the sidecar was validated")

    monkeypatch.setattr(ftp_checkpoint, "load_base_model", no_weights)
    with pytest.raises(AdaDSFCheckpointError) as info:
        adadsf_modifier.from_pretrained(ckpt)
    message = str(info.value)
    assert isinstance(info.value, InputError)
    assert str(ckpt) in message and "\n" not in message
    return message


def test_a_valid_sidecar_is_written_as_strict_json_and_reloads(saved):
    text = (saved / FTP_SIDECAR).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text}"))
    model = adadsf_modifier.from_pretrained(saved)
    assert [m.causal_threshold for m in adadsf_modifier.routed_layers(model)][2] == (
        float("-inf")
    )  # the layer keeping every token, written as "-inf"


@pytest.mark.parametrize(
    ("content", "says"),
    [("{not json", "not valid JSON"), ("", "empty"), ("  \n", "empty"),
     ("[" * 100_000 + "]" * 100_000, "nested"), ("[1, 2]", "not a JSON object"),
     ('{"format": 2}', "format 2"), ('{"format": "1"}', "format '1'")],
    ids=["not_json", "empty", "blank", "deep", "array", "format_2", "format_text"],
)  # fmt: skip
def test_an_unreadable_sidecar_is_one_line_naming_the_file(
    ckpt, monkeypatch, content, says
):
    (ckpt / FTP_SIDECAR).write_text(content)
    message = refused_before_weights(ckpt, monkeypatch)
    assert str(ckpt / FTP_SIDECAR) in message and says in message, message


def _set_layer(layer: int, **values):
    return lambda data: data["layers"][layer].update(values)


# (case: (change, what the message must match))
BAD_SIDECARS = {
    "nan_threshold": (_set_layer(0, causal_threshold=NAN), r"`layers\[0\]\.causal_"
                      r"threshold`: .*NaN"),
    "text_nan_threshold": (_set_layer(0, causal_threshold="nan"), "NaN"),
    "text_threshold": (_set_layer(1, causal_threshold="banana"), "'banana'"),
    "list_threshold": (_set_layer(1, causal_threshold=[0.1]), "causal_threshold"),
    "zero_score_std": (_set_layer(1, score_std=0.0), r"`layers\[1\]\.score_std`"),
    "nan_score_mean": (_set_layer(1, score_mean=NAN), r"`layers\[1\]\.score_mean`"),
    "text_probe_bias": (_set_layer(1, probe_bias="0"), r"`layers\[1\]\.probe_bias`"),
    "zero_norm_eps": (_set_layer(1, norm_eps=0.0), r"`layers\[1\]\.norm_eps`"),
    "negative_index": (_set_layer(0, index=-1), r"`layers\[0\]\.index`"),
    "index_past_the_model": (_set_layer(3, index=4), r"index 4.*4 decoder layers"),
    "duplicate_index": (_set_layer(2, index=1), r"layers\[2\] has index 1"),
    "ratio_above_one": (_set_layer(1, retention_ratio=1.5), r"retention_ratio.*1\.5"),
    "ratio_below_zero": (_set_layer(1, retention_ratio=-0.1), r"retention_ratio"),
    "router_retention": (_set_layer(1, retention=2.0), r"`layers\[1\]\.retention`"),
    "skip_path_kind": (_set_layer(1, skip_path="cubic"), r"skip_path.*'cubic'"),
    "rank_without_ridge": (_set_layer(2, skip_path_rank=4), "skip_path_rank"),
    "kv_flag_text": (_set_layer(1, skipped_tokens_kv="yes"), "skipped_tokens_kv"),
    "missing_key": (lambda d: d["layers"][1].pop("score_std"), r"score_std`"),
    "no_layers": (lambda d: d.update(layers=[]), "no routed layer"),
    "mlp_hidden_zero": (lambda d: d.update(mlp_hidden=0), r"`mlp_hidden`"),
    "mlp_hidden_text": (lambda d: d.update(mlp_hidden="16"), r"`mlp_hidden`"),
    "position_scale": (lambda d: d.update(position_scale=0), r"`position_scale`"),
    "keep_last": (lambda d: d.update(keep_last=-1), r"`keep_last`"),
    # the router tensors do not fit the sidecar: read and refused before the base model
    "router_shape": (lambda d: d.update(mlp_hidden=8), r"router tensor .*mlp\.fc1.* "
                     r"has shape \(16, 4\), expected \(8, 4\)"),
    "skip_path_rank": (_set_layer(1, skip_path_rank=4), r"skip path tensor `model\."
                       r"layers\.1\.skip_path\.down` is missing"),  # a low-rank map
    "skip_path_missing": (_set_layer(2, skip_path="ridge"), r"layers\.2\.skip_path.*"
                          r"missing"),
    "layer_not_described": (lambda d: d["layers"].pop(), r"router tensor `model\."
                            r"layers\.3\.router\..*does not describe"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SIDECARS))
def test_a_bad_sidecar_is_refused_before_the_base_model_loads(ckpt, monkeypatch, case):
    change, pattern = BAD_SIDECARS[case]
    edit(ckpt, change)
    message = refused_before_weights(ckpt, monkeypatch)
    assert re.search(pattern, message), message


def test_a_deeply_nested_value_inside_the_object_is_refused(ckpt, monkeypatch):
    deep = '{"format": 1, "x": ' + "[" * 200 + "]" * 200 + "}"
    (ckpt / FTP_SIDECAR).write_text(deep)
    assert "nested" in refused_before_weights(ckpt, monkeypatch)


def test_the_save_validates_the_sidecar_it_writes(tmp_path):
    """A NaN threshold is refused at the save, as AdaDSF's, rather than written into a
    checkpoint no reload accepts."""
    model, _ = ftp_model("llama", steps=0)
    adadsf_modifier.routed_layers(model)[0].causal_threshold = NAN
    with pytest.raises(AdaDSFCheckpointError, match=r"causal_threshold.*NaN"):
        model.save_pretrained(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
