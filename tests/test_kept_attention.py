"""The kept tokens' attention on SDPA's causal kernel (``routing/kept_attention.py``),
or on a CPU in chunks of kept queries: used exactly when it applies, equal to the
explicit-mask form it replaces (outputs, gradients, measured FLOPs), and loud when
anything else touches its marker.

These forms belong to the compacted prefill of a kv-keeping layer, the path GPT-NeoX's
parallel-residual layers take; the sequential architectures run their attention on
every token instead (``tests/test_kept_mlp.py``), so here every architecture is sent
down the compacted path."""

import pytest
import torch
from test_kept_attention_kv import keep_kv
from test_routing import route_all
from tiny_models import ARCHITECTURES, tiny_model

from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.routing import (
    RoutedLayer,
    kept_attention,
    routed_layer,
    routed_layers,
)

RATIOS = [0.8, 0.5, 1.0, 0.6]


def kv_model(arch, attn="sdpa"):
    return keep_kv(route_all(tiny_model(arch, 4, attn=attn), RATIOS), skip_rank=4)


def ids(batch=3, seq=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (batch, seq), generator=g)


@pytest.fixture(autouse=True)
def compacted(monkeypatch):
    monkeypatch.setattr(RoutedLayer, "attends_every_token", lambda layer: False)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = kept_attention._attend

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kept_attention, "_attend", counting)
    return calls


def explicit_mask(monkeypatch):
    monkeypatch.setattr(routed_layer, "causal_kernel_applies", lambda *a: False)


@pytest.mark.parametrize("chunk", [256, 3])  # 3: the kept queries in chunks
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_runs_the_causal_kernel_and_equals_the_explicit_mask(
    arch, chunk, kernel_calls, monkeypatch
):
    monkeypatch.setattr(kept_attention, "CPU_QUERY_CHUNK", chunk)
    monkeypatch.setattr(kept_attention, "cpu_chunks_for", lambda dtype: True)
    model = kv_model(arch)
    model.train()  # top-k routing: no thresholds needed, gradients flow
    x = ids()
    out = model(input_ids=x, use_cache=False).logits
    out.square().mean().backward()
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    # the layers that skip tokens, but a windowed one (Gemma's, 4 keys: a 4D mask)
    unmasked = [
        m
        for m in routed_layers(model)
        if m.retention_ratio < 1.0 and m.attention_window is None
    ]
    assert len(kernel_calls) == len(unmasked) > 0
    model.zero_grad()
    explicit_mask(monkeypatch)
    ref = model(input_ids=x, use_cache=False).logits
    ref.square().mean().backward()
    assert len(kernel_calls) == len(unmasked)  # not used with the explicit mask
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_padding_eager_and_cached_past_keep_the_explicit_mask(arch, kernel_calls):
    model = kv_model(arch, attn="eager")
    model.train()
    with torch.no_grad():
        model(input_ids=ids(), use_cache=False)
    assert kernel_calls == []
    model = kv_model(arch)
    model.train()
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :4] = 0  # left padding: transformers passes a 4D mask
    with torch.no_grad():
        model(input_ids=ids(), attention_mask=mask, use_cache=False)
    assert kernel_calls == []


def test_measured_flops_are_the_same_on_both_paths(monkeypatch):
    model = kv_model("llama")
    model.eval()
    for layer in routed_layers(model):
        layer.routing_mode = "topk"
    batch = {"input_ids": ids()}
    fast = normalized_flops(model, batch)
    explicit_mask(monkeypatch)
    slow = normalized_flops(model, batch)
    assert fast.normalized == pytest.approx(slow.normalized, rel=0, abs=1e-12)
    assert fast.normalized < 1.0


def test_the_marker_refuses_any_other_use():
    marker = kept_attention.KeptQueries(torch.tensor([[0, 2]]), 4)
    assert marker.shape == (0,) and "KeptQueries" in repr(marker)
    with pytest.raises(RuntimeError, match="only valid as the attn_mask"):
        marker + 1
    q = torch.randn(1, 2, 2, 8)
    kv = torch.randn(1, 2, 5, 8)  # 5 keys for a 4-token marker: a cached past
    with pytest.raises(RuntimeError, match="expects 4 keys"):
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=marker)


@pytest.mark.parametrize("chunk", [256, 1, 2, 3])  # 256: the causal kernel
def test_the_causal_form_equals_the_masked_form_on_random_positions(chunk, monkeypatch):
    monkeypatch.setattr(kept_attention, "CPU_QUERY_CHUNK", chunk)
    monkeypatch.setattr(kept_attention, "cpu_chunks_for", lambda dtype: True)
    g = torch.Generator().manual_seed(1)
    index = torch.tensor([[0, 3, 4, 7, 9], [0, 1, 5, 10, 10]])  # row 1: one unused
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=kept_attention.KeptQueries(index, 10), enable_gqa=True
    )
    allowed = torch.arange(10).view(1, 1, 1, 10) <= index.view(2, 1, 5, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, enable_gqa=True
    )
    valid = (index < 10).view(2, 1, 5, 1).expand_as(out)
    torch.testing.assert_close(out[valid], ref[valid], rtol=0, atol=1e-6)


def test_bfloat16_queries_go_in_chunks_on_one_cpu_thread_and_float32_ones_do_not(
    monkeypatch,
):
    calls = []
    monkeypatch.setattr(kept_attention, "CPU_QUERY_CHUNK", 2)
    real = kept_attention._attend_in_chunks
    monkeypatch.setattr(
        kept_attention, "_attend_in_chunks", lambda *a: calls.append(1) or real(*a)
    )
    index = torch.tensor([[0, 2, 3, 5, 6]])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(1, 2, 5, 8, dtype=dtype)
                kv = torch.randn(1, 2, 7, 8, dtype=dtype)
                marker = kept_attention.KeptQueries(index, 7)
                torch.nn.functional.scaled_dot_product_attention(
                    q, kv, kv, attn_mask=marker
                )
                calls.append((n_threads, dtype))
    finally:
        torch.set_num_threads(threads)
    # only the bfloat16 call on one thread went in chunks
    assert calls == [
        (1, torch.float32), 1, (1, torch.bfloat16),
        (2, torch.float32), (2, torch.bfloat16),
    ]  # fmt: skip
