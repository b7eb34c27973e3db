"""``importance: loss``: the measured loss rise of skipping each layer, and its use by
the allocation strategies."""

from __future__ import annotations

import copy

import pytest
import torch
from llmcompressor import oneshot
from pydantic import ValidationError
from tiny_models import save_tiny_model, tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifier)
from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.importance import loss_importance, similarity_like


def batches(n=4, seq=16, seed=0):
    rows = token_dataset(n, seq, seed)
    return [
        {
            "input_ids": torch.tensor([r["input_ids"]]),
            "attention_mask": torch.tensor([r["attention_mask"]]),
        }
        for r in rows
    ]


def mean_nll(model, data):
    total = count = 0.0
    with torch.no_grad():
        for b in data:
            out = model(**b, labels=b["input_ids"], use_cache=False)
            n = b["input_ids"].shape[1] - 1
            total, count = total + float(out.loss) * n, count + n
    return total / count


def test_loss_rise_equals_the_loss_of_the_model_without_that_layer():
    model = tiny_model("llama", num_layers=4, seed=3)
    data = batches()
    rises = loss_importance(model, list(model.model.layers), data, max_tokens=10_000)
    dense = mean_nll(model, data)
    for i in range(4):  # reference: the layer really removed from the stack
        cut = copy.deepcopy(model)
        cut.model.layers = torch.nn.ModuleList(
            [m for j, m in enumerate(cut.model.layers) if j != i]
        )
        assert dense + rises[i] == pytest.approx(mean_nll(cut, data), abs=1e-4)
    assert len(set(round(r, 6) for r in rises)) == 4  # the layers differ


def test_a_layer_that_changes_nothing_costs_nothing_to_skip():
    model = tiny_model("llama", num_layers=4, seed=3)
    with torch.no_grad():  # layer 2's residual branches write zeros: identity
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    rises = loss_importance(model, list(model.model.layers), batches(), 10_000)
    assert rises[2] == pytest.approx(0.0, abs=1e-6)
    assert min(abs(r) for i, r in enumerate(rises) if i != 2) > 1e-4


def test_max_tokens_limits_the_measured_batches():
    model = tiny_model("llama", num_layers=2, seed=3)
    data = batches(n=4, seq=16)
    few = loss_importance(model, list(model.model.layers), data, max_tokens=16)
    one = loss_importance(model, list(model.model.layers), data[:1], 10_000)
    assert few == pytest.approx(one)


def test_similarity_like_maps_the_cheapest_layer_to_one():
    assert similarity_like([0.8, 0.0, 1.0, -0.2]) == pytest.approx(
        [0.2 / 1.2, 1 / 1.2, 0.0, 1.0]
    )
    assert similarity_like([0.0, 0.0]) == [1.0, 1.0]
    assert similarity_like([float("inf"), 1.0]) == [0.0, 1.0]
    assert similarity_like([float("nan"), 1.0, 3.0]) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("seed", [3, 4])
def test_layer_drop_by_loss_removes_the_layer_whose_removal_costs_least(tmp_path, seed):
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=4, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = token_dataset(8, 16)
    rows = [{k: torch.tensor([r[k]]) for k in ("input_ids", "attention_mask")}
            for r in data]  # fmt: skip
    rises = loss_importance(model, list(model.model.layers), rows, 10_000)
    mod = AdaDSFModifier(
        retention=0.75,
        allocation="layer_drop",
        importance="loss",
        importance_tokens=10_000,
        ignore=[],
    )
    oneshot(model=model, recipe=[mod], dataset=data, num_calibration_samples=8,
            max_seq_length=16)  # fmt: skip
    cheapest = min(range(4), key=rises.__getitem__)
    assert mod.retention_ratios == [0.0 if i == cheapest else 1.0 for i in range(4)]


def test_unknown_importance_is_refused():
    with pytest.raises(ValidationError, match="importance"):
        AdaDSFModifier(importance="gradient")
    with pytest.raises(ValidationError, match="importance_tokens"):
        AdaDSFModifier(importance_tokens=0)
