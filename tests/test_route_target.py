"""Sub-layer routing (``route_target`` ``attention`` / ``mlp``): what skipped tokens
get, cached decoding against one full forward, refusals, calibration similarities."""

import pytest
import torch
from test_causal_routing import incremental_logits, left_padded
from test_routing import positions
from tiny_models import tiny_model

from adadsf_modifier.calibration import SimilarityAccumulator, token_cosine_similarity
from adadsf_modifier.routing import (
    RoutedCacheLayer,
    TokenRouter,
    UnsupportedArchitectureError,
    calibrate_thresholds,
    decoder_layers,
    route_layer,
    routed_layers,
    unroute_layer,
)
from adadsf_modifier.routing.sub_blocks import attention_block, mlp_block

RATIOS = [0.8, 0.5, 1.0, 0.6]
SPLIT = ("llama", "qwen2", "mistral")


def route_target_model(arch, target, ratios=RATIOS, kv=False, attn="sdpa", seed=0):
    model = tiny_model(arch, len(ratios), seed=seed, attn=attn)
    spec, layers = decoder_layers(model)
    torch.manual_seed(seed)
    for i, (_, layer) in enumerate(layers):
        route_layer(layer, TokenRouter(model.config.hidden_size, 8), ratios[i], i,
                    spec.cache_kwarg, model.config, skipped_tokens_kv=kv,
                    route_target=target)  # fmt: skip
    return model


def calibrated(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = [
        {"input_ids": torch.randint(4, 128, (4, 16), generator=g)} for _ in range(2)
    ]
    calibrate_thresholds(model, batches)
    return model.eval()


def layer_io(model, run):
    """``{layer_index: (input, kwargs, output)}`` of each routed layer in ``run()``."""
    calls = {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        calls[module.layer_index] = (x, dict(kwargs), output)

    handles = [
        m.register_forward_hook(hook, with_kwargs=True) for m in routed_layers(model)
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return calls


@pytest.mark.parametrize("target", ["attention", "mlp"])
def test_every_token_selected_equals_the_dense_layer(target):
    """Splitting the layer into its two sub-blocks changes nothing when every token runs
    both: threshold -inf routes all tokens through the sub-block path."""
    dense = tiny_model("llama", 4)
    model = calibrated(route_target_model("llama", target))
    for layer in routed_layers(model):
        layer.causal_threshold = float("-inf")
    ids, mask = left_padded(2, 12)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    with torch.no_grad():
        ref, out = dense(**kw).logits, model(**kw).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", [False, True])
def test_attention_target_skipped_tokens_run_only_the_mlp(kv):
    """A skipped token's output is ``x + mlp(norm(x))`` exactly (its attention
    residual update is skipped); a selected token's differs from that."""
    model = calibrated(route_target_model("llama", "attention", kv=kv))
    ids, _ = left_padded(2, 12)
    calls = layer_io(model, lambda: model(input_ids=ids, use_cache=False))
    checked = 0
    for layer in routed_layers(model):
        if layer.retention_ratio >= 1.0:
            continue
        x, _, y = calls[layer.layer_index]
        sel = layer.selected_mask(x)
        with torch.no_grad():
            mlp_only = mlp_block(layer, x)
        assert torch.equal(y[~sel], mlp_only[~sel])
        assert (y[sel] != mlp_only[sel]).any(-1).all()
        checked += int((~sel).sum())
    assert checked > 0


def test_mlp_target_skipped_tokens_run_only_the_attention():
    model = calibrated(route_target_model("llama", "mlp"))
    ids, _ = left_padded(2, 12)
    calls = layer_io(model, lambda: model(input_ids=ids, use_cache=False))
    checked = 0
    for layer in routed_layers(model):
        if layer.retention_ratio >= 1.0:
            continue
        x, kwargs, y = calls[layer.layer_index]
        sel = layer.selected_mask(x)
        with torch.no_grad():
            h = attention_block(layer)(x, **kwargs)  # dense attention, every token
            full = mlp_block(layer, h)
        assert torch.equal(y[~sel], h[~sel])
        torch.testing.assert_close(y[sel], full[sel], atol=1e-6, rtol=0)
        checked += int((~sel).sum())
    assert checked > 0


@pytest.mark.parametrize("arch", SPLIT)
@pytest.mark.parametrize("target,kv", [("attention", False), ("attention", True),
                                       ("mlp", False)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 2])
def test_incremental_decoding_equals_full_forward(arch, target, kv, batch):
    model = calibrated(route_target_model(arch, target, kv=kv))
    ids, mask = left_padded(batch, 11)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
        chunked, _ = incremental_logits(model, ids, mask, prefill=4, chunk=3)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]
    routed_cache = [isinstance(c, RoutedCacheLayer) for c in cache.layers]
    # only attention routing without skipped tokens' K/V keeps a compacted cache
    expect = [target == "attention" and not kv and r < 1.0 for r in RATIOS]
    assert routed_cache == expect


@pytest.mark.parametrize("target", ["attention", "mlp"])
def test_greedy_generate_with_and_without_cache_agree(target):
    model = calibrated(route_target_model("llama", target))
    model.generation_config.pad_token_id = 0
    ids, mask = left_padded(2, 8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        cached = model.generate(**kw, use_cache=True)
        plain = model.generate(**kw, use_cache=False)
    assert torch.equal(cached, plain)


def test_removed_attention_keeps_the_mlp():
    """Ratio 0 with ``attention``: the attention sub-block is removed (attention drop),
    the MLP still runs every token."""
    model = route_target_model("llama", "attention", ratios=[1.0, 0.0, 1.0, 1.0])
    ids, _ = left_padded(1, 9)
    calls = layer_io(model, lambda: model(input_ids=ids, use_cache=False))
    layer = routed_layers(model)[1]
    x, _, y = calls[1]
    with torch.no_grad():
        assert torch.equal(y, mlp_block(layer, x))


def test_training_gradient_reaches_the_router_through_the_sub_block():
    for target in ("attention", "mlp"):
        model = route_target_model("llama", target).train()
        ids = torch.randint(4, 128, (2, 10), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        for layer in routed_layers(model):
            grads = [p.grad for p in layer.router.parameters()]
            assert any(g is not None and g.abs().sum() > 0 for g in grads), target


def test_unsplittable_architecture_and_conflicting_options_are_refused():
    model = tiny_model("gpt_neox", 2)
    spec, layers = decoder_layers(model)
    layer = layers[0][1]
    with pytest.raises(UnsupportedArchitectureError, match="route_target 'attention'"):
        route_layer(layer, TokenRouter(32, 8), 0.5, 0, spec.cache_kwarg, model.config,
                    route_target="attention")  # fmt: skip
    assert type(layer).__name__ == "GPTNeoXLayer"  # refused before any change
    llama = tiny_model("llama", 2)
    spec, layers = decoder_layers(llama)
    with pytest.raises(ValueError, match="route_target must be one of"):
        route_layer(layers[0][1], TokenRouter(32, 8), 0.5, 0, spec.cache_kwarg,
                    llama.config, route_target="attn")  # fmt: skip
    with pytest.raises(ValueError, match="skipped_tokens_kv needs route_target"):
        route_layer(layers[0][1], TokenRouter(32, 8), 0.5, 0, spec.cache_kwarg,
                    llama.config, skipped_tokens_kv=True,
                    route_target="mlp")  # fmt: skip
    layer = route_layer(layers[1][1], TokenRouter(32, 8), 0.5, 1, spec.cache_kwarg,
                        llama.config, route_target="mlp")  # fmt: skip
    assert layer.route_target == "mlp" and "route=mlp" in repr(layer)
    unroute_layer(layer)
    assert "route_target" not in layer.__dict__


@pytest.mark.parametrize("target", ["attention", "mlp"])
def test_calibration_similarity_is_that_of_the_routed_sub_block(target):
    model = tiny_model("llama", 3)
    _, layers = decoder_layers(model)
    acc = SimilarityAccumulator(3, sample_tokens=16, route_target=target)
    ids, mask = left_padded(2, 10)
    calls = {}
    handles = [
        layer.register_forward_hook(
            lambda m, a, k, o, i=i: calls.__setitem__(i, (a, k, o)), with_kwargs=True
        )
        for i, (_, layer) in enumerate(layers)
    ]
    with acc.capturing([layer for _, layer in layers]), torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        )
    for h in handles:
        h.remove()
    sims = acc.similarities()
    real = mask.bool()
    for i, (_, layer) in enumerate(layers):
        args, kwargs, out = calls[i]
        x = args[0] if args else kwargs["hidden_states"]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        route_layer(layer, TokenRouter(32, 8), 1.0, i, "past_key_values", model.config)
        with torch.no_grad():
            h = attention_block(layer)(x, **kwargs)
        unroute_layer(layer)
        cos = token_cosine_similarity(x, h) if target == "attention" else (
            token_cosine_similarity(h, out))  # fmt: skip
        assert sims[i] == pytest.approx(float(cos[real].double().mean()), abs=1e-6)
    xs, cs = acc.sampled(1)
    assert xs.shape[1] == 32 and len(xs) == len(cs) > 0


@pytest.mark.parametrize("target,kv", [("attention", False), ("attention", True),
                                       ("mlp", False)])  # fmt: skip
def test_sliding_window_decoding_equals_full_forward(target, kv):
    """A Mistral window (4 keys) shorter than the sequence: the routed attention's
    cache masks the slots that left the window, as for whole layers."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("mistral")
    cfg.sliding_window = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    spec, layers = decoder_layers(model)
    for i, (_, layer) in enumerate(layers):
        route_layer(layer, TokenRouter(32, 8), RATIOS[i], i, spec.cache_kwarg, cfg,
                    skipped_tokens_kv=kv, route_target=target)  # fmt: skip
    model = calibrated(model)
    ids, mask = left_padded(3, 13)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        inc, _ = incremental_logits(model, ids, mask, prefill=5)
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
