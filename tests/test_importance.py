"""``importance: loss``: the measured loss rise of skipping each layer (and
``skip_path_loss``: of replacing it by its fitted skip path), and their use by the
allocation strategies."""

from __future__ import annotations

import copy

import pytest
import torch
from llmcompressor import oneshot
from pydantic import ValidationError
from tiny_models import save_tiny_model, tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifier)
from adadsf_modifier import AdaDSFModifier, importance
from adadsf_modifier.importance import (
    loss_importance,
    similarity_like,
    skip_path_loss_importance,
)


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


def ridge_reference(xs, ys, ridge):
    """Full-rank ridge of ``y - x`` on ``[x, 1]`` (unpenalised intercept), penalty
    ``ridge * mean input variance sum``, in float64: ``(W [h, h], b [h])``."""
    x = torch.cat(xs).double()
    u = torch.cat(ys).double() - x
    mx, mu = x.mean(0), u.mean(0)
    cxx = (x - mx).T @ (x - mx)
    lam = ridge * cxx.diagonal().mean()
    w = torch.linalg.solve(cxx + lam * torch.eye(x.shape[1], dtype=x.dtype),
                           (x - mx).T @ (u - mu))  # fmt: skip
    return w, mu - mx @ w


class AffineLayer(torch.nn.Module):
    """A decoder layer replaced by ``x + x W + b``."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w.float(), b.float()

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states + hidden_states @ self.w + self.b


def layer_io(model, layer, data):
    """The dense ``layer``'s inputs and outputs (real tokens: none are padding here)."""
    xs, ys = [], []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        y = output[0] if isinstance(output, tuple) else output
        xs.append(x.reshape(-1, x.shape[-1]))
        ys.append(y.reshape(-1, y.shape[-1]))

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for b in data:
            model(**b, use_cache=False)
    handle.remove()
    return xs, ys


def test_skip_path_loss_is_the_loss_with_the_layer_replaced_by_its_ridge_map():
    model = tiny_model("llama", num_layers=3, seed=5)
    data = batches(n=12, seq=16)
    measured, fit_on = data[:2], data[2:]  # 32 measured tokens, the rest to fit on
    rises = skip_path_loss_importance(
        model, list(model.model.layers), data, max_tokens=32, fit_tokens=10_000,
        ridge=0.01,
    )  # fmt: skip
    dense = mean_nll(model, measured)
    for i in range(3):
        w, b = ridge_reference(*layer_io(model, model.model.layers[i], fit_on), 0.01)
        cut = copy.deepcopy(model)
        cut.model.layers[i] = AffineLayer(w, b)
        assert dense + rises[i] == pytest.approx(mean_nll(cut, measured), abs=1e-4)
    # not the identity skip path's rises: the maps change the measure
    skipped = loss_importance(model, list(model.model.layers), measured, 10_000)
    assert min(abs(a - b) for a, b in zip(rises, skipped)) > 1e-4


def test_skip_path_loss_fits_on_the_batches_after_the_measured_ones_from_an_iterator():
    model = tiny_model("llama", num_layers=2, seed=5)
    data = batches(n=6, seq=16)
    kw = dict(max_tokens=32, fit_tokens=10_000, ridge=0.01)
    from_list = skip_path_loss_importance(model, list(model.model.layers), data, **kw)
    from_iter = skip_path_loss_importance(
        model, list(model.model.layers), iter(data), **kw
    )
    assert from_iter == pytest.approx(from_list, abs=1e-6)


def test_skip_path_loss_refuses_calibration_with_nothing_left_to_fit_on():
    model = tiny_model("llama", num_layers=2, seed=5)
    with pytest.raises(ValueError, match="importance_tokens"):
        skip_path_loss_importance(model, list(model.model.layers), batches(n=2), 32)


def test_skip_path_loss_needs_a_ridge_skip_path():
    with pytest.raises(ValidationError, match="skip_path 'ridge'"):
        AdaDSFModifier(importance="skip_path_loss")
    AdaDSFModifier(importance="skip_path_loss", skip_path="ridge")


def test_layer_drop_by_skip_path_loss_removes_the_layer_its_map_replaces_best(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=4, seed=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = token_dataset(12, 16)
    rows = [{k: torch.tensor([r[k]]) for k in ("input_ids", "attention_mask")}
            for r in data]  # fmt: skip
    rises = skip_path_loss_importance(
        model, list(model.model.layers), rows, 32, 10_000, ridge=0.01
    )
    mod = AdaDSFModifier(
        retention=0.75, allocation="layer_drop", importance="skip_path_loss",
        importance_tokens=32, skip_path="ridge", skip_path_ridge=0.01,
        skip_path_tokens="all", ignore=[],
    )  # fmt: skip
    # in order, so that the modifier measures and fits on the rows measured above
    oneshot(model=model, recipe=[mod], dataset=data, num_calibration_samples=12,
            max_seq_length=16, shuffle_calibration_samples=False)  # fmt: skip
    cheapest = min(range(4), key=rises.__getitem__)
    assert mod.retention_ratios == [0.0 if i == cheapest else 1.0 for i in range(4)]


def test_skip_path_loss_fitting_a_layer_per_forward_gives_the_same_maps(monkeypatch):
    model = tiny_model("llama", num_layers=3, seed=5)
    data = batches(n=8, seq=16)
    kw = dict(max_tokens=32, fit_tokens=10_000, ridge="auto", rank=8)
    together = skip_path_loss_importance(model, list(model.model.layers), data, **kw)
    monkeypatch.setattr(importance, "_STATS_BYTES", 1)  # one layer per forward
    apart = skip_path_loss_importance(model, list(model.model.layers), data, **kw)
    assert apart == pytest.approx(together, abs=1e-6)
