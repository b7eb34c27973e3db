"""FLOPs of sub-layer routing (``route_target``): what the FLOPs model counts is what
runs, checked against torch's own FlopCounterMode."""

import pytest
import torch
from test_causal_routing import left_padded
from test_route_target import calibrated, route_target_model
from test_skip_path_flops import counted_and_modelled
from tiny_models import tiny_model

from adadsf_modifier.flops import count_flops, layer_shape, normalized_flops
from adadsf_modifier.routing import decoder_layers, routed_layers

RATIOS = [1.0, 0.5, 0.0, 0.6, 0.7]


@pytest.mark.parametrize("target,kv", [("attention", False), ("attention", True),
                                       ("mlp", False)])  # fmt: skip
def test_counted_flops_equal_flop_counter_mode_layer_by_layer(target, kv):
    """Every matmul of a decoder layer (projections, MLP, router, skipped tokens'
    keys/values) is counted and nothing else; the attention term is compared apart
    (FlopCounterMode counts eager attention over the full query x key rectangle, the
    model over the causally allowed pairs), against pairs found from the router's
    choice."""
    model = route_target_model("llama", target, RATIOS, kv=kv, attn="eager").train()
    n = 20
    ids, counts, report, selected = counted_and_modelled(model, n)
    shape = layer_shape(model.config)
    _, layers = decoder_layers(model)
    mlp_per_token = shape.mlp_flops(1)
    proj_per_token = shape.projection_flops(1)
    for i, (name, _) in enumerate(layers):
        measured = sum(counts.get(f"{type(model).__name__}.{name}", {}).values())
        ours = report.routed_per_layer[i]
        k = report.kept[i][0]
        if target == "mlp":
            queries, keys = n, n
            assert ours.projections == n * proj_per_token
            assert ours.mlp == k * mlp_per_token
        else:
            queries, keys = k, (n if (kv or k == n) else k)
            assert ours.projections == k * proj_per_token
            assert ours.mlp == n * mlp_per_token  # every token runs the MLP
        rectangle = shape.attention_flops(queries * keys)
        assert measured == ours.total - ours.attention + rectangle, name
        if i in selected:
            pos = selected[i].nonzero().flatten()
            if target == "mlp":
                pairs = n * (n + 1) // 2
            else:
                pairs = int((pos + 1).sum()) if kv else k * (k + 1) // 2
            assert ours.attention == shape.attention_flops(pairs)
            assert ours.kv_only == (shape.kv_only_flops(n - k) if kv else 0)
            assert 0 < k < n
    removed = report.routed_per_layer[2]  # ratio 0: only the other sub-block runs
    if target == "attention":
        assert (removed.projections, removed.mlp) == (0, n * mlp_per_token)
    else:
        assert (removed.projections, removed.mlp) == (n * proj_per_token, 0)
    assert removed.router == 0


@pytest.mark.parametrize("target", ["attention", "mlp"])
def test_cached_decoding_step_counts_the_sub_block_that_ran(target):
    """One decoding step with padding: every row runs the unrouted sub-block; the
    routed one only for the rows that pass the threshold."""
    model = calibrated(route_target_model("llama", target, [1.0, 0.5]))
    layer = routed_layers(model)[1]
    ids, mask = left_padded(2, 9)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids[:, :8], attention_mask=mask[:, :8],
                    position_ids=pos[:, :8], use_cache=True)  # fmt: skip
        step = {"input_ids": ids[:, 8:], "attention_mask": mask,
                "position_ids": pos[:, 8:], "past_key_values": out.past_key_values,
                "use_cache": True}  # fmt: skip
        layer.causal_threshold = float("inf")  # no row runs the routed sub-block
        report = normalized_flops(model, step)
    shape = layer_shape(model)
    ours = report.routed_per_layer[1]
    assert report.kept[1] == (0, 0)
    if target == "attention":
        assert (ours.projections, ours.attention) == (0, 0)
        assert ours.mlp == shape.mlp_flops(2)
    else:
        assert ours.mlp == 0
        assert ours.projections == shape.projection_flops(2)
        assert ours.attention == report.dense_per_layer[1].attention > 0


def test_count_flops_route_targets_by_arithmetic():
    cfg = tiny_model("llama", 2).config
    shape = layer_shape(cfg)
    base = dict(kept=[[8], [4]], seq_lens=[8], routed_layers=[1])
    layer = count_flops(cfg, **base).routed_per_layer[1]
    attn = count_flops(cfg, **base, route_targets={1: "attention"}).routed_per_layer[1]
    mlp = count_flops(cfg, **base, route_targets={1: "mlp"}).routed_per_layer[1]
    assert (attn.projections, attn.attention) == (layer.projections, layer.attention)
    assert attn.mlp == shape.mlp_flops(8) and layer.mlp == shape.mlp_flops(4)
    assert mlp.mlp == layer.mlp and mlp.projections == shape.projection_flops(8)
    assert mlp.attention == shape.attention_flops(8 * 9 // 2)
    assert attn.router == mlp.router == layer.router > 0
    with pytest.raises(ValueError, match="unknown targets"):
        count_flops(cfg, **base, route_targets={1: "attn"})
