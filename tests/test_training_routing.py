"""Training with inference's decision rule (``align_routing: quantile`` for causal
routing, ``rank`` for rank routing): the batch threshold keeps the layer's ratio of the
batch's tokens by score, against hand-computed selections, and the alignment stage
trains under either rule and restores the mode after."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from test_alignment import config, routed_pair
from tiny_models import token_dataset

from adadsf_modifier import AdaDSFModifier, routed_layers
from adadsf_modifier.alignment import align_model


def routed_layer(ratio: float):
    student, _ = routed_pair()
    layer = next(m for m in routed_layers(student) if 0.0 < m.retention_ratio < 1.0)
    layer.retention_ratio = ratio
    return layer, student.config.hidden_size


def selection(layer, hidden: int, scores, mode: str, attention_mask=None):
    scores = torch.tensor(scores, dtype=torch.float32)
    x = torch.zeros(*scores.shape, hidden)
    return layer.selected_mask(x, attention_mask, mode=mode, scores=scores)


def test_quantile_keeps_the_batch_ratio_by_score_not_each_rows_share():
    layer, hidden = routed_layer(0.6)
    scores = [[0.0, 9.0, 8.0, 7.0, 6.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
    # 10 real tokens x 0.6 = 6 run: the two first tokens (forced) and the batch's four
    # best free scores, all in row 0
    expected = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(selection(layer, hidden, scores, "quantile"), expected)
    # top-k would keep 3 per row instead (first token + the row's 2 best)
    topk = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(selection(layer, hidden, scores, "topk"), topk)


def test_quantile_counts_only_real_tokens_and_the_first_real_one_runs():
    layer, hidden = routed_layer(0.5)
    scores = [[5.0, 0.1, 3.0, 0.2], [9.0, 9.0, 0.3, 4.0]]
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # row 1 left-padded
    # 6 real tokens x 0.5 = 3 run: the forced first real tokens (row 0 pos 0, row 1
    # pos 2) and the best free real score (4.0); the padded 9.0s never count
    expected = torch.tensor([[1, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(selection(layer, hidden, scores, "quantile", mask), expected)


def test_quantile_routing_needs_the_whole_batch_not_a_cache():
    from adadsf_modifier.routing import set_routing_mode

    student, _ = routed_pair()
    set_routing_mode(student, "quantile")
    ids = torch.randint(0, student.config.vocab_size, (1, 6))
    with torch.no_grad():
        out = student(ids, use_cache=True)
        with pytest.raises(RuntimeError, match="quantile routing .* whole batch"):
            student(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)


def test_alignment_trains_the_routers_under_inferences_rule_and_restores_the_mode():
    rule = "quantile"
    student, teacher = routed_pair()
    layers = routed_layers(student)
    seen: list[str] = []
    layer = next(m for m in layers if 0.0 < m.retention_ratio < 1.0)
    layer.register_forward_pre_hook(
        lambda m, a: seen.append(m.resolved_routing_mode()) if m.training else None
    )
    before = [p.detach().clone() for p in layer.router.parameters()]
    report = align_model(student, teacher, token_dataset(4, 16),
                         config(steps=3, routing=rule))  # fmt: skip
    assert seen == [rule] * 3
    assert all(math.isfinite(x) for x in report.losses)
    # the router learns through the kept tokens' gate under this rule too
    assert any(not torch.equal(b, p) for b, p in zip(before, layer.router.parameters()))
    assert {m.routing_mode for m in layers} == {"auto"}  # restored


def test_training_routing_field_reaches_the_config_and_is_checked():
    mod = AdaDSFModifier(align_steps=2, align_routing="quantile")
    assert mod.align_routing == "quantile"
    assert AdaDSFModifier().align_routing == "topk"  # the paper's rule by default
    for retired_or_wrong in ("causal", "rank"):
        with pytest.raises(ValidationError, match="align_routing must be one of"):
            AdaDSFModifier(align_routing=retired_or_wrong)
