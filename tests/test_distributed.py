"""The distributed helpers in one process: no-ops without a process group, correct on a
1-rank gloo group, and a 1-rank ``torchrun``-style run equal to a plain run.

The 2-process checks (ranks agree, equal a single process) are integration tests:
``integration_tests/test_distributed*.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from llmcompressor import oneshot
from llmcompressor.datasets.utils import LengthAwareSampler
from pydantic import ValidationError
from tiny_models import save_tiny_model, tiny_model, token_dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator

from adadsf_modifier import AdaDSFModifier, distributed, routed_layers
from adadsf_modifier.alignment import AlignmentConfig, check_alignment_supported
from adadsf_modifier.alignment.parallel import (
    _shell,
    check_parallel_supported,
    data_parallel,
)
from adadsf_modifier.fitting.calibration import SimilarityAccumulator


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo process group: every helper takes its distributed path."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def rows_of(batches) -> list[list[int]]:
    return [row for b in batches for row in torch.as_tensor(b["input_ids"]).tolist()]


# ------------------------------------------------------------------ one process
def test_helpers_are_no_ops_without_a_process_group():
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    values, t = [1.5, 2.0], torch.arange(3)
    assert distributed.sum_across_ranks(values) is values
    assert distributed.all_gather_variable(t) is t
    assert distributed.all_gather_object("x") == ["x"]
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    loader = DataLoader(token_dataset(2, 4))
    assert distributed.rank_batches(loader) is loader
    items = [torch.ones(2)]
    assert distributed.split_if_identical(items, lambda r: [r], "rows") is items
    assert not distributed.any_across_ranks(False)

    def fail():
        raise KeyError("the original error")

    with pytest.raises(KeyError, match="the original error"):
        distributed.agree_on_errors(fail)


def test_warm_start_sample_budget_is_shared_by_the_ranks(monkeypatch):
    assert SimilarityAccumulator(2, sample_tokens=5).sample_tokens == 5
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert SimilarityAccumulator(2, sample_tokens=5).sample_tokens == 3


def test_parallel_setting_is_validated_with_its_name():
    with pytest.raises(ValidationError, match=r"align_parallel must be one of"):
        AdaDSFModifier(align_parallel="zero3")
    with pytest.raises(ValidationError, match=r"align_parallel must be one of"):
        AlignmentConfig(align_parallel="tp")
    assert AdaDSFModifier(align_parallel="fsdp").align_parallel == "fsdp"


def test_data_parallel_hands_back_its_inputs_in_one_process():
    model = nn.Linear(2, 2)
    params = list(model.parameters())
    with data_parallel(model, None, params, "fsdp", torch.device("cpu")) as run:
        assert run.student is model and run.params == params
        assert run.token_share(torch.ones(2, 3)) is None
        assert run.global_values({"loss": 0.5}, None) == {"loss": 0.5}


def test_fsdp_shell_aliases_storage_and_leaks_no_state_into_the_model():
    model = tiny_model("llama", 2)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    shell, aliases = _shell(model)
    originals = dict(model.named_parameters(remove_duplicate=False))
    copies = dict(shell.named_parameters(remove_duplicate=False))
    assert originals.keys() == copies.keys()
    for name, p in originals.items():
        assert copies[name] is not p and copies[name].data_ptr() == p.data_ptr()
    assert shell.lm_head.weight is shell.model.embed_tokens.weight
    assert all(a is not b for a, b in zip(shell.modules(), model.modules()))
    layer = shell.model.layers[0]
    layer.register_forward_hook(lambda *a: None)
    layer.weight_extra = nn.Parameter(torch.zeros(1))
    assert not model.model.layers[0]._forward_hooks
    assert "weight_extra" not in dict(model.model.layers[0].named_parameters())
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(shell(ids).logits, model(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------ a 1-rank group
def test_rank_batches_reads_the_slice_the_sampler_was_built_for(one_rank):
    # llm-compressor 0.14 (_make_sampler) builds the sampler over this rank's slice
    # but the loader over the full dataset: the loader reads the first rows instead.
    full = token_dataset(8, 4)
    mine = full.select(range(4, 8))
    loader = DataLoader(
        full, sampler=LengthAwareSampler(mine), collate_fn=default_data_collator
    )
    assert sorted(rows_of(loader)) == sorted(full["input_ids"][:4])  # the bug
    batches = distributed.rank_batches(loader)
    assert isinstance(batches, distributed.RankPartition)
    assert sorted(rows_of(batches)) == sorted(mine["input_ids"])


def test_collectives_on_one_rank(one_rank):
    assert distributed.is_distributed() and distributed.is_source_process()
    assert distributed.sum_across_ranks([1, 2]) == [1, 2]
    assert distributed.sum_across_ranks([0.25]) == [0.25]
    empty = torch.zeros(0, 3)
    assert distributed.all_gather_variable(empty).shape == (0, 3)
    x = torch.randn(4, 3)
    assert torch.equal(distributed.all_gather_variable(x), x)
    with pytest.raises(ValueError, match="0 calibration batches for 1 ranks"):
        distributed.rank_batches([])
    distributed.check_same_model(tiny_model("llama", 2), {"retention": 0.5})


def test_fsdp_refuses_a_model_with_per_instance_forwards(one_rank):
    model = tiny_model("llama", 2)
    check_parallel_supported(model, "fsdp")
    model.model.norm.forward = model.model.norm.forward  # as offload wrappers do
    with pytest.raises(ValueError, match="align_parallel=fsdp: module `model.norm`"):
        check_parallel_supported(model, "fsdp")
    check_parallel_supported(model, "ddp")
    # the modifier checks it first thing, before any calibration
    config = AdaDSFModifier(align_steps=1, align_parallel="fsdp")
    with pytest.raises(ValueError, match="align_parallel=fsdp"):
        check_alignment_supported(model, config)


def run_adadsf(path: str, output_dir: str | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modifier = AdaDSFModifier(retention=0.7, align_steps=2, router_init_steps=10)
    oneshot(
        model=model,
        dataset=token_dataset(8, 16),
        num_calibration_samples=8,
        # the shuffling sampler draws differently once a process group exists
        shuffle_calibration_samples=False,
        recipe=[modifier],
        output_dir=output_dir,
    )
    routers = {
        n: p.detach().clone() for n, p in model.named_parameters() if "router" in n
    }
    thresholds = [m.causal_threshold for m in routed_layers(model)]
    return modifier, routers, thresholds


def test_one_rank_torchrun_run_equals_a_plain_run(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "tiny"))
    plain = run_adadsf(path)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1
    )
    try:
        ranked = run_adadsf(path, str(tmp_path / "ckpt"))
    finally:
        dist.destroy_process_group()
    assert ranked[0].similarities == plain[0].similarities
    assert ranked[0].retention_ratios == plain[0].retention_ratios
    assert ranked[0].alignment_report.losses == plain[0].alignment_report.losses
    assert ranked[1].keys() == plain[1].keys()
    for name, w in ranked[1].items():
        torch.testing.assert_close(w, plain[1][name], rtol=0, atol=0)
    assert ranked[2] == plain[2]
    assert (tmp_path / "ckpt" / "adadsf_config.json").is_file()
