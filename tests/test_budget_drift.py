"""The kept share that ``adadsf eval`` and ``bench`` report beside its target, and the
warning when causal thresholds do not hold the budget on the text measured."""

import torch
from loguru import logger
from test_causal_routing import RATIOS, causal_model

from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.evaluation.speed import (
    decode_kept_share,
    measure_decode,
    measure_prefill,
)
from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.routing import routed_layers


def kept_by_hooks(model, ids):
    """Per routed layer, real tokens whose hidden state it changed (independent of the
    FLOPs recorder)."""
    changed = {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        changed[module.layer_index] = int((out != x).any(-1).sum())

    layers = routed_layers(model)
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in layers]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return changed


def warnings_during(fn):
    seen = []
    sink = logger.add(lambda m: seen.append(str(m)), level="WARNING")
    try:
        result = fn()
    finally:
        logger.remove(sink)
    return result, [w for w in seen if "retention ratios plan" in w]


def test_kept_share_is_what_the_routed_layers_ran_against_their_ratios():
    model, _ = causal_model()
    ids = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    share = KeptShare(model)
    share.add(normalized_flops(model, {"input_ids": ids}))
    changed = kept_by_hooks(model, ids)
    layers = routed_layers(model)
    assert share.fraction == sum(changed.values()) / (ids.numel() * len(layers))
    ratios = [m.retention_ratio for m in layers]
    assert share.target == sum(ratios) / len(ratios)
    assert sorted(RATIOS) == sorted(ratios)


def test_a_budget_that_does_not_hold_on_the_text_is_reported_and_warned_about():
    """Thresholds that let every token through (as on text far from the calibration
    set) keep more than planned: prefill and decoding both say so."""
    dense, _ = causal_model()
    model, _ = causal_model()
    prompt = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    held, quiet = warnings_during(lambda: measure_prefill(dense, model, prompt, 1, 0))
    for layer in routed_layers(model):
        layer.causal_threshold = float("-inf")
    drifted, loud = warnings_during(lambda: measure_prefill(dense, model, prompt, 1, 0))
    assert drifted.kept_fraction == 1.0
    assert drifted.retention_target == held.retention_target < 1.0
    assert loud and len(loud) > len(quiet)
    decode, loud = warnings_during(
        lambda: measure_decode(dense, model, prompt, 3, 1, 0)
    )
    assert decode.kept_fraction == 1.0 and loud


def test_decode_kept_share_counts_the_decoding_steps_as_the_speed_benchmark_does():
    """Without timing anything, the same share the benchmark reports for the same
    greedy steps; thresholds letting every token through or none move it to 1, or to
    the share of layers at ratio 1 (they run every token whatever their threshold;
    the prompt's own prefill, where the first token is forced, is not counted)."""
    dense, _ = causal_model()
    model, _ = causal_model()
    prompt = torch.randint(4, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    share = decode_kept_share(model, prompt, 4)
    timed = measure_decode(dense, model, prompt, 4, 1, 0)
    assert share.fraction == timed.kept_fraction
    assert share.target == timed.retention_target < 1.0
    layers = routed_layers(model)
    full = sum(m.retention_ratio >= 1.0 for m in layers) / len(layers)
    assert 0.0 < full < 1.0
    for value, kept in ((float("-inf"), 1.0), (float("inf"), full)):
        for layer in layers:
            layer.causal_threshold = value
        assert decode_kept_share(model, prompt, 4).fraction == kept
