"""FLOPs of the skip path and of skipped tokens' keys/values: what the routed layers
record is what actually runs (checked against torch's own FlopCounterMode)."""

import pytest
import torch
from test_causal_routing import left_padded
from test_kept_attention_kv import keep_kv
from test_routing import positions, route_all
from tiny_models import ARCHITECTURES, DISTINCT_ARCHITECTURES, tiny_model
from torch.utils.flop_counter import FlopCounterMode

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.flops import count_flops, layer_shape, normalized_flops
from adadsf_modifier.routing import (
    RoutedLayer,
    SkipPath,
    decoder_layers,
    routed_layers,
)

RATIOS = [1.0, 0.5, 0.0, 0.6, 0.7]


def variant_model(arch, kv):
    """Layer 0 dense-at-ratio-1, full-rank / rank-4 skip paths alternating (the removed
    layer 2 included), ``kv``: skipped tokens keep keys/values."""
    model = route_all(tiny_model(arch, len(RATIOS), attn="eager"), RATIOS)
    for layer in routed_layers(model):
        layer.skipped_tokens_kv = kv
        if layer.retention_ratio < 1.0:
            rank = None if layer.layer_index % 2 else 4
            layer.add_module("skip_path", SkipPath(model.config.hidden_size, rank))
    return model.train()  # top-k routing


def counted_and_modelled(model, n=20):
    """``(ids, FlopCounterMode's counts per module, the FLOPs model's report, the
    top-k selection of each partially routed layer)`` on one row of ``n`` tokens."""
    ids = torch.randint(4, 128, (1, n), generator=torch.Generator().manual_seed(0))
    selected = {}

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if 0 < module.retention_ratio < 1:
            selected[module.layer_index] = module.selected_mask(x, mode="topk")[0]

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in routed_layers(model)
    ]
    with torch.no_grad():
        report = normalized_flops(model, {"input_ids": ids})
    for h in handles:
        h.remove()
    return ids, counter.get_flop_counts(), report, selected


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
@pytest.mark.parametrize("kv", [False, True])
def test_counted_flops_equal_flop_counter_mode_layer_by_layer(arch, kv, monkeypatch):
    """Every matmul a decoder layer runs (projections, MLP, router, skip path, the
    keys/values of skipped tokens) is counted, and nothing else. FlopCounterMode counts
    eager attention over the full query x key rectangle, the FLOPs model over the
    causally allowed pairs: that term is compared separately, against the pairs of the
    kept tokens found independently from the router's choice.

    A kv-keeping layer runs here on the compacted path, which computes exactly the
    method's work; the default path's documented extra is checked below."""
    monkeypatch.setattr(RoutedLayer, "attends_every_token", lambda layer: False)
    model = variant_model(arch, kv)
    n = 20
    ids, counts, report, selected = counted_and_modelled(model, n)
    shape = layer_shape(model.config)
    _, layers = decoder_layers(model)
    for i, (name, _) in enumerate(layers):
        fqn = f"{type(model).__name__}.{name}"
        measured = sum(counts.get(fqn, {}).values())
        ours = report.routed_per_layer[i]
        k = report.kept[i][0]
        keys = n if (kv or k == n) else k
        rectangle = shape.attention_flops(k * keys)
        assert measured == ours.total - ours.attention + rectangle, name
        if i in selected:  # pairs among the kept queries, by position
            pos = selected[i].nonzero().flatten()
            behind = pos[:, None] - (torch.arange(n) if kv else pos)[None, :]
            window = layers[i][1].attention_window or n
            pairs = int(((behind >= 0) & (behind < window)).sum())
            assert ours.attention == shape.attention_flops(pairs)
            assert ours.skip_path == SkipPath.flops_for(
                n - k, shape.hidden_size, None if i % 2 else 4
            )
            assert ours.kv_only == (shape.kv_only_flops(n - k) if kv else 0)
    assert report.routed_per_layer[2].skip_path == SkipPath.flops_for(n, 32, 4)
    assert report.routed_per_layer[2].projections == 0  # removed: only the map runs
    assert report.routed_by_term["kv_only"] > 0 if kv else True


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "gpt_neox"])
def test_the_dense_attention_prefill_runs_the_counted_work_and_the_documented_extra(
    arch,
):
    """A kv-keeping layer of a sequential architecture runs its attention sub-block on
    every token (``routed_layer.run_kept_mlp``). Beyond what the FLOPs model counts, it
    computes exactly the skipped tokens' query and output projections and their query
    rows of the attention (docs/flops.md), and nothing else."""
    model = variant_model(arch, True)
    n = 20
    _, counts, report, selected = counted_and_modelled(model, n)
    shape = layer_shape(model.config)
    _, layers = decoder_layers(model)
    assert selected  # some layers run part of their tokens
    for i, (name, _) in enumerate(layers):
        measured = sum(counts.get(f"{type(model).__name__}.{name}", {}).values())
        ours = report.routed_per_layer[i]
        k = report.kept[i][0]
        rows = n if 0 < k else 0  # every query row runs, as in the dense layer
        extra = 0
        if i in selected:
            skipped = n - k
            h, q = shape.hidden_size, shape.q_dim
            # the skipped tokens' q (unless counted with a fused qkv) and o projections
            extra = 2 * skipped * h * q * (1 if shape.fused_qkv else 2)
        rectangle = shape.attention_flops(rows * n)
        assert measured == ours.total - ours.attention + rectangle + extra, name


def test_kv_only_flops_by_architecture():
    llama = layer_shape(tiny_model("llama", 1).config)  # kv_dim 16 of 32 (GQA)
    neox = layer_shape(tiny_model("gpt_neox", 1).config)  # fused qkv
    assert llama.kv_only_flops(3) == 2 * 3 * 32 * (2 * 16)
    assert neox.kv_only_flops(3) == 2 * 3 * 32 * (3 * 32)
    phi3 = layer_shape(tiny_model("phi3", 1).config)  # fused qkv_proj, GQA
    assert phi3.kv_only_flops(3) == 2 * 3 * 32 * (32 + 2 * 16)
    assert phi3.projection_flops(3) == llama.projection_flops(3)
    assert phi3.mlp_flops(3) == llama.mlp_flops(3)  # gate_up_proj: 2 I wide


def test_observed_counts_with_padding_count_real_skipped_tokens_only():
    model = keep_kv(route_all(tiny_model("llama", 3), [1.0, 0.5, 0.0]))
    routed_layers(model)[1].add_module("skip_path", SkipPath(32, 4))
    model.train()
    ids, mask = left_padded(2, 10)  # row 1 has 3 padding tokens
    with torch.no_grad():
        report = normalized_flops(model, {"input_ids": ids, "attention_mask": mask})
    real = [10, 7]
    kept = report.kept[1]
    assert list(kept) == [5, 3]
    skipped = [r - k for r, k in zip(real, kept)]
    assert report.routed_per_layer[1].skip_path == SkipPath.flops_for(
        sum(skipped), 32, 4
    )
    assert report.routed_per_layer[1].kv_only == layer_shape(model).kv_only_flops(
        sum(skipped)
    )
    # the removed layer computes no keys/values (no query would ever read them)
    assert report.routed_per_layer[2].total == 0


def test_decoding_step_counts_with_kv_keep():
    """One cached decoding step: a row that runs attends to every earlier position (all
    cached); a row that skips computes only its keys/values and its skip path."""
    model = keep_kv(route_all(tiny_model("llama", 2), [1.0, 0.5]), skip_rank=None)
    g = torch.Generator().manual_seed(0)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    )
    model.eval()
    layer = routed_layers(model)[1]
    ids, mask = left_padded(4, 9)
    pos = positions(mask)
    with torch.no_grad():
        out = model(input_ids=ids[:, :8], attention_mask=mask[:, :8],
                    position_ids=pos[:, :8], use_cache=True)  # fmt: skip
        step = {"input_ids": ids[:, 8:], "attention_mask": mask,
                "position_ids": pos[:, 8:], "past_key_values": out.past_key_values,
                "use_cache": True}  # fmt: skip
        layer.causal_threshold = float("inf")  # no row runs layer 1
        report = normalized_flops(model, step)
    assert report.kept[1] == (0, 0, 0, 0)
    assert report.routed_per_layer[1].kv_only == layer_shape(model).kv_only_flops(4)
    assert report.routed_per_layer[1].skip_path == SkipPath.flops_for(4, 32, None)


def test_count_flops_refuses_more_skipped_than_skippable_tokens():
    cfg = tiny_model("llama", 2).config
    with pytest.raises(ValueError, match=r"skip_path_tokens\[1\]\[0\] = 5"):
        count_flops(cfg, [[8], [4]], [8], routed_layers=[1],
                    skip_path_tokens=[[0], [5]])  # fmt: skip
    rep = count_flops(cfg, [[8], [4]], [8], routed_layers=[1],
                      skip_path_tokens=[[0], [4]], skip_path_ranks={1: 2},
                      kv_only_tokens=[[0], [4]])  # fmt: skip
    assert rep.routed_per_layer[1].skip_path == SkipPath.flops_for(4, 32, 2)
    assert rep.routed_per_layer[1].kv_only == 2 * 4 * 32 * 32
