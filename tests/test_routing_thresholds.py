"""Causal thresholds reproduce the retention ratios on their calibration data, or refuse
data on which no threshold can."""

import pytest
import torch
from test_routing import route_all
from tiny_models import tiny_model

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.fitting.thresholds import (
    ThresholdCalibrationError,
    check_calibration_rows,
)
from adadsf_modifier.routing import routed_layers
from adadsf_modifier.routing.selection import cut_for_ratio

RATIOS = [0.73, 0.61, 0.56, 0.3]


def rows(num_rows, length, seed=0, batches=2):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(4, 128, (num_rows, length), generator=g)}
        for _ in range(batches)
    ]


def kept_fraction_by_forward(model, batches):
    """Per routed layer: the fraction of calibration tokens whose hidden state the
    layer changed (forward hooks, independent of the threshold code)."""
    changed, total = {}, {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        i = module.layer_index
        changed[i] = changed.get(i, 0) + int((output != x).any(-1).sum())
        total[i] = total.get(i, 0) + x.shape[0] * x.shape[1]

    layers = routed_layers(model)
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in layers]
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    for h in handles:
        h.remove()
    return [changed[m.layer_index] / total[m.layer_index] for m in layers]


@pytest.mark.parametrize("length", [4, 8, 64])
def test_fitted_thresholds_reproduce_the_targets_on_calibration_data(length):
    """Short rows make the always-kept first token a large share of the data: the
    fitted thresholds must account for it (and for upstream routing) so the kept
    fractions measured by a plain forward pass match the targets."""
    model = route_all(tiny_model("llama"), RATIOS)
    batches = rows(8, length)
    report = calibrate_thresholds(model, batches)
    model.eval()
    measured = kept_fraction_by_forward(model, batches)
    tolerance = max(report.tolerance, 1.0 / (16 * length))
    for kept, reported, target in zip(measured, report.kept_fraction, RATIOS):
        assert kept == pytest.approx(reported, abs=1e-9)
        assert abs(kept - target) <= tolerance + 1e-9, (measured, RATIOS)


@pytest.mark.parametrize("length", [1, 2])
def test_rows_too_short_for_a_target_are_refused_before_any_forward(length):
    model = route_all(tiny_model("llama"), RATIOS)
    calls = []
    model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ThresholdCalibrationError, match=r"at least 4 real tokens"):
        calibrate_thresholds(model, rows(16, length))
    assert not calls
    assert all(m.causal_threshold is None for m in routed_layers(model))


def test_check_calibration_rows_counts_real_tokens_only():
    ids = torch.randint(4, 128, (2, 10))
    mask = torch.zeros(2, 10, dtype=torch.long)
    mask[0, 8:] = 1  # 2 real tokens
    mask[1, :] = 1  # 10 real tokens
    batch = [{"input_ids": ids, "attention_mask": mask}]
    check_calibration_rows([0.2], batch)  # 2 rows / 12 tokens = 0.17 <= 0.2
    with pytest.raises(ThresholdCalibrationError, match=r"2 calibration rows"):
        check_calibration_rows([0.1], batch)
    check_calibration_rows([0.1], batch, keep_first_token=False)
    check_calibration_rows([1.0], batch)  # a dense layer has no target to miss


def test_cut_for_ratio_cuts_at_the_closest_gap_between_tied_scores():
    scores = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    # keeping 4 of 10 would split the four 2.0s: keep all of them (5) rather than
    # none (1)
    t = cut_for_ratio(scores, 0.4)[0]
    assert int((scores > t).sum()) == 5
    t = cut_for_ratio(scores, 0.2)[0]  # 2 of 10: 1 is as close as 5 is not
    assert int((scores > t).sum()) == 1
    assert cut_for_ratio(scores, 0.0)[0] > 3.0


def test_cut_for_ratio_is_exact_in_the_scores_dtype():
    """Adjacent float32 scores: the midpoint rounds onto one of them in float32."""
    hi = torch.tensor(1.0)
    lo = torch.nextafter(hi, torch.tensor(0.0))
    scores = torch.stack([hi, lo, lo - 1, lo - 2])
    t = cut_for_ratio(scores, 0.25)[0]
    assert int((scores > t).sum()) == 1


def test_whole_layer_ratios_need_no_calibration_pass_and_route_as_targeted():
    """``layer_drop`` leaves only ratios 0 and 1: nothing to fit, so no forward runs,
    and the layers still keep all or none of the tokens under causal routing."""
    model = route_all(tiny_model("llama"), [1.0, 0.0, 1.0, 0.0])
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    report = calibrate_thresholds(model, rows(4, 8))
    handle.remove()
    assert calls == [] and report.passes == 0
    assert report.thresholds == [float("-inf"), float("inf")] * 2
    model.eval()
    assert kept_fraction_by_forward(model, rows(4, 8, seed=1)) == [1.0, 0.0, 1.0, 0.0]


def test_causal_routing_without_a_threshold_names_the_layer():
    model = route_all(tiny_model("llama", len(RATIOS)), RATIOS).eval()
    layer = routed_layers(model)[2]
    layer.routing_mode = "causal"
    with pytest.raises(RuntimeError, match="layer 2 has no causal threshold"):
        with torch.no_grad():
            model(input_ids=torch.randint(4, 128, (1, 12)), use_cache=False)


def test_thresholds_are_fitted_in_one_walk_of_the_layers():
    """Each layer's threshold is fitted on inputs that are final (the layers below are
    fitted first), so one walk is enough: every decoder layer but the top one runs on
    every batch once, besides one pass-through call that records its arguments,
    whatever the depth; the top one is fitted last and never needs to run."""
    model = route_all(tiny_model("llama"), RATIOS)
    batches = rows(8, 8)
    runs = {}

    def count(module, args, kwargs, output):
        runs[module.layer_index] = runs.get(module.layer_index, 0) + 1

    handles = [
        m.register_forward_hook(count, with_kwargs=True) for m in routed_layers(model)
    ]
    report = calibrate_thresholds(model, batches)
    for h in handles:
        h.remove()
    assert report.passes == 1
    assert runs == {i: 2 * len(batches) for i in range(len(RATIOS) - 1)}


def test_threshold_calibration_builds_no_autograd_graph():
    """A gradient-free pass: a layer output that tracks gradients would keep every
    layer's activations alive and cost the backward's bookkeeping on every call."""
    model = route_all(tiny_model("llama"), RATIOS)
    tracked = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        tracked.append(out.requires_grad)

    handles = [m.register_forward_hook(hook) for m in routed_layers(model)]
    calibrate_thresholds(model, rows(4, 8))
    for h in handles:
        h.remove()
    assert tracked and not any(tracked)
