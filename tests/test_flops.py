"""The FLOPs model against hand counts, and the observed kept counts against the routing
rule."""

import copy
import math

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_model
from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

from adadsf_modifier.flops import (
    causal_key_count,
    count_flops,
    layer_shape,
    normalized_flops,
    observe_kept_tokens,
    observe_routing,
    planned_kept,
)
from adadsf_modifier.routing import (
    RoutedLayer,
    TokenRouter,
    decoder_layers,
    route_layer,
)


def tiny_llama_config():
    # h = 8, I = 16, 2 query heads, 1 kv head, head_dim = 8 / 2 = 4, 2 layers, V = 10
    return LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        vocab_size=10,
    )


# --------------------------------------------------------------------------------------
# Hand counts (written out term by term, independent of the implementation)
# --------------------------------------------------------------------------------------

# One llama layer, per token:
#   q_proj 8 -> 8  : 2 * 8 * 8 = 128
#   k_proj 8 -> 4  : 2 * 8 * 4 =  64   (1 kv head * head_dim 4)
#   v_proj 8 -> 4  : 2 * 8 * 4 =  64
#   o_proj 8 -> 8  : 2 * 8 * 8 = 128
#   projections per token = 384
#   gate 8 -> 16 : 256, up 8 -> 16 : 256, down 16 -> 8 : 256  -> MLP per token = 768
# Attention per (query, key) pair: 2 heads * (QK^T 2*4 + AV 2*4) = 32
LLAMA_PROJ_PER_TOKEN = 128 + 64 + 64 + 128
LLAMA_MLP_PER_TOKEN = 256 + 256 + 256
LLAMA_ATTN_PER_PAIR = 2 * (2 * 4 + 2 * 4)


def test_llama_dense_hand_count():
    cfg = tiny_llama_config()
    rep = count_flops(cfg, kept=[[3], [3]], seq_lens=[3])
    # 3 tokens, causal prefill: pairs = 1 + 2 + 3 = 6
    per_layer = 3 * 384 + 6 * 32 + 3 * 768
    assert per_layer == 1152 + 192 + 2304 == 3648
    assert rep.dense_per_layer[0].projections == 3 * LLAMA_PROJ_PER_TOKEN == 1152
    assert rep.dense_per_layer[0].attention == 6 * LLAMA_ATTN_PER_PAIR == 192
    assert rep.dense_per_layer[0].mlp == 3 * LLAMA_MLP_PER_TOKEN == 2304
    assert rep.dense == 2 * 3648 == 7296
    assert rep.routed == rep.dense
    assert rep.router == 0
    assert rep.normalized == 1.0
    # lm_head: 3 tokens * 2 * 8 * 10
    assert rep.lm_head == 480
    assert rep.dense_with_lm_head == 7296 + 480
    assert rep.normalized_with_lm_head == 1.0
    assert rep.memory_traffic_bytes == 0


def test_llama_routed_hand_count_two_sequences():
    cfg = tiny_llama_config()
    # two sequences of 3 and 2 real tokens; layer 0 dense, layer 1 routed (router hidden
    # 4) keeping 2 of 3 and 1 of 2
    rep = count_flops(
        cfg,
        kept=[[3, 2], [2, 1]],
        seq_lens=[3, 2],
        routed_layers={1},
        router_hidden_size=4,
        dtype_bytes=4,
    )
    # dense, per layer: 5 tokens, pairs (1+2+3) + (1+2) = 9
    dense_layer = 5 * 384 + 9 * 32 + 5 * 768
    assert dense_layer == 1920 + 288 + 3840 == 6048
    assert rep.dense == 2 * 6048 == 12096
    # routed layer 1: 3 kept tokens, pairs (1+2) + (1) = 4; router on all 5 real tokens:
    # 5 * 2 * (8*4 + 4*1) = 360
    routed_l1 = 3 * 384 + 4 * 32 + 3 * 768 + 360
    assert routed_l1 == 1152 + 128 + 2304 + 360 == 3944
    assert rep.routed_per_layer[0].total == 6048
    assert rep.routed_per_layer[1].total == 3944
    assert rep.routed_per_layer[1].router == 360 == rep.router
    assert rep.routed == 6048 + 3944 == 9992
    assert rep.normalized == pytest.approx(9992 / 12096)
    # lm_head: 5 tokens * 2 * 8 * 10 = 800, same on both sides
    assert rep.lm_head == 800
    assert rep.normalized_with_lm_head == pytest.approx((9992 + 800) / (12096 + 800))
    # memory traffic of layer 1 (4-byte elements): gather 3*8 + scatter 3*8 + copy 5*8
    # elements
    assert rep.memory_traffic_per_layer == (0, (24 + 24 + 40) * 4)
    assert rep.memory_traffic_bytes == 352
    d = rep.as_dict()
    assert d["routed_flops"] == 9992 and d["dense_flops"] == 12096


def test_gpt_neox_hand_count():
    # h = 8, I = 32, 2 heads, head_dim 4, full MHA, 1 layer, V = 10
    cfg = GPTNeoXConfig(
        hidden_size=8,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
        vocab_size=10,
    )
    # per token: fused qkv 8 -> 24: 2*8*24 = 384; dense 8 -> 8: 128  => 512
    #            MLP h_to_4h 8 -> 32: 512; 4h_to_h 32 -> 8: 512  => 1024
    # per pair: 2 heads * (8 + 8) = 32; 3 tokens: 6 pairs
    dense = 3 * (384 + 128) + 6 * 32 + 3 * (512 + 512)
    assert dense == 1536 + 192 + 3072 == 4800
    rep = count_flops(cfg, kept=[[3]], seq_lens=[3])
    assert rep.dense == rep.routed == 4800
    assert rep.dense_per_layer[0].projections == 1536
    assert rep.dense_per_layer[0].mlp == 3072
    # routed: keep 2, router hidden 2: router on 3 tokens: 3 * 2 * (8*2 + 2) = 108
    rep = count_flops(
        cfg, kept=[[2]], seq_lens=[3], routed_layers={0}, router_hidden_size=2
    )
    assert rep.routed == 2 * 512 + 3 * 32 + 2 * 1024 + 108 == 3276
    assert rep.normalized == pytest.approx(3276 / 4800)


def test_decode_with_cache_and_sliding_window_hand_count():
    cfg = tiny_llama_config()
    # one new token after 3 cached ones: it attends to 4 keys
    rep = count_flops(cfg, kept=[[1], [1]], seq_lens=[1], past_lens=[3])
    assert rep.dense_per_layer[0].attention == 4 * 32
    assert rep.dense_per_layer[0].projections == 384
    # mistral, sliding window 2: keys per query 1, 2, 2 -> 5 pairs
    mcfg = MistralConfig(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=10,
        sliding_window=2,
    )
    rep = count_flops(mcfg, kept=[[3]], seq_lens=[3])
    assert rep.dense_per_layer[0].attention == 5 * 32
    # qwen2 without use_sliding_window ignores its sliding_window value
    qcfg = Qwen2Config(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=10,
        sliding_window=2,
        use_sliding_window=False,
    )
    assert count_flops(qcfg, [[3]], [3]).dense_per_layer[0].attention == 6 * 32


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 9])
def test_causal_key_count_matches_brute_force(window):
    for n in range(0, 8):
        for past in range(0, 6):
            brute = sum(min(past + i, window or 10**9) for i in range(1, n + 1))
            assert causal_key_count(n, past, window) == brute, (n, past, window)


def test_shapes_from_configs():
    s = layer_shape(tiny_llama_config())
    assert (s.q_dim, s.kv_dim, s.mlp_matmuls) == (8, 4, 3)
    s = layer_shape(
        GPTNeoXConfig(
            hidden_size=8,
            intermediate_size=32,
            num_attention_heads=2,
            num_hidden_layers=1,
            vocab_size=10,
        )
    )
    assert (s.q_dim, s.kv_dim, s.mlp_matmuls) == (8, 8, 2)
    with pytest.raises(ValueError, match="model_type"):
        layer_shape(type("C", (), {"model_type": "bert"})())


def test_input_validation():
    cfg = tiny_llama_config()
    with pytest.raises(ValueError, match="layers"):
        count_flops(cfg, kept=[[3]], seq_lens=[3])
    with pytest.raises(ValueError, match="within"):
        count_flops(cfg, kept=[[4], [3]], seq_lens=[3])
    with pytest.raises(ValueError, match="out of range"):
        count_flops(cfg, kept=[[3], [3]], seq_lens=[3], routed_layers={2})


def test_normalized_is_one_when_everything_is_kept_and_no_router():
    cfg = tiny_llama_config()
    rep = count_flops(
        cfg, kept=torch.tensor([[5, 2], [5, 2]]), seq_lens=torch.tensor([5, 2])
    )
    assert rep.normalized == 1.0 and rep.normalized_with_lm_head == 1.0
    # with routers at ratio 1 the only difference is the router overhead
    rep = count_flops(
        cfg,
        kept=[[5, 2], [5, 2]],
        seq_lens=[5, 2],
        routed_layers={0, 1},
        router_hidden_size=4,
    )
    assert rep.routed - rep.dense == rep.router == 2 * 7 * 2 * (8 * 4 + 4)
    assert rep.memory_traffic_bytes == 0


# --------------------------------------------------------------------------------------
# Observed kept counts on real (tiny) routed models
# --------------------------------------------------------------------------------------

RATIOS = [None, 0.5, 0.75, 0.0]  # layer 0 stays dense, layer 3 is removed


def route(model, ratios, router_hidden=8, seed=0):
    spec, layers = decoder_layers(model)
    torch.manual_seed(seed)
    for i, (_, layer) in enumerate(layers):
        if ratios[i] is None:
            continue
        route_layer(
            layer,
            TokenRouter(model.config.hidden_size, router_hidden),
            ratios[i],
            i,
            spec.cache_kwarg,
            model.config,
        )
    return model


def padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (3, 9), generator=g)
    mask = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 1, 1, 1],  # left padded: 6 real tokens
            [0, 0, 0, 0, 0, 1, 1, 1, 1],  # left padded: 4 real tokens
            [1, 1, 1, 1, 1, 1, 1, 1, 1],  # 9 real tokens
        ]
    )
    return {"input_ids": ids, "attention_mask": mask}


def expected_kept(ratio, n):
    if ratio is None:  # dense layer
        return n
    if ratio == 0.0:
        return 0
    return max(1, math.floor(ratio * n))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_observed_kept_counts_follow_the_rule_with_left_padding(arch):
    model = route(tiny_model(arch), RATIOS)
    batch = padded_batch()
    kept = observe_kept_tokens(model, batch)
    lens = [6, 4, 9]
    assert kept == [[expected_kept(r, n) for n in lens] for r in RATIOS]
    # spelled out: floor(0.5 * [6, 4, 9]) = [3, 2, 4]; floor(0.75 * [6, 4, 9]) = [4, 3,
    # 6]
    assert kept[1] == [3, 2, 4] and kept[2] == [4, 3, 6]
    # no padding, input_ids tensor only
    ids = batch["input_ids"]
    assert observe_kept_tokens(model, ids) == [
        [expected_kept(r, 9)] * 3 for r in RATIOS
    ]
    # the hooks are gone
    for _, layer in decoder_layers(model)[1]:
        assert not layer._forward_pre_hooks


def tokens_that_changed(model, inputs, real):
    """Per layer, per sequence: real tokens whose hidden state the layer changed
    (forward hooks)."""
    changed = {}

    def make(i):
        def hook(module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            changed[i] = ((y != x).any(-1) & real).sum(1).tolist()

        return hook

    layers = decoder_layers(model)[1]
    handles = [
        layer.register_forward_hook(make(i), with_kwargs=True)
        for i, (_, layer) in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return [changed[i] for i in range(len(layers))]


def test_observed_kept_counts_match_the_tokens_that_changed():
    """Independent check: with random weights, a token that ran a layer changes its
    hidden state."""
    model = route(tiny_model("llama"), RATIOS)
    batch = padded_batch()
    real = batch["attention_mask"].bool()
    changed = tokens_that_changed(model, dict(batch, use_cache=False), real)
    assert observe_kept_tokens(model, batch) == changed


def test_observe_routing_and_normalized_flops_on_a_routed_model():
    model = route(tiny_model("llama"), RATIOS)
    batch = padded_batch()
    obs = observe_routing(model, batch)
    lens = [6, 4, 9]
    assert obs.seq_lens == lens
    assert obs.routed_layers == {1, 2}  # the removed layer's router never runs
    assert obs.gather_layers == {1, 2}
    assert obs.router_hidden_sizes == {1: 8, 2: 8, 3: 8}
    # causal attention among the kept tokens: k (k + 1) / 2 pairs per sequence
    assert obs.attended_keys == [[k * (k + 1) // 2 for k in row] for row in obs.kept]
    assert obs.dense_keys == [[n * (n + 1) // 2 for n in lens]] * 4
    rep = normalized_flops(model, batch)
    ref = count_flops(
        model.config,
        planned_kept([1.0, 0.5, 0.75, 0.0], lens),
        lens,
        routed_layers={1, 2},
        router_hidden_size=8,
        dtype_bytes=4,
    )
    assert rep.as_dict() == ref.as_dict()
    assert 0 < rep.normalized < 1


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dense_model_and_ratio_one_routing(arch):
    dense = tiny_model(arch)
    batch = padded_batch()
    rep = normalized_flops(dense, batch)
    assert rep.normalized == 1.0 and rep.router == 0 and rep.memory_traffic_bytes == 0
    routed = route(copy.deepcopy(dense), [1.0] * 4)
    rep1 = normalized_flops(routed, batch)
    # At inference a ratio-1 layer runs unchanged and never evaluates its router
    # (only its gradient matters), so no router cost is counted.
    assert rep1.dense == rep.dense
    assert rep1.router == 0 and rep1.routed == rep.dense
    assert rep1.memory_traffic_bytes == 0


def test_layer_removal_costs_exactly_the_kept_layers():
    # ShortGPT-style allocation: half the layers removed, the rest at ratio 1. The
    # measured FLOPs must be exactly half the decoder stack (no router cost).
    dense = tiny_model("llama")
    batch = padded_batch()
    rep = normalized_flops(route(copy.deepcopy(dense), [1.0, 0.0, 1.0, 0.0]), batch)
    assert rep.router == 0
    assert rep.normalized == pytest.approx(0.5, abs=1e-12)


def test_observed_keys_under_a_sliding_window():
    cfg_model = tiny_model("mistral")
    cfg_model.config.sliding_window = 3
    model = route(cfg_model, RATIOS)
    batch = padded_batch()
    obs = observe_routing(model, batch)
    lens = [6, 4, 9]
    assert obs.dense_keys[0] == [causal_key_count(n, 0, 3) for n in lens]
    # kept tokens keep their positions: within the window at most min(i, 3) keys each
    for li in (1, 2):
        for b, k in enumerate(obs.kept[li]):
            assert k <= obs.attended_keys[li][b] <= causal_key_count(k, 0, 3)


def set_median_thresholds(model, batch):
    """Causal routing with each threshold at the median real-token score of this
    batch."""
    from adadsf_modifier.routing import routed_layers

    layers = [li for li in routed_layers(model) if 0 < li.retention_ratio < 1]
    scores = {}
    handles = [
        li.router.register_forward_hook(
            lambda m, a, out, i=li.layer_index: scores.__setitem__(i, out)
        )
        for li in layers
    ]
    with torch.no_grad():
        model(**batch, use_cache=False)
    for h in handles:
        h.remove()
    real = batch["attention_mask"].bool()
    for li in layers:
        li.causal_threshold = float(scores[li.layer_index][real].median())
        li.routing_mode = "causal"


@pytest.mark.skipif(
    not hasattr(RoutedLayer, "resolved_routing_mode"),
    reason="this checkout's routed layers have no causal mode",
)
def test_observed_counts_in_causal_mode_with_kv_cache_decoding():
    from transformers import DynamicCache

    model = route(tiny_model("llama"), RATIOS)
    batch = padded_batch()
    set_median_thresholds(model, batch)
    real = batch["attention_mask"].bool()

    # prefill: kept counts are data-dependent; check them against the tokens that
    # changed
    expect = tokens_that_changed(model, dict(batch, use_cache=False), real)
    cache = DynamicCache(config=model.config)
    obs = observe_routing(model, dict(batch, past_key_values=cache, use_cache=True))
    assert obs.kept == expect
    assert obs.routed_layers == {1, 2}
    assert obs.attended_keys[0] == obs.dense_keys[0] == [21, 10, 45]
    for li in (1, 2):  # causal among the kept tokens
        assert obs.attended_keys[li] == [k * (k + 1) // 2 for k in obs.kept[li]]
    prefill_kept = obs.kept

    # one decoding step: the new token sees the cached tokens that ran the layer, plus
    # itself
    step_ids = torch.randint(4, 128, (3, 1), generator=torch.Generator().manual_seed(1))
    step_mask = torch.cat(
        [batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], 1
    )
    step = dict(
        input_ids=step_ids,
        attention_mask=step_mask,
        past_key_values=cache,
        use_cache=True,
    )
    cache_before_step = copy.deepcopy(cache)
    obs = observe_routing(model, step)
    assert obs.seq_lens == [1, 1, 1]
    assert obs.dense_keys == [[7, 5, 10]] * 4  # past real tokens + 1
    for li in (1, 2):
        assert obs.attended_keys[li] == [
            k * (p + 1) for k, p in zip(obs.kept[li], prefill_kept[li])
        ]
    rep = normalized_flops(model, dict(step, past_key_values=cache_before_step))
    assert rep.kept == tuple(tuple(k) for k in obs.kept)
    assert rep.dense_per_layer[0].attention == layer_shape(
        model.config
    ).attention_flops(7 + 5 + 10)
    # the formula with the routed caches' sizes agrees with the observed pairs
    ref = count_flops(
        model.config,
        obs.kept,
        [1, 1, 1],
        routed_layers={1, 2},
        router_hidden_size=8,
        past_lens=[6, 4, 9],
        routed_past_lens=[[6, 4, 9], prefill_kept[1], prefill_kept[2], [0, 0, 0]],
    )
    assert [x.attention for x in ref.routed_per_layer] == [
        layer_shape(model.config).attention_flops(sum(k)) for k in obs.attended_keys
    ]


@pytest.mark.skipif(
    not hasattr(RoutedLayer, "resolved_routing_mode"),
    reason="this checkout's routed layers have no causal mode",
)
def test_observed_counts_when_decoding_one_sequence_token_by_token():
    from transformers import DynamicCache

    model = route(tiny_model("llama"), RATIOS)
    batch = padded_batch()
    set_median_thresholds(model, batch)
    ids = batch["input_ids"][2:3]  # one unpadded sequence of 9 tokens
    cache = DynamicCache(config=model.config)
    prefill = observe_routing(
        model, dict(input_ids=ids[:, :5], past_key_values=cache, use_cache=True)
    )
    cached = [row[0] for row in prefill.kept]  # tokens each layer holds in its cache
    for t in range(5, 9):
        step = observe_routing(
            model,
            dict(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True),
        )
        assert step.seq_lens == [1]
        assert step.dense_keys == [[t + 1]] * 4
        assert (
            step.gather_layers == frozenset()
        )  # the batch-1 fast path runs the layer in place
        for li in (1, 2):
            k = step.kept[li][0]
            assert k in (0, 1)
            assert step.attended_keys[li] == [k * (cached[li] + 1)]
            cached[li] += k
    # the same token-by-token decisions as one causal forward over the whole sequence
    full = observe_routing(model, dict(input_ids=ids[:, :9]))
    assert [full.kept[li][0] for li in (1, 2)] == [cached[1], cached[2]]
    assert full.kept[0] == [9] and full.kept[3] == [0]


# --------------------------------------------------------------------------------------
# Several batches, one report: FlopsReport.combine and stream_flops
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_reports_of_several_batches_combine_to_the_report_of_one_batch(mode):
    from adadsf_modifier.flops import FlopsReport
    from adadsf_modifier.routing import routing_mode

    model = route(tiny_model("llama"), RATIOS).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 128, (5, 12), generator=g)
    set_median_thresholds(model, {"input_ids": ids, "attention_mask": ids > -1})
    with routing_mode(model, mode):
        whole = normalized_flops(model, ids)
        parts = [normalized_flops(model, ids[:2]), normalized_flops(model, ids[2:])]
    combined = FlopsReport.combine(parts).as_dict()
    one = whole.as_dict()
    # gather traffic depends on how rows are padded together: the only batch-level term
    for key in ("memory_traffic_bytes", "memory_traffic_per_layer"):
        combined.pop(key), one.pop(key)
    assert combined == one
    # a ratio of sums, not a mean of the batches' ratios
    assert FlopsReport.combine(parts).normalized == pytest.approx(whole.normalized)


def test_combine_refuses_nothing_and_reports_of_different_models():
    from adadsf_modifier.flops import FlopsReport

    with pytest.raises(ValueError, match="at least one"):
        FlopsReport.combine([])
    a = normalized_flops(route(tiny_model("llama"), RATIOS), torch.ones(1, 4).long())
    b = normalized_flops(tiny_model("gpt_neox"), torch.ones(1, 4).long())
    with pytest.raises(ValueError, match="one model"):
        FlopsReport.combine([a, b])


def test_stream_flops_counts_every_token_of_the_stream_in_rows():
    from adadsf_modifier.flops import FlopsReport, stream_flops

    model = route(tiny_model("llama"), RATIOS).eval()
    ids = torch.randint(4, 128, (37,), generator=torch.Generator().manual_seed(5))
    rep = stream_flops(model, ids, seq_len=8, batch_size=2)
    assert sum(rep.seq_lens) == 37 and list(rep.seq_lens) == [8, 8, 8, 8, 5]
    ref = FlopsReport.combine(
        [
            normalized_flops(model, ids[:16].view(2, 8)),
            normalized_flops(model, ids[16:32].view(2, 8)),
            normalized_flops(model, ids[32:][None]),
        ]
    )
    assert rep.as_dict() == ref.as_dict()
    with pytest.raises(ValueError, match="1-D"):
        stream_flops(model, ids.view(1, 37), seq_len=8)
    with pytest.raises(ValueError, match=">= 1"):
        stream_flops(model, ids, seq_len=0)
