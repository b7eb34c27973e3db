"""Refitting a saved checkpoint's causal thresholds on a deployment's own text
(``adadsf calibrate``, ``checkpoint.recalibrate``): the budget holds on text of another
distribution than the calibration set's, and nothing but the thresholds changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error, refuse_heavy_work, run
from tiny_models import tiny_model, tiny_tokenizer

import adadsf_modifier
import adadsf_modifier.cli
import adadsf_modifier.recalibration
from adadsf_modifier.checkpoint import SIDECAR_NAME, attach_checkpoint_support
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.recalibration import recalibrate_checkpoint
from adadsf_modifier.routing import TokenRouter, decoder_layers, route_layer

RATIOS = [None, 0.6, 0.5, 0.7]


def rows_of(low: int, high: int, n: int = 24, length: int = 32, seed: int = 0):
    """``n`` rows of token ids drawn from ``[low, high)``: a "text distribution"."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n, length), generator=g)


def batches(rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": r[None], "attention_mask": torch.ones_like(r[None])} for r in rows
    ]


def kept_share(model, rows: torch.Tensor) -> tuple[float, float]:
    share = KeptShare(model)
    for batch in batches(rows):
        share.add(normalized_flops(model, batch))
    return share.fraction, share.target


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny routed llama whose thresholds were calibrated on ids 4-11, saved."""
    model = tiny_model("llama", 4)
    spec, layers = decoder_layers(model)
    torch.manual_seed(1)
    for i, ((_, layer), ratio) in enumerate(zip(layers, RATIOS)):
        if ratio is not None:
            router = TokenRouter(model.config.hidden_size, 16)
            route_layer(layer, router, ratio, i, spec.cache_kwarg, model.config)
    calibrate_thresholds(model, batches(rows_of(4, 12)))
    attach_checkpoint_support(model, similarities=[0.9, 0.8, 0.7, 0.95])
    path = tmp_path / "routed"
    model.eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_refit_thresholds_hold_the_budget_on_text_unlike_the_calibration_set(
    checkpoint, tmp_path
):
    """Thresholds fitted on one distribution miss the budget on another; refit on
    rows of the other, the reloaded checkpoint keeps its target share on *held-out*
    rows of it, and the source checkpoint is left as it was."""
    shifted_fit = rows_of(100, 103, n=64, seed=1)
    shifted_test = rows_of(100, 103, n=64, seed=2)
    old = adadsf_modifier.from_pretrained(checkpoint).eval()
    before, target = kept_share(old, shifted_test)
    assert abs(before - target) > 0.05  # the drift this is about
    source_files = digests(checkpoint)

    dest = tmp_path / "mine"
    report = recalibrate_checkpoint(checkpoint, shifted_fit, dest)

    new = adadsf_modifier.from_pretrained(dest).eval()
    after, target_after = kept_share(new, shifted_test)
    assert target_after == pytest.approx(target)
    assert abs(after - target) <= 0.02, (before, after, target)
    assert report.kept_after == pytest.approx(target, abs=0.02)
    assert report.kept_before == pytest.approx(kept_share(old, shifted_fit)[0])
    assert digests(checkpoint) == source_files  # the source is untouched


def test_only_the_thresholds_change(checkpoint, tmp_path):
    """Weights and every other file are the source's; the sidecar differs only in
    the routed layers' ``causal_threshold``, which are what the model now uses."""
    dest = tmp_path / "mine"
    report = recalibrate_checkpoint(checkpoint, rows_of(100, 103, seed=1), dest)
    old_files, new_files = digests(checkpoint), digests(dest)
    assert old_files.keys() == new_files.keys()
    for name in old_files:
        if name != SIDECAR_NAME:
            assert old_files[name] == new_files[name], name
    old = json.loads((checkpoint / SIDECAR_NAME).read_text())
    new = json.loads((dest / SIDECAR_NAME).read_text())
    changed = []
    for a, b in zip(old.pop("layers"), new.pop("layers")):
        if a["causal_threshold"] != b["causal_threshold"]:
            changed.append(a["index"])
        a.pop("causal_threshold"), b.pop("causal_threshold")
        assert a == b
    assert old == new
    assert changed == report.layer_indices == [1, 2, 3]
    model = adadsf_modifier.from_pretrained(dest)
    assert [m.causal_threshold for m in adadsf_modifier.routed_layers(model)] == (
        pytest.approx(report.new_thresholds)
    )


def test_in_place_replaces_the_thresholds_atomically(checkpoint):
    report = recalibrate_checkpoint(checkpoint, rows_of(100, 103, seed=1), checkpoint)
    model = adadsf_modifier.from_pretrained(checkpoint)
    assert [m.causal_threshold for m in adadsf_modifier.routed_layers(model)] == (
        pytest.approx(report.new_thresholds)
    )
    assert report.old_thresholds != report.new_thresholds
    assert not [p for p in checkpoint.parent.iterdir() if ".adadsf-" in p.name]


def test_cli_refits_from_text_files(checkpoint, tmp_path, capsys):
    text = tmp_path / "traffic.txt"
    text.write_text(" ".join(f"w{100 + i % 3}" for i in range(400)))
    dest = tmp_path / "mine"
    code = adadsf_modifier.cli.main(
        ["calibrate", "--routed", str(checkpoint), "--text", str(text),
         "--output-dir", str(dest), "--rows", "8", "--seq-len", "32"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "kept share" in out and (dest / SIDECAR_NAME).is_file()


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such file"),
        ("empty", "holds no text"),
        ("binary", "not UTF-8"),
        ("short", "fewer than one row"),
        ("in_place", "pass --overwrite"),
        ("taken", "exists and is not empty"),
        ("inside", "is inside the checkpoint"),
        ("holding", "is a folder holding the checkpoint"),
    ],
)
def test_cli_refuses_bad_input_before_loading(
    checkpoint, tmp_path, capsys, monkeypatch, case, message
):
    import adadsf_modifier.recalibration as recalibrate

    refuse_heavy_work(monkeypatch, recalibrate, ["recalibrate_checkpoint"])
    text = tmp_path / "traffic.txt"
    text.write_text("w1 w2 w3 " * 100)
    dest = tmp_path / "mine"
    if case == "missing":
        text = tmp_path / "nope.txt"
    elif case == "empty":
        text.write_text("  \n")
    elif case == "binary":
        text.write_bytes(b"\xff\xfe\x00abc")
    elif case == "short":
        text.write_text("w1 w2")
    elif case == "in_place":
        dest = checkpoint
    elif case == "taken":
        dest.mkdir()
        (dest / "x").write_text("x")
    elif case == "inside":
        dest = checkpoint / "mine"
    elif case == "holding":
        dest = checkpoint.parent
    before = digests(checkpoint)
    code, err = run(
        capsys, "calibrate", "--routed", checkpoint, "--text", text,
        "--output-dir", dest, "--seq-len", "64",
    )  # fmt: skip
    assert message in one_line_error(code, err), err
    assert digests(checkpoint) == before


def test_an_ftp_checkpoint_gets_its_thresholds_refit_too(tmp_path):
    """FTP's sidecar keeps its thresholds in its layer entries: refit, everything else
    in it and every weight file as they were, and the reload uses the new ones."""
    from test_ftp_routing import ftp_model

    from adadsf_modifier.checkpoint import FTP_SIDECAR_NAME as FTP_SIDECAR

    model, _ = ftp_model("llama")
    source = tmp_path / "ftp"
    model.save_pretrained(source)
    dest = tmp_path / "mine"
    report = recalibrate_checkpoint(source, rows_of(100, 103, n=32, seed=1), dest)
    old_files, new_files = digests(source), digests(dest)
    assert {n for n in old_files if old_files[n] != new_files[n]} == {FTP_SIDECAR}
    old = json.loads((source / FTP_SIDECAR).read_text())
    new = json.loads((dest / FTP_SIDECAR).read_text())
    moved = [
        a["index"]
        for a, b in zip(old["layers"], new["layers"])
        if a.pop("causal_threshold") != b.pop("causal_threshold")
    ]
    assert old == new and moved
    again = adadsf_modifier.from_pretrained(dest)
    assert [m.causal_threshold for m in adadsf_modifier.routed_layers(again)] == (
        pytest.approx(report.new_thresholds)
    )
    assert report.kept_after == pytest.approx(report.target, abs=0.03)


def test_a_layer_that_reads_no_threshold_is_refused_before_loading(
    checkpoint, tmp_path, monkeypatch
):
    """A checkpoint saved in top-k mode routes without thresholds: nothing to refit,
    and a threshold above such a layer would be fitted on inputs it never sees."""
    from adadsf_modifier.constraints import InputError
    from adadsf_modifier.routing import set_routing_mode

    model = adadsf_modifier.from_pretrained(checkpoint)
    set_routing_mode(model, "topk")
    ranked = tmp_path / "ranked"
    model.save_pretrained(ranked)
    monkeypatch.setattr(
        adadsf_modifier.recalibration, "from_pretrained", lambda *a, **k: 1 / 0
    )
    with pytest.raises(InputError, match="mode 'topk', which reads no threshold"):
        recalibrate_checkpoint(ranked, rows_of(100, 103), tmp_path / "mine")


def test_weights_are_shared_and_other_files_are_copies(checkpoint, tmp_path):
    """The copy's weight files are the source's (hard links, not rewritten); its
    config and tokenizer files are its own, so editing them leaves the source as it
    was."""
    dest = tmp_path / "mine"
    recalibrate_checkpoint(checkpoint, rows_of(100, 103, seed=1), dest)
    weights = [p.name for p in checkpoint.iterdir() if p.suffix == ".safetensors"]
    assert weights
    for name in weights:
        assert (dest / name).stat().st_ino == (checkpoint / name).stat().st_ino
    before = (checkpoint / "config.json").read_text()
    (dest / "config.json").write_text("{}")
    assert (checkpoint / "config.json").read_text() == before


def test_a_refit_that_misses_its_plan_is_refused_unless_allowed(
    checkpoint, tmp_path, capsys, logged_warnings
):
    """One word repeated: every row is the same tokens, the router scores tie, and no
    threshold reaches a layer's planned share. Nothing is written without the flag;
    with it, the checkpoint is written and the miss is a warning."""
    text = tmp_path / "one_word.txt"
    text.write_text(" ".join(["w100"] * 3000))
    argv = ["calibrate", "--routed", str(checkpoint), "--text", str(text),
            "--rows", "8", "--seq-len", "32", "--output-dir"]  # fmt: skip
    dest = tmp_path / "mine"
    assert adadsf_modifier.cli.main([*argv, str(dest)]) == 2
    err = capsys.readouterr().err
    assert "miss their plan" in err and "--allow-missed-plan" in err
    assert "Traceback" not in err and not dest.exists()
    assert adadsf_modifier.cli.main([*argv, str(dest), "--allow-missed-plan"]) == 0
    assert (dest / SIDECAR_NAME).is_file()
    assert any("written anyway" in m for m in logged_warnings)


def test_cli_refits_from_a_dataset_as_from_the_same_text_files(checkpoint, tmp_path):
    """``--dataset`` (a .jsonl here) gives the thresholds ``--text`` gives on the
    same documents."""
    import json

    docs = [" ".join(f"w{100 + (i * 7 + j) % 3}" for i in range(200)) for j in range(3)]
    data = tmp_path / "traffic.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    files = []
    for j, d in enumerate(docs):
        files.append(tmp_path / f"doc{j}.txt")
        files[-1].write_text(d)
    common = ["--routed", str(checkpoint), "--rows", "8", "--seq-len", "32",
              "--allow-missed-plan"]  # fmt: skip
    a, b = tmp_path / "from_dataset", tmp_path / "from_files"
    assert (
        adadsf_modifier.cli.main(
            ["calibrate", *common, "--dataset", str(data), "--output-dir", str(a)]
        )
        == 0
    )
    assert (
        adadsf_modifier.cli.main(
            ["calibrate", *common, "--text", *map(str, files), "--output-dir", str(b)]
        )
        == 0
    )
    thresholds = [
        [
            e["causal_threshold"]
            for e in json.loads((d / SIDECAR_NAME).read_text())["layers"]
        ]
        for d in (a, b)
    ]
    assert thresholds[0] == thresholds[1]
