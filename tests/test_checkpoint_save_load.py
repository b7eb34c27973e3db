"""Saving and reloading AdaDSF checkpoints without GPTQ: tiny config-built models routed
with ``route_layer`` (or the modifier), saved through the hook, reloaded with
``from_pretrained``.

The reloaded model must reproduce the in-memory model's logits exactly: both hold the
same float32 weights and routers and run the same CPU kernels in one process, so any
difference means a router, ratio, threshold or mode did not survive the round trip.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHITECTURES, save_tiny_model, tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier
from adadsf_modifier import AdaDSFCheckpointError, AdaDSFModifier, RoutedLayer
from adadsf_modifier.checkpoint import SIDECAR_NAME, attach_checkpoint_support
from adadsf_modifier.routing import TokenRouter, decoder_layers, route_layer

NUM_LAYERS = 4
# Layer 0 dense; then top-k (no threshold), causal with a finite threshold, causal
# with +inf (keeps only the first token), auto with -inf (keeps every token).
SETTINGS = [
    None,
    (0.5, None, "auto"),
    (0.6, 0.0, "causal"),
    (0.4, float("inf"), "causal"),
]


pytestmark = pytest.mark.usefixtures("single_thread")


def routed_model(arch: str = "llama", settings=SETTINGS, seed: int = 0):
    """A tiny model routed by hand, with AdaDSF checkpoint support attached."""
    model = tiny_model(arch, NUM_LAYERS, seed)
    spec, layers = decoder_layers(model)
    torch.manual_seed(seed + 1)
    for i, ((_, layer), setting) in enumerate(zip(layers, settings)):
        if setting is None:
            continue
        ratio, threshold, mode = setting
        router = TokenRouter(model.config.hidden_size, 16)
        route_layer(layer, router, ratio, i, spec.cache_kwarg, model.config)
        layer.causal_threshold = threshold
        layer.routing_mode = mode
    sims = [0.9, 0.8, 0.7, 0.95][: len(layers)]
    attach_checkpoint_support(model, similarities=sims)
    return model.eval()


def inputs():
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # one left-padded row
    return ids, mask


def logits_of(model) -> torch.Tensor:
    ids, mask = inputs()
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


def snapshot(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".adadsf-" in p.name)


# ------------------------------------------------------------------------------------
# Round trip
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reload_reproduces_logits_and_routing_settings(arch, tmp_path):
    model = routed_model(arch)
    reference = logits_of(model)
    model.save_pretrained(str(tmp_path / "ckpt"))
    assert leftovers(tmp_path) == []

    reloaded = adadsf_modifier.from_pretrained(tmp_path / "ckpt")
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    torch.testing.assert_close(logits_of(auto), reference, rtol=0, atol=0)
    _, layers = decoder_layers(reloaded)
    for (_, layer), setting in zip(layers, SETTINGS):
        assert isinstance(layer, RoutedLayer) == (setting is not None)
        if setting is not None:
            ratio, threshold, mode = setting
            assert layer.retention_ratio == ratio
            assert layer.causal_threshold == threshold
            assert layer.routing_mode == mode
    # top-k in eval mode (layer 1) cannot continue from a KV cache
    assert reloaded.generation_config.use_cache is False


def test_infinite_thresholds_are_written_as_text_and_reload(tmp_path):
    settings = [None, (0.5, float("-inf"), "auto"), (0.5, float("inf"), "causal"),
                (0.5, 0.25, "auto")]  # fmt: skip
    model = routed_model("qwen2", settings)
    reference = logits_of(model)
    model.save_pretrained(str(tmp_path / "ckpt"))
    text = (tmp_path / "ckpt" / SIDECAR_NAME).read_text()
    assert "Infinity" not in text and "NaN" not in text  # strict JSON
    side = json.loads(text)
    assert [e["causal_threshold"] for e in side["layers"]] == [
        None,
        "-inf",
        "inf",
        0.25,
    ]
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "ckpt")
    thresholds = [
        getattr(m, "causal_threshold", None) for _, m in decoder_layers(reloaded)[1]
    ]
    assert thresholds == [None, float("-inf"), float("inf"), 0.25]
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    # every layer has a threshold: causal mode in eval, so the KV cache stays on
    assert reloaded.generation_config.use_cache is not False


def test_oneshot_output_dir_round_trip_with_modifier_settings(tmp_path):
    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=NUM_LAYERS)
    from llmcompressor import oneshot

    recipe = [AdaDSFModifier(retention=0.8, ignore=["re:.*layers\\.0$"])]
    model = oneshot(model=base, dataset=token_dataset(8, 16), recipe=recipe,
                    num_calibration_samples=8, max_seq_length=16,
                    output_dir=str(tmp_path / "out"))  # fmt: skip
    reference = logits_of(model)
    side = json.loads((tmp_path / "out" / SIDECAR_NAME).read_text())
    assert side["modifier"]["class"] == "AdaDSFModifier"
    assert side["modifier"]["settings"]["retention"] == 0.8
    assert [e["routed"] for e in side["layers"]] == [False, True, True, True]
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(reloaded), reference, rtol=0, atol=0)
    assert reloaded.adadsf_metadata["modifier"] == side["modifier"]


def test_resave_after_reload_keeps_other_files_and_replaces_the_model(tmp_path):
    dest = tmp_path / "ckpt"
    routed_model(seed=0).save_pretrained(str(dest))
    (dest / "README.md").write_text("mine")
    second = routed_model(seed=5)
    second.save_pretrained(str(dest))
    assert (dest / "README.md").read_text() == "mine"
    reloaded = adadsf_modifier.from_pretrained(dest)
    torch.testing.assert_close(logits_of(reloaded), logits_of(second), rtol=0, atol=0)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------
# Where and how the folder is written
# ------------------------------------------------------------------------------------


def test_save_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    real = tmp_path / "real"
    link = tmp_path / "link"
    routed_model(seed=0).save_pretrained(str(real))
    link.symlink_to(real, target_is_directory=True)
    second = routed_model(seed=3)
    second.save_pretrained(str(link))

    assert link.is_symlink() and os.readlink(link) == str(real)
    assert leftovers(tmp_path) == []  # no stray `.link.adadsf-tmp-*` link either
    reloaded = adadsf_modifier.from_pretrained(real)  # the target holds the new model
    torch.testing.assert_close(logits_of(reloaded), logits_of(second), rtol=0, atol=0)


def test_failed_save_leaves_the_destination_untouched(tmp_path, monkeypatch):
    import llmcompressor.transformers.compression.compressed_tensors_utils as ctu

    dest = tmp_path / "ckpt"
    routed_model(seed=0).save_pretrained(str(dest))
    before = snapshot(dest)

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ctu, "update_and_save_recipe", boom)
    with pytest.raises(OSError, match="simulated"):
        routed_model(seed=1).save_pretrained(str(dest))
    assert snapshot(dest) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_nan_threshold_in_memory_is_refused_before_writing(tmp_path):
    model = routed_model()
    model.model.layers[2].causal_threshold = float("nan")
    with pytest.raises(AdaDSFCheckpointError, match=r"layers\[2\]\.causal_threshold"):
        model.save_pretrained(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []


def _save_then_hang(model, dest: str, ready: str) -> None:
    """Child process: a save that has written its weights, then never finishes."""
    import llmcompressor.transformers.compression.compressed_tensors_utils as ctu

    def hang(*args, **kwargs):
        Path(ready).write_text("weights written")
        time.sleep(600)

    ctu.update_and_save_recipe = hang
    model.save_pretrained(dest)


def _killed_save(model, dest: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    proc = multiprocessing.get_context("fork").Process(
        target=_save_then_hang, args=(model, str(dest), str(ready))
    )
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the child save never reached the hang"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("existing", [False, True])
def test_sigkill_mid_save_leaves_no_partial_checkpoint_and_next_save_cleans_up(
    tmp_path, existing
):
    root = tmp_path / "out"
    root.mkdir()
    dest = root / "ckpt"
    if existing:
        routed_model(seed=0).save_pretrained(str(dest))
    before = snapshot(dest) if existing else None
    model = routed_model(seed=2)

    _killed_save(model, dest, tmp_path)
    # Nothing half-written at the destination; the dead writer's folder stays behind.
    assert (snapshot(dest) if existing else dest.exists()) == (before or False)
    stale = [p for p in root.iterdir() if ".adadsf-tmp-" in p.name]
    assert len(stale) == 1 and (stale[0] / "model.safetensors").is_file()

    model.save_pretrained(str(dest))  # a later save removes it
    assert sorted(os.listdir(root)) == ["ckpt"]
    reloaded = adadsf_modifier.from_pretrained(dest)
    torch.testing.assert_close(logits_of(reloaded), logits_of(model), rtol=0, atol=0)


def test_save_keeps_the_temporary_folder_of_a_live_writer(tmp_path):
    """A concurrent writer's temporary folder (its process still runs) is kept."""
    from adadsf_modifier.atomic import _host_tag

    dest = tmp_path / "ckpt"
    writer = subprocess.Popen(["sleep", "60"])
    try:
        live = tmp_path / f".ckpt.adadsf-tmp-{_host_tag()}-{writer.pid}-0123abcd"
        live.mkdir()
        (live / "model.safetensors").write_bytes(b"in progress")
        routed_model().save_pretrained(str(dest))
        assert (live / "model.safetensors").read_bytes() == b"in progress"
    finally:
        writer.kill()
        writer.wait()
    routed_model().save_pretrained(str(dest))  # its owner is gone now: removed
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
