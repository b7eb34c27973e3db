"""Routed sliding-window models (Mistral, Qwen2 with use_sliding_window, Gemma's
alternating layers) decode from a KV cache exactly like one full forward, also with a
window shorter than the sequence."""

from functools import lru_cache

import pytest
import torch
from test_causal_routing import incremental_logits, left_padded
from test_routing import positions, route_all
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM, DynamicCache

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.flops import observe_routing
from adadsf_modifier.routing import RoutedCacheLayer

RATIOS = [0.8, 0.5, 1.0, 0.6]


@lru_cache(maxsize=None)
def windowed_model(arch, window, attn="sdpa"):
    """Built once per argument set: decoding keeps its state in the cache, not the
    model."""
    cfg = tiny_config(arch, attn=attn)
    if arch == "qwen2":  # layer 0 full attention, layers 1-3 sliding
        cfg = type(cfg)(
            **{
                **cfg.to_dict(),
                "use_sliding_window": True,
                "sliding_window": window,
                "max_window_layers": 1,
                "layer_types": None,
            }
        )
        cfg._attn_implementation = attn
    else:
        cfg.sliding_window = window
    torch.manual_seed(0)
    model = route_all(AutoModelForCausalLM.from_config(cfg).eval(), RATIOS)
    g = torch.Generator().manual_seed(0)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    )
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def full_logits(model, ids, mask):
    with torch.no_grad():
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_decoding_equals_full_forward_with_window_shorter_than_sequence(
    arch, attn, batch, chunk
):
    model = windowed_model(arch, window=4, attn=attn)
    ids, mask = left_padded(batch, length=14)
    full = full_logits(model, ids, mask)
    with torch.no_grad():
        inc, cache = incremental_logits(model, ids, mask, prefill=5, chunk=chunk)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]
    routed = [c for c in cache.layers if isinstance(c, RoutedCacheLayer)]
    assert routed and all(c.get_seq_length() == ids.shape[1] for c in routed)
    # slots that left every later query's window are dropped
    windowed = [c for c in routed if c.sliding_window is not None]
    assert windowed and all(c.num_slots <= 4 + chunk for c in windowed)


@pytest.mark.parametrize("window", [4, 4096])
def test_generate_with_sliding_window_cache_equals_no_cache(window):
    """A Mistral-7B-v0.1-style window (4096) and one shorter than the output."""
    model = windowed_model("mistral", window)
    ids, mask = left_padded(batch=2, length=8)
    with torch.no_grad():
        a = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False
        )
        b = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            use_cache=False,
        )
    assert a.shape == (2, 18)
    assert torch.equal(a, b)


def test_cache_built_without_config_still_applies_the_window():
    """DynamicCache() holds plain DynamicLayers: the routed layer's own window (from
    the config) still masks its cached slots, and mask sizes stay those of the dense
    layers."""
    model = windowed_model("mistral", 4)
    ids, mask = left_padded(batch=2, length=12)
    pos = positions(mask)
    full = full_logits(model, ids, mask)
    cache = DynamicCache()
    logits = []
    with torch.no_grad():
        for s, e in [(0, 5)] + [(t, t + 1) for t in range(5, 12)]:
            out = model(
                input_ids=ids[:, s:e],
                attention_mask=mask[:, :e],
                position_ids=pos[:, s:e],
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(
        torch.cat(logits, 1)[real], full[real], atol=1e-4, rtol=0
    )


def test_observed_attention_pairs_stay_inside_the_window_when_decoding():
    """One sequence token by token: a routed layer's query sees the cached tokens that
    ran the layer within the last ``window`` positions, plus itself."""
    window = 3
    model = windowed_model("mistral", window)
    ids = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    first = observe_routing(
        model, dict(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    )
    assert first.kept == [[1]] * 4  # the first token always runs
    ran = {layer: [0] for layer in (0, 1, 3)}  # positions that ran each routed layer
    for t in range(1, 12):
        step = observe_routing(
            model,
            dict(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True),
        )
        for layer in (0, 1, 3):  # routed at ratio < 1
            k = step.kept[layer][0]
            visible = sum(1 for p in ran[layer] if p > t - window)
            assert step.attended_keys[layer] == [k * (visible + 1)]
            ran[layer] += [t] * k
        assert step.dense_keys[2] == [min(t + 1, window)]
    assert all(1 < len(ran[layer]) < 12 for layer in (0, 1, 3))
