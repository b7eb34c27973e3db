"""Causal thresholds fitted inside the skip-path walk (``fit_skip_paths(...,
fit_thresholds=True)``): the same thresholds a walk of their own fits on the finished
model, without that walk."""

import pytest
import torch
from test_routing import route_all
from test_skip_path import batches, run
from test_skip_path import tiny_dir as tiny_dir  # noqa: F401  (the module fixture)
from tiny_models import tiny_model

import adadsf_modifier.fitting.skip_fields as skip_fields
from adadsf_modifier.fitting import RouterRefit, calibrate_thresholds, fit_skip_paths
from adadsf_modifier.routing import routed_layers

#: a routed layer at 1.0 (no map, still a threshold), two partly routed, one removed
RATIOS = [1.0, 0.5, 0.0, 0.6]


def _thresholds(model) -> list[float]:
    return [float(m.causal_threshold) for m in routed_layers(model)]


def _maps(model) -> dict[int, dict[str, torch.Tensor]]:
    return {
        m.layer_index: {k: v.clone() for k, v in m.skip_path.state_dict().items()}
        for m in routed_layers(model)
        if 0.0 < m.retention_ratio < 1.0
    }


@pytest.mark.parametrize("kv", [True, False])
@pytest.mark.parametrize("refit", [True, False])
def test_thresholds_fitted_in_the_skip_walk_are_those_a_walk_of_their_own_fits(
    kv, refit
):
    torch.manual_seed(0)
    model = route_all(tiny_model("llama", 4), RATIOS)
    for layer in routed_layers(model):
        layer.skipped_tokens_kv = kv
    data = batches()
    report = fit_skip_paths(
        model, data, rank=4, ridge=0.1, fit_thresholds=True,
        refit_routers=RouterRefit(64, 20) if refit else None,
    )  # fmt: skip
    walked = report.thresholds
    assert walked is not None and walked.layer_indices == [0, 1, 2, 3]
    assert _thresholds(model) == walked.thresholds
    maps = _maps(model)

    # the reference: the separate walk on the finished model (whose kept fractions
    # a forward reproduces: test_routing_thresholds)
    ref = calibrate_thresholds(model, data)
    torch.testing.assert_close(walked.thresholds, ref.thresholds)
    assert walked.kept_fraction == ref.kept_fraction
    assert walked.kept_fraction == pytest.approx(RATIOS, abs=0.01)
    # each map is fit on the tokens its threshold skips, on inputs routed by the
    # thresholds below: what a plain fit gives on the finished model
    fit_skip_paths(model, data, rank=4, ridge=0.1)
    for i, m in _maps(model).items():
        for k in m:
            torch.testing.assert_close(m[k], maps[i][k], atol=1e-6, rtol=1e-5)


def test_the_skip_walk_fits_no_thresholds_unless_asked():
    model = route_all(tiny_model("llama", 4), RATIOS)
    assert fit_skip_paths(model, batches(1), rank=4).thresholds is None
    assert all(m.causal_threshold is None for m in routed_layers(model))


def test_whole_layers_only_leave_the_thresholds_to_their_own_check():
    model = route_all(tiny_model("llama", 3), [1.0, 0.0, 1.0])
    report = fit_skip_paths(model, batches(1), rank=4, fit_thresholds=True)
    assert report.thresholds is None


def test_without_alignment_the_modifier_fits_thresholds_in_the_skip_walk(
    tiny_dir,  # noqa: F811
    monkeypatch,
):
    """``align_steps: 0``: nothing trains after the skip-path walk, so the modifier
    takes its thresholds from it and runs no threshold walk; a forward of the result
    keeps each layer's ratio on the calibration data."""

    def no_walk(*args, **kwargs):
        raise AssertionError("a separate threshold walk ran")

    with monkeypatch.context() as m:
        m.setattr(skip_fields, "calibrate_thresholds", no_walk)
        model, mod = run(tiny_dir, skip_path="ridge", skip_path_rank=4,
                         skipped_tokens_kv=True, router_init="skip_error")  # fmt: skip
    report = mod.threshold_report
    assert report.layer_indices == [1, 2, 3]
    assert _thresholds(model) == report.thresholds
    for kept, target in zip(report.kept_fraction, report.target_ratios):
        assert kept == pytest.approx(target, abs=report.tolerance)
    # the paper's identity skip path has no skip-path walk: a walk of its own
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return calibrate_thresholds(*args, **kwargs)

    monkeypatch.setattr(skip_fields, "calibrate_thresholds", counted)
    run(tiny_dir)
    assert calls == [1]


@pytest.mark.parametrize(
    ("trainable", "walks_of_their_own"), [("routers_and_layers", 0), ("routers", 1)]
)
def test_after_alignment_the_last_skip_walk_fits_the_thresholds(
    tiny_dir,  # noqa: F811
    monkeypatch,
    trainable,
    walks_of_their_own,
):
    """An alignment that trains the layers is followed by a skip-path walk, which then
    fits the thresholds to the trained routers; a routers-only alignment leaves the
    maps as they were, so a threshold walk of its own follows it. Either way the
    thresholds are those a walk on the finished model fits."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return calibrate_thresholds(*args, **kwargs)

    monkeypatch.setattr(skip_fields, "calibrate_thresholds", counted)
    layer_lr = {"align_layer_lr": 1e-2} if trainable != "routers" else {}
    model, mod = run(tiny_dir, skip_path="ridge", skip_path_rank=4,
                     skipped_tokens_kv=True, align_steps=2, align_batch_size=4,
                     align_seq_len=16, align_lr=1e-2, align_trainable=trainable,
                     **layer_lr)  # fmt: skip
    assert len(calls) == walks_of_their_own
    fitted = _thresholds(model)
    ref = calibrate_thresholds(model, [{"input_ids": r} for r in _calibration_rows()])
    torch.testing.assert_close(fitted, ref.thresholds)


def _calibration_rows():
    """The rows :func:`test_skip_path.run` calibrates on, in its batches."""
    from tiny_models import token_dataset

    ids = torch.tensor(token_dataset(16, 48)["input_ids"])
    return list(ids.split(1))
