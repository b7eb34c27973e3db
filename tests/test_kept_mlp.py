"""The prefill of a layer keeping skipped tokens' keys/values on a sequential
architecture, without a gradient (``routed_layer.run_kept_mlp``): every token runs the
attention sub-block, the kept ones the MLP. It must equal the compacted path it
replaces (outputs, measured FLOPs, the cache a decoding step continues from) while
running fewer ops; GPT-NeoX's parallel residual and training keep the compacted path."""

import pytest
import torch
from test_kept_attention_kv import causal_kv_model, keep_kv
from test_routing import batch_with_padding, positions, route_all
from tiny_models import ARCHITECTURES, tiny_model
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.routing import RoutedLayer, kept_attention, routed_layers

SEQUENTIAL = [a for a in ARCHITECTURES if a != "gpt_neox"]  # not parallel residual
RATIOS = [1.0, 0.6, 0.3, 0.8]


def compacted(monkeypatch):
    monkeypatch.setattr(RoutedLayer, "attends_every_token", lambda layer: False)


def padded_inputs():
    ids, mask = batch_with_padding()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask)}


@pytest.mark.parametrize("arch", SEQUENTIAL)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_dense_attention_prefill_equals_the_compacted_one(arch, attn, monkeypatch):
    """Top-k routing, padded rows, no gradient: outputs and the measured FLOPs equal
    the compacted path's."""
    model = keep_kv(route_all(tiny_model(arch, 4, attn=attn), RATIOS), skip_rank=4)
    model.eval()
    for layer in routed_layers(model):
        layer.routing_mode = "topk"
    batch = padded_inputs()
    real = batch["attention_mask"].bool()
    calls = count_calls(monkeypatch)

    @torch.no_grad()
    def run():
        return model(**batch, use_cache=False).logits, normalized_flops(model, batch)

    out, flops = run()
    assert calls  # the path under test ran
    compacted(monkeypatch)
    ref, ref_flops = run()
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-5)
    assert flops.normalized == pytest.approx(ref_flops.normalized, rel=0, abs=1e-12)
    assert flops.kept == ref_flops.kept


@pytest.mark.parametrize("arch", SEQUENTIAL)
def test_with_a_gradient_the_compacted_path_runs(arch, monkeypatch):
    """Training keeps the compacted batch (its backward skips the skipped tokens'
    query and output projections); the same forward without a gradient does not."""
    model = keep_kv(route_all(tiny_model(arch, 4), RATIOS), skip_rank=4).train()
    ids, _ = batch_with_padding()
    calls = count_calls(monkeypatch)
    model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    assert calls == []
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert len(calls) == 3  # the three layers that skip tokens


def count_calls(monkeypatch) -> list:
    calls = []
    real = RoutedLayer.run_kept_mlp
    monkeypatch.setattr(
        RoutedLayer, "run_kept_mlp", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    return calls


@pytest.mark.parametrize("arch", SEQUENTIAL)
def test_a_prompt_continued_from_a_cache_equals_the_compacted_path(arch, monkeypatch):
    """Causal thresholds: a prompt in two chunks (the second attends to the first
    through the cache), then greedy decoding steps; logits and every cached key equal
    the compacted path's."""
    model = causal_kv_model(arch, skip_rank=4, ratios=RATIOS)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 128, (2, 14), generator=g)

    @torch.no_grad()
    def run():
        cache = DynamicCache(config=model.config)
        logits = [model(input_ids=ids[:, :9], past_key_values=cache).logits]
        logits.append(model(input_ids=ids[:, 9:], past_key_values=cache).logits)
        token = logits[-1][:, -1:].argmax(-1)
        for _ in range(3):
            logits.append(model(input_ids=token, past_key_values=cache).logits)
            token = logits[-1][:, -1:].argmax(-1)
        keys = [layer.keys.clone() for layer in cache.layers]
        return torch.cat(logits, dim=1), keys

    out, keys = run()
    compacted(monkeypatch)
    ref, ref_keys = run()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for k, r in zip(keys, ref_keys):
        torch.testing.assert_close(k, r, rtol=0, atol=1e-5)


def top_level_ops(model, batch) -> int:
    """ATen ops called from Python (not from inside another ATen op) in one forward."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(**batch, use_cache=False)
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def test_the_dense_attention_prefill_runs_fewer_ops(monkeypatch):
    """The op count of the hot path is part of its cost: the forward of two routed
    layers (one prompt, causal thresholds, the shipped structure) must run fewer
    top-level ops than on the compacted path, by at least 40 a routed layer."""
    model = causal_kv_model("llama", skip_rank=4, ratios=RATIOS)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(4, 128, (1, 16), generator=g)}
    ops = top_level_ops(model, batch)
    compacted(monkeypatch)
    ref = top_level_ops(model, batch)
    partial = [m for m in routed_layers(model) if 0 < m.retention_ratio < 1]
    assert ref - ops >= 40 * len(partial), (ops, ref)


def test_gpt_neox_parallel_residual_keeps_the_compacted_path():
    neox = keep_kv(route_all(tiny_model("gpt_neox", 2), [1.0, 0.5]))
    llama = keep_kv(route_all(tiny_model("llama", 2), [1.0, 0.5]))
    assert not routed_layers(neox)[1].attends_every_token()
    assert routed_layers(llama)[1].attends_every_token()


@pytest.mark.parametrize("chunk", [2, 256])
def test_the_compacted_path_runs_where_its_kept_queries_go_in_chunks(
    chunk, monkeypatch
):
    """Where the kept queries of a compacted prefill attend in chunks (more of them than
    ``CPU_QUERY_CHUNK``, the CPU rule of ``cpu_chunks_for``), that path does less
    attention work than the dense layer, so the layer takes it; otherwise it runs its
    attention on every token."""
    model = causal_kv_model("llama", skip_rank=4, ratios=RATIOS)
    partial = [m for m in routed_layers(model) if 0 < m.retention_ratio < 1]
    monkeypatch.setattr(kept_attention, "CPU_QUERY_CHUNK", chunk)
    monkeypatch.setattr(kept_attention, "cpu_chunks_for", lambda dtype: True)
    calls = count_calls(monkeypatch)
    ids = torch.randint(4, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == (0 if chunk == 2 else len(partial))
