"""One loader for every checkpoint this package writes:
``adadsf_modifier.from_pretrained`` reloads FTP folders too, the evaluation code and the
CLI use it, and FTP saves go through AdaDSF's atomic save (temporary folder, sidecar
last, one rename)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import yaml
from test_causal_routing import left_padded
from test_checkpoint_save_load import leftovers, routed_model, snapshot
from test_ftp_routing import ftp_model
from tiny_models import save_tiny_model, tiny_model, tiny_tokenizer, token_dataset

import adadsf_modifier
import adadsf_modifier.ftp.checkpoint as ftp_checkpoint
from adadsf_modifier import AdaDSFCheckpointError, routed_layers
from adadsf_modifier.checkpoint import FTP_SIDECAR_NAME as FTP_SIDECAR
from adadsf_modifier.checkpoint import SIDECAR_NAME, install_save_hook
from adadsf_modifier.cli import main
from adadsf_modifier.evaluation.speed import load_pair
from adadsf_modifier.ftp import FTPLayerRouter

RIDGE_KV = dict(skip_path="ridge", skipped_tokens_kv=True)


def logits(model, mask: bool = True) -> torch.Tensor:
    ids, attention = left_padded(batch=2, length=12)
    kw = dict(attention_mask=attention) if mask else {}
    with torch.no_grad():
        return model.eval()(input_ids=ids, use_cache=False, **kw).logits


@pytest.fixture(scope="module")
def ftp_dir(tmp_path_factory):
    """A saved FTP checkpoint (with a tokenizer, for the CLI) and its in-memory
    model."""
    model, _ = ftp_model("llama")
    path = tmp_path_factory.mktemp("ftp") / "ckpt"
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path, model


@pytest.mark.parametrize("settings", [{}, RIDGE_KV], ids=["plain", "ridge_kv"])
def test_from_pretrained_reloads_an_ftp_folder_with_the_same_logits(tmp_path, settings):
    model, _ = ftp_model("llama", **settings)
    model.save_pretrained(str(tmp_path / "ckpt"))
    again = adadsf_modifier.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    layers = routed_layers(again)
    assert layers and all(isinstance(m.router, FTPLayerRouter) for m in layers)
    assert [m.skipped_tokens_kv for m in layers] == [
        m.skipped_tokens_kv for m in routed_layers(model)
    ]
    for mask in (False, True):
        torch.testing.assert_close(logits(again, mask), logits(model, mask), atol=0,
                                   rtol=0)  # fmt: skip


def test_load_pair_on_an_ftp_folder_gives_the_original_dense_twin(ftp_dir):
    path, model = ftp_dir
    dense, routed = load_pair(str(path))
    assert routed_layers(routed) and not routed_layers(dense)
    # no FTP context hook left behind to slow the dense twin down
    assert not any(m._forward_pre_hooks for m in dense.model.layers)
    original = tiny_model("llama")  # ftp_model routed this model (same seed)
    torch.testing.assert_close(logits(dense), logits(original), atol=0, rtol=0)
    torch.testing.assert_close(logits(routed), logits(model), atol=0, rtol=0)


def test_cli_eval_and_bench_run_on_an_ftp_folder(ftp_dir, tmp_path, capsys):
    path, _ = ftp_dir
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(path), "--no-ppl", "--ppl-tokens", "700",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["routed"] is True and record["routing_mode"] == "causal"
    assert record["label"] == "sparse" and record["normalized_flops"] < 1.0
    assert record["flops_tokens"] == 700  # the perplexity's tokens, rows of 512
    bench = tmp_path / "bench.json"
    argv = ["bench", "--routed", path, "--seq-lens", 16, "--batch-sizes", 1,
            "--repeats", 1, "--decode-tokens", 2, "--output", bench]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    results = json.loads(bench.read_text())["results"]
    assert {r["kind"] for r in results} == {"prefill", "decode"}
    assert all(r["normalized_flops"] < 1.0 for r in results)


def test_interrupted_ftp_save_leaves_the_previous_folder_intact(tmp_path, monkeypatch):
    import llmcompressor.transformers.compression.compressed_tensors_utils as ctu

    dest = tmp_path / "ckpt"
    first, _ = ftp_model("llama")
    first.save_pretrained(str(dest))
    before = snapshot(dest)
    second, _ = ftp_model("llama", schedule=(0.5, 0.5, 0.8, 0.6))

    def boom(*args, **kwargs):  # after the weights are written
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ctu, "update_and_save_recipe", boom)
    with pytest.raises(OSError, match="simulated"):
        second.save_pretrained(str(dest))
    assert snapshot(dest) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    again = adadsf_modifier.from_pretrained(dest, dtype=torch.float32)
    torch.testing.assert_close(logits(again), logits(first), atol=0, rtol=0)


def test_ftp_save_failing_at_the_sidecar_leaves_no_folder(tmp_path, monkeypatch):
    model, _ = ftp_model("llama")

    def boom(*args, **kwargs):
        raise OSError("disk full at the sidecar (simulated)")

    monkeypatch.setattr(ftp_checkpoint, "write_text_durably", boom)
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []  # no final folder, no temporary one


def test_ftp_save_refuses_a_router_tensor_missing_on_disk(tmp_path, monkeypatch):
    """The written router tensors are read back before the folder is published."""
    model, _ = ftp_model("llama")
    real = ftp_checkpoint.FTP.describe

    def expecting_one_more(m):
        record = real(m)
        record["tensors"]["model.layers.0.router.not_saved"] = [3]
        return record

    kind = dataclasses.replace(ftp_checkpoint.FTP, describe=expecting_one_more)
    monkeypatch.setattr(ftp_checkpoint, "FTP", kind)
    install_save_hook(model, kind)
    with pytest.raises(AdaDSFCheckpointError, match="router.not_saved` is missing"):
        model.save_pretrained(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []


def test_folder_without_a_sidecar_names_both_sidecars(tmp_path):
    plain = save_tiny_model("llama", str(tmp_path / "plain"), num_layers=2)
    with pytest.raises(AdaDSFCheckpointError) as err:
        adadsf_modifier.from_pretrained(plain)
    message = str(err.value)
    assert f"no AdaDSF data in {plain}" in message
    assert SIDECAR_NAME in message and FTP_SIDECAR in message


def test_saving_one_kind_over_the_other_leaves_one_sidecar(tmp_path):
    """A save replaces the whole folder: the other kind's sidecar must not be carried
    over (it would describe routers the new weights do not have)."""
    dest = tmp_path / "ckpt"
    ftp, _ = ftp_model("llama")
    ftp.save_pretrained(str(dest))
    (dest / "README.md").write_text("mine")  # other files are carried over
    adadsf = routed_model("llama")
    adadsf.save_pretrained(str(dest))
    assert not (dest / FTP_SIDECAR).exists() and (dest / SIDECAR_NAME).is_file()
    assert (dest / "README.md").read_text() == "mine"
    again = adadsf_modifier.from_pretrained(dest)
    torch.testing.assert_close(logits(again), logits(adadsf), atol=0, rtol=0)
    ftp.save_pretrained(str(dest))
    assert not (dest / SIDECAR_NAME).exists() and (dest / FTP_SIDECAR).is_file()
    assert leftovers(tmp_path) == []


def test_folder_with_both_sidecars_is_refused(ftp_dir, tmp_path):
    path, _ = ftp_dir
    both = tmp_path / "both"
    both.mkdir()
    for item in path.iterdir():
        (both / item.name).symlink_to(item)
    (both / SIDECAR_NAME).write_text("{}")
    with pytest.raises(AdaDSFCheckpointError, match="holds both"):
        adadsf_modifier.from_pretrained(both)
    assert main(["bench", "--routed", str(both)]) == 2


def test_ftp_save_through_the_source_rank_path(tmp_path):
    """Under a (1-rank) process group the save takes the multi-rank path: checks on
    every rank, the ranks' agreement on routers and sidecar, write on the source."""
    model, _ = ftp_model("llama")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1
    )
    try:
        model.save_pretrained(str(tmp_path / "ckpt"))
    finally:
        dist.destroy_process_group()
    again = adadsf_modifier.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)


def test_oneshot_recipe_yaml_round_trips_through_from_pretrained(tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe
    from test_ftp_modifier import load, small_recipe

    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=4)
    model = load(base)
    oneshot(model=model, recipe=small_recipe(), dataset=token_dataset(8, 16),
            num_calibration_samples=8, max_seq_length=16,
            output_dir=str(tmp_path / "out"))  # fmt: skip
    # re-saved in the oneshot's process: its session's recipe is not added again
    # (tests/test_recipe_resave.py)
    again = adadsf_modifier.from_pretrained(tmp_path / "out", dtype=torch.float32)
    again.save_pretrained(str(tmp_path / "resaved"))
    for folder in ("out", "resaved"):
        text = (tmp_path / folder / "recipe.yaml").read_text()
        assert "!!python" not in text and yaml.safe_load(text)
        recipe = Recipe.create_instance(str(tmp_path / folder / "recipe.yaml"))
        assert [type(m).__name__ for m in recipe.modifiers] == ["FTPModifier"]
    third = adadsf_modifier.from_pretrained(tmp_path / "resaved", dtype=torch.float32)
    torch.testing.assert_close(logits(third), logits(model), atol=0, rtol=0)


def test_a_left_padded_batch_gives_each_row_its_logits_alone(ftp_dir):
    """The router's position feature is absolute: without ``position_ids`` a padded
    row would count its padding. The reloaded model derives them from the mask, as
    ``generate()`` does, so rows of lengths 12, 3, 7 and 1 padded to one batch give
    what each gives alone."""
    path, _ = ftp_dir
    model = adadsf_modifier.from_pretrained(path, dtype=torch.float32).eval()
    lengths, width = (12, 3, 7, 1), 12
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(4, 60, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None]).logits[0]
            torch.testing.assert_close(
                batch[i, width - len(row) :], alone, atol=1e-4, rtol=0
            )
