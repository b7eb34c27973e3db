"""Skipped tokens keep contributing keys/values (``skipped_tokens_kv``): against the
dense layer, across cached decoding, batching with padding, sdpa and eager."""

import pytest
import torch
from test_causal_routing import incremental_logits, left_padded
from test_routing import batch_with_padding, positions, route_all
from tiny_models import ARCHITECTURES, DISTINCT_ARCHITECTURES, tiny_model
from transformers import DynamicCache

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.routing import (
    SkipPath,
    decoder_layers,
    original_class,
    routed_layers,
)
from adadsf_modifier.routing.kept_attention import project_kv

RATIOS = [0.8, 0.5, 1.0, 0.6]


def keep_kv(model, skip_rank=False):
    """Every routed layer keeps skipped tokens' keys/values; ``skip_rank`` (not False):
    also a random skip path of that rank (None: full)."""
    g = torch.Generator().manual_seed(3)
    for layer in routed_layers(model):
        layer.skipped_tokens_kv = True
        if skip_rank is not False and layer.retention_ratio < 1.0:
            skip = SkipPath(model.config.hidden_size, skip_rank)
            with torch.no_grad():
                for p in skip.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            layer.add_module("skip_path", skip)
    return model


def causal_kv_model(arch="llama", attn="sdpa", skip_rank=False, ratios=RATIOS):
    model = route_all(tiny_model(arch, len(ratios), attn=attn), ratios)
    keep_kv(model, skip_rank)
    g = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(4, 128, (4, 16), generator=g)} for _ in range(2)
    ]
    calibrate_thresholds(model, batches)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def layer_calls(model, run):
    """``{layer_index: (input, kwargs, output)}`` of each routed layer during
    ``run()``."""
    calls = {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        calls[module.layer_index] = (x, dict(kwargs), out)

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


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_project_kv_equals_the_keys_and_values_the_layer_caches(arch):
    """The keys/values computed for a skipped token are the ones the dense layer itself
    would store for it (read back from a dense KV cache)."""
    model = tiny_model(arch, 2)
    spec, layers = decoder_layers(model)
    seen = {}
    layers[1][1].register_forward_pre_hook(
        lambda m, a, kw: seen.update(x=a[0] if a else kw["hidden_states"], kw=kw),
        with_kwargs=True,
    )
    ids, mask = batch_with_padding()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        keys, values = project_kv(
            layers[1][1], spec, seen["x"], seen["kw"]["position_embeddings"]
        )
    torch.testing.assert_close(keys, cache.layers[1].keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(values, cache.layers[1].values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("skip_rank", [False, 4])
def test_kept_tokens_equal_the_dense_layer_skipped_take_the_skip_path(
    arch, attn, skip_rank
):
    """Reference computed independently: the original (dense) layer run on every token
    of the routed layer's input, where the router kept the token, else ``x`` (+ the
    skip path). Padded rows (left and right), top-k routing."""
    model = keep_kv(route_all(tiny_model(arch, 4, attn=attn), RATIOS), skip_rank)
    model.train()  # top-k routing, no thresholds needed
    ids, mask = batch_with_padding()
    calls = layer_calls(
        model,
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                      use_cache=False),
    )  # fmt: skip
    real = mask.bool()
    checked = 0
    for layer in routed_layers(model):
        if layer.retention_ratio >= 1.0:
            continue
        x, kwargs, out = calls[layer.layer_index]
        with torch.no_grad():
            dense = original_class(type(layer)).forward(layer, x, **kwargs)
            dense = dense[0] if isinstance(dense, tuple) else dense
            kept = layer.selected_mask(x, kwargs.get("attention_mask"), mode="topk")
            skipped = x if skip_rank is False else x + layer.skip_path(x)
        expected = torch.where(kept.unsqueeze(-1), dense, skipped)
        torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-5)
        assert 0 < int((kept & real).sum()) < int(real.sum())
        checked += 1
    assert checked == 3


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_without_kv_keep_kept_tokens_differ_from_the_dense_layer(arch):
    """The reference above can fail: routing that drops skipped tokens' keys changes
    the kept tokens' outputs."""
    model = route_all(tiny_model(arch, 4), RATIOS).train()
    ids, mask = batch_with_padding()
    calls = layer_calls(
        model, lambda: model(input_ids=ids, attention_mask=mask, use_cache=False)
    )
    layer = routed_layers(model)[1]
    x, kwargs, out = calls[1]
    with torch.no_grad():
        dense = original_class(type(layer)).forward(layer, x, **kwargs)
        kept = layer.selected_mask(x, kwargs.get("attention_mask"), mode="topk")
    diff = (out - dense).abs().amax(-1)[kept & mask.bool()]
    assert float(diff.max()) > 1e-3


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_decoding_equals_full_forward(arch, attn, batch):
    model = causal_kv_model(arch, attn, skip_rank=None)
    ids, mask = left_padded(batch, 12)
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
        chunked, _ = incremental_logits(model, ids, mask, prefill=5, chunk=3)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]
    for layer in routed_layers(model):  # every position cached, dense layout
        window = layer.attention_window  # a windowed cache keeps the last w - 1
        expected = ids.shape[1] if window is None else min(ids.shape[1], window - 1)
        assert cache.layers[layer.layer_index].keys.shape[-2] == expected


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_decode_step_with_some_rows_running(attn):
    """Rows that run and rows that skip in one decoding step: the skipping rows still
    append their keys/values, and the logits equal one full forward."""
    model = causal_kv_model("llama", attn, skip_rank=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 128, (4, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :5] = 0
    steps = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        if x.shape[1] == 1 and module.retention_ratio < 1.0:
            passes = module.router(x)[:, 0] > module.causal_threshold
            steps.append(int(passes.sum()))

    handles = [
        m.register_forward_hook(hook, with_kwargs=True) for m in routed_layers(model)
    ]
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, _ = incremental_logits(model, ids, mask, prefill=6)
    for h in handles:
        h.remove()
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
    assert any(0 < n < 4 for n in steps)  # the row-subset path ran


def test_sliding_window_cached_decoding_equals_full_forward():
    model = route_all(tiny_model("mistral", 3), [1.0, 0.5, 0.7])
    model.config.sliding_window = 5
    for layer in routed_layers(model):
        layer.attention_window = 5
    keep_kv(model, skip_rank=None)
    g = torch.Generator().manual_seed(0)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    )
    model.eval()
    ids, mask = left_padded(2, 13)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        inc, _ = incremental_logits(model, ids, mask, prefill=4)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_greedy_generate_with_and_without_cache_agree(arch):
    model = causal_kv_model(arch, skip_rank=None)
    ids, mask = left_padded(2, 8)
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=mask)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        uncached = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_retention_one_with_kv_keep_and_skip_path_equals_dense(arch):
    dense = tiny_model(arch, 3)
    model = keep_kv(route_all(tiny_model(arch, 3), 1.0), skip_rank=None)
    ids, mask = batch_with_padding()
    with torch.no_grad():
        a = dense(input_ids=ids, attention_mask=mask).logits
        b = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_a_cache_filled_without_kv_keep_is_refused():
    model = causal_kv_model()
    ids = torch.randint(4, 128, (1, 6))
    for layer in routed_layers(model):
        layer.skipped_tokens_kv = False
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        for layer in routed_layers(model):
            layer.skipped_tokens_kv = True
        with pytest.raises(RuntimeError, match="skipped_tokens_kv"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
