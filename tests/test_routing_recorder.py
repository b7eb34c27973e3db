"""The routed layer as the one source of truth: its own records of what ran, one
keep-count rule, one spec entry per architecture, one MRO walk."""

import math

import pytest
import torch
from test_flops import padded_batch, route
from test_routing import route_all
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, OlmoConfig

from adadsf_modifier.flops import layer_shape, normalized_flops, planned_kept
from adadsf_modifier.routing import (
    SUPPORTED_ARCHITECTURES,
    ArchitectureSpec,
    RoutedLayer,
    RoutingRecorder,
    TokenRouter,
    decoder_layers,
    original_class,
    route_layer,
    routed_class_for,
    routed_layers,
    tokens_to_keep,
    unroute_layer,
)
from adadsf_modifier.routing.selection import keep_counts, tokens_to_keep_per_row

RATIOS = [None, 0.5, 1.0, 0.0]  # dense, routed, routed at ratio 1, removed


def test_routed_layers_record_path_kept_tokens_and_attended_pairs():
    model = route(tiny_model("llama"), RATIOS)
    batch = padded_batch()  # real lengths 6, 4, 9
    recorder = RoutingRecorder()
    layers = routed_layers(model)
    with recorder.attached(layers), torch.no_grad():
        model(**batch, use_cache=False)
    assert sorted(recorder.records) == [1, 2, 3]
    (gather,) = recorder.records[1]
    assert gather.path == "gather"
    assert gather.kept.tolist() == [3, 2, 4]  # floor(0.5 * n), first token included
    assert gather.attended.tolist() == [k * (k + 1) // 2 for k in (3, 2, 4)]
    (full,) = recorder.records[2]
    assert full.path == "full" and full.kept is None and full.attended is None
    (removed,) = recorder.records[3]
    assert removed.path == "removed" and removed.kept.tolist() == [0, 0, 0]
    # detached afterwards: the layers are back to not recording
    assert all("routing_recorder" not in m.__dict__ for m in layers)
    assert all(m.routing_recorder is None for m in layers)


def test_a_layer_records_nothing_without_a_recorder():
    model = route(tiny_model("llama"), RATIOS)
    recorder = RoutingRecorder()
    with torch.no_grad():
        model(**padded_batch(), use_cache=False)
    assert recorder.records == {}


def test_recorder_rejects_unknown_paths():
    with pytest.raises(ValueError, match="unknown routing path"):
        RoutingRecorder().record(0, "sideways")


@pytest.mark.parametrize(
    "r,n,k",
    [
        (0.8, 10, 8),
        (0.29, 100, 29),
        (0.5, 1, 1),
        (0.01, 5, 1),
        (1.0, 7, 7),
        (0.5, 0, 0),
        (0.0, 9, 0),
    ],
)
def test_keep_count_rule(r, n, k):
    assert tokens_to_keep(r, n) == k


def test_every_keep_count_caller_uses_the_same_rule():
    lengths = torch.arange(0, 40)
    for ratio in (0.0, 0.01, 0.1, 0.29, 1 / 3, 0.5, 0.73, 0.99, 1.0):
        rule = keep_counts(lengths, ratio).tolist()
        real = torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)
        assert tokens_to_keep_per_row(real, ratio).tolist() == rule
        assert [tokens_to_keep(ratio, int(n)) for n in lengths] == rule
        assert planned_kept([ratio], lengths.tolist())[0] == rule
        for k, n in zip(rule, lengths.tolist()):
            expected = max(1, math.floor(ratio * n + 1e-6)) if n and ratio else 0
            assert k == expected


def test_original_class_is_the_one_mro_walk():
    model = tiny_model("llama")
    layer = decoder_layers(model)[1][0][1]
    cls = type(layer)
    assert original_class(cls) is cls
    route_all(model, 0.5)
    assert original_class(type(layer)) is cls
    assert routed_class_for(type(layer)) is type(layer)
    unroute_layer(layer)
    assert type(layer) is cls and not isinstance(layer, RoutedLayer)


def test_a_new_architecture_is_one_spec_entry(monkeypatch):
    """OLMo (the first) is not supported out of the box; one ArchitectureSpec makes
    routing and the FLOPs model work."""
    cfg = OlmoConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="model_type 'olmo'"):
        layer_shape(cfg)
    monkeypatch.setitem(
        SUPPORTED_ARCHITECTURES,
        "olmo",
        ArchitectureSpec("olmo", "model.layers", "OlmoDecoderLayer", "past_key_values"),
    )
    shape = layer_shape(cfg)
    assert (shape.kv_dim, shape.mlp_matmuls) == (16, 3)
    spec, layers = decoder_layers(model)
    for i, (_, layer) in enumerate(layers):
        route_layer(layer, TokenRouter(32, 4), 0.5, i, spec.cache_kwarg, cfg)
    rep = normalized_flops(model, padded_batch())
    assert rep.kept[0] == (3, 2, 4) and 0 < rep.normalized < 1


def test_router_flops_come_from_the_router():
    router = TokenRouter(32, 8)
    assert router.flops(5) == 2 * 5 * (32 * 8 + 8) == TokenRouter.flops_for(5, 32, 8)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        vocab_size=10,
    )
    assert layer_shape(cfg).router_flops(5, 8) == router.flops(5)
