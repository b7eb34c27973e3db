"""Causal routing: per-token thresholds, routed KV caches, incremental decoding and
generate()."""

import pytest
import torch
from test_routing import positions, route_all
from tiny_models import ARCHITECTURES, DISTINCT_ARCHITECTURES, tiny_model

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.routing import (
    RoutedCacheLayer,
    get_routing_modes,
    routed_layers,
    set_routing_mode,
)
from adadsf_modifier.routing.selection import cut_for_ratio

RATIOS = [0.8, 0.5, 1.0, 0.6]


def causal_model(arch="llama", ratios=RATIOS, seed=0):
    model = route_all(tiny_model(arch, num_layers=len(ratios), seed=seed), ratios)
    g = torch.Generator().manual_seed(seed)
    batches = [
        {"input_ids": torch.randint(4, 128, (4, 16), generator=g)} for _ in range(2)
    ]
    report = calibrate_thresholds(model, batches)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, report


def left_padded(batch=2, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0
    return ids, mask


def incremental_logits(model, ids, mask, prefill, chunk=1):
    pos = positions(mask)
    out = model(
        input_ids=ids[:, :prefill],
        attention_mask=mask[:, :prefill],
        position_ids=pos[:, :prefill],
        use_cache=True,
    )
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prefill, ids.shape[1], chunk):
        e = min(t + chunk, ids.shape[1])
        out = model(
            input_ids=ids[:, t:e],
            attention_mask=mask[:, :e],
            position_ids=pos[:, t:e],
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


def test_eval_mode_defaults_to_causal_and_training_to_topk():
    model, _ = causal_model()
    assert set(get_routing_modes(model)) == {"causal"}
    model.train()
    assert set(get_routing_modes(model)) == {"topk"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 2])
def test_incremental_decoding_equals_full_forward(arch, batch):
    model, _ = causal_model(arch)
    ids, mask = left_padded(batch)
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_decode_step_runs_only_the_rows_that_pass(attn):
    """Decoding 4 rows (two left-padded): rows that skip a layer leave it untouched,
    rows that run it see only their own cached slots, and the logits equal one full
    forward."""
    model = route_all(tiny_model("llama", num_layers=4, attn=attn), RATIOS)
    g = torch.Generator().manual_seed(1)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    )
    model.eval()
    ids = torch.randint(4, 128, (4, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :5] = 0
    steps = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        if x.shape[1] == 1 and module.retention_ratio < 1.0:
            passes = module.router(x)[:, 0] > module.causal_threshold
            steps.append((passes, (output != x).any(-1)[:, 0]))

    handles = [
        li.register_forward_hook(hook, with_kwargs=True) for li in routed_layers(model)
    ]
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=6)
    for h in handles:
        h.remove()
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
    mixed = 0
    for passes, changed in steps:
        assert torch.equal(passes, changed)
        mixed += int(0 < int(passes.sum()) < passes.numel())
    assert mixed > 0  # the row-subset path was exercised
    assert cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_chunked_continuation_from_cache_equals_full_forward(arch):
    """Several new tokens per call on top of a cache (chunked prefill): the compacted
    mask must see the cached slots and be causal among the new ones."""
    model, _ = causal_model(arch)
    ids, mask = left_padded(batch=2, length=13)
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=4, chunk=3)
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]


def test_routed_cache_holds_only_tokens_that_ran_the_layer():
    model, _ = causal_model()
    ids, mask = left_padded(batch=1, length=12)
    ran = {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        ran[module.layer_index] = int((output != x).any(-1).sum())

    handles = [
        li.register_forward_hook(hook, with_kwargs=True) for li in routed_layers(model)
    ]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    for h in handles:
        h.remove()
    cache = out.past_key_values
    for layer in routed_layers(model):
        cache_layer = cache.layers[layer.layer_index]
        if layer.retention_ratio < 1.0:
            assert isinstance(cache_layer, RoutedCacheLayer)
            assert cache_layer.num_slots == ran[layer.layer_index] < ids.shape[1]
            assert cache_layer.get_seq_length() == ids.shape[1]
        else:
            assert cache_layer.get_seq_length() == ids.shape[1]


def test_token_below_threshold_is_untouched():
    model, _ = causal_model()
    ids, _ = left_padded(batch=2, length=12)
    records = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        records.append((module, x, output))

    handles = [
        li.register_forward_hook(hook, with_kwargs=True) for li in routed_layers(model)
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    checked = 0
    for layer, x, y in records:
        if layer.retention_ratio >= 1.0:
            continue
        below = layer.router(x) <= layer.causal_threshold
        below[:, 0] = False  # the first token (attention sink) always runs
        assert torch.equal(y[below], x[below])
        assert (y[~below] != x[~below]).any(-1).all()
        checked += int(below.sum())
    assert checked > 0


def test_thresholds_match_target_ratio_on_calibration_data():
    _, report = causal_model()
    for target, kept in zip(report.target_ratios, report.kept_fraction):
        assert abs(kept - target) < 0.1
    assert all(0.0 <= a <= 1.0 for a in report.topk_agreement)


def test_cut_for_ratio_quantile():
    scores = torch.arange(10.0)
    t = cut_for_ratio(scores, 0.3)[0]
    assert int((scores > t).sum()) == 3
    assert cut_for_ratio(scores, 1.0)[0] == float("-inf")


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_greedy_generate_with_and_without_cache_agree(arch):
    model, _ = causal_model(arch)
    ids, mask = left_padded(batch=2, length=8)
    with torch.no_grad():
        a = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False
        )
        b = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            use_cache=False,
        )
    assert a.shape == (2, 16)
    assert torch.equal(a, b)


def test_sampling_and_multiple_return_sequences_generate():
    model, _ = causal_model()
    ids, mask = left_padded(batch=2, length=8)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=True,
            top_k=20,
            num_return_sequences=2,
        )
        beams = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            num_beams=2,
            do_sample=False,
        )
    assert out.shape == (4, 13)
    assert beams.shape == (2, 13)


def test_topk_mode_refuses_cache_continuation_and_mode_validation():
    model, _ = causal_model()
    set_routing_mode(model, "topk")
    ids, _ = left_padded(batch=1)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        with pytest.raises(RuntimeError, match="cannot continue from a KV cache"):
            model(
                input_ids=ids[:, :1],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    with pytest.raises(ValueError, match="routing mode must be one of"):
        set_routing_mode(model, "sometimes")
    fresh = route_all(tiny_model("llama"), 0.5)
    with pytest.raises(ValueError, match="needs calibrated thresholds"):
        set_routing_mode(fresh, "causal")


def test_first_token_always_runs_unless_disabled():
    model, _ = causal_model()
    ids, mask = left_padded(batch=2, length=12)
    for layer in routed_layers(model):
        layer.causal_threshold = (
            float("inf") if layer.retention_ratio < 1.0 else layer.causal_threshold
        )
    records = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        records.append((module, (output != x).any(-1)))

    handles = [
        li.register_forward_hook(hook, with_kwargs=True) for li in routed_layers(model)
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        for layer in routed_layers(model):
            layer.keep_first_token = False
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in handles:
        h.remove()
    n = len(routed_layers(model))
    first = torch.tensor(
        [0, 3]
    )  # first real token of each row (row 1 is left-padded by 3)
    for layer, changed in records[:n]:
        if layer.retention_ratio < 1.0:
            assert changed[torch.arange(2), first].all() and int(changed.sum()) == 2
    for layer, changed in records[n:]:
        if layer.retention_ratio < 1.0:
            assert not changed.any()


def test_threshold_report_counts_tokens_even_when_layer_zero_is_dense():
    _, report = causal_model(ratios=[1.0, 0.5, 0.7])
    assert (
        report.num_tokens == 2 * 4 * 16
    )  # two calibration batches of 4 x 16 real tokens
    assert report.kept_fraction[0] == 1.0 and report.topk_agreement[0] == 1.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_row_whose_prefill_was_all_padding_still_runs_its_first_real_token(
    arch, chunk
):
    """Row 1's first 3 tokens are padding: with a 3-token prefill its first real token
    arrives after the cache exists, and must still run every layer (the attention sink
    rule), as in one full forward."""
    model, _ = causal_model(arch)
    ids, mask = left_padded(2)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        inc, _ = incremental_logits(model, ids, mask, prefill=3, chunk=chunk)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
