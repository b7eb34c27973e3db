"""The fitted skip path (``skip_path: ridge``): the closed-form fit, what skipped tokens
get, cached decoding, the modifier's wiring and refits."""

import pytest
import torch
from llmcompressor import oneshot
from test_causal_routing import incremental_logits, left_padded
from test_kept_attention_kv import layer_calls
from test_routing import batch_with_padding, positions, route_all
from tiny_models import (
    ARCHITECTURES,
    DISTINCT_ARCHITECTURES,
    save_tiny_model,
    tiny_model,
    token_dataset,
)
from transformers import AutoModelForCausalLM

from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.fitting import calibrate_thresholds, fit_skip_paths
from adadsf_modifier.fitting.ridge import (
    RIDGE_GRID,
    RidgeStats,
    choose_ridge,
    fit_ridge,
    held_out_errors,
)
from adadsf_modifier.fitting.skip_fit import load_fit
from adadsf_modifier.routing import SkipPath, original_class, routed_layers

RATIOS = [1.0, 0.5, 0.0, 0.6]


def batches(n=4, rows=4, length=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(4, 128, (rows, length), generator=g)}
        for _ in range(n)
    ]


# ------------------------------------------------------------------------------------
# The fit
# ------------------------------------------------------------------------------------


def test_ridge_fit_is_least_squares_with_an_unpenalised_intercept():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=g, dtype=torch.float64) * 3 + 5
    w = torch.randn(6, 6, generator=g, dtype=torch.float64)
    y = x @ w + 2.0 + 0.1 * torch.randn(500, 6, generator=g, dtype=torch.float64)
    stats = RidgeStats(6)
    for part in range(5):  # accumulated in pieces
        stats.add(x[part * 100 : (part + 1) * 100], y[part * 100 : (part + 1) * 100])
    fit = fit_ridge(stats, ridge=1e-12)
    design = torch.cat([x, torch.ones(500, 1, dtype=torch.float64)], 1)
    ref = torch.linalg.lstsq(design, y).solution
    torch.testing.assert_close(fit.weight.T, ref[:6], rtol=0, atol=1e-6)
    torch.testing.assert_close(fit.bias, ref[6], rtol=0, atol=1e-6)
    pred = x @ fit.weight.T + fit.bias
    r2 = 1 - float(((y - pred) ** 2).sum() / (y**2).sum())
    assert fit.r2 == pytest.approx(r2, abs=1e-9) and fit.tokens == 500


def test_low_rank_fit_projects_onto_the_top_fitted_directions():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(400, 8, generator=g, dtype=torch.float64)
    low = torch.randn(8, 2, generator=g, dtype=torch.float64)
    y = x @ low @ torch.randn(2, 8, generator=g, dtype=torch.float64)  # rank 2
    stats = RidgeStats(8)
    stats.add(x, y)
    full, rank2, rank1 = (fit_ridge(stats, r, 1e-9) for r in (None, 2, 1))
    torch.testing.assert_close(rank2.up @ rank2.down, full.weight, rtol=0, atol=1e-6)
    assert rank2.r2 == pytest.approx(1.0, abs=1e-9)
    assert 0.0 < rank1.r2 < rank2.r2
    skip = SkipPath(8, 2).double()
    load_fit(skip, rank2)
    torch.testing.assert_close(skip(x), x @ full.weight.T + full.bias)
    assert SkipPath.flops_for(10, 8, None) == 2 * 10 * 64
    assert SkipPath.flops_for(10, 8, 2) == 2 * 10 * (2 * 8 * 2)
    with pytest.raises(ValueError, match="rank"):
        SkipPath(8, 8)


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_fitted_skip_path_beats_identity_on_held_out_tokens(arch):
    """On tokens the fit never saw, those the layer skips, ``x + u(x)`` is closer to
    the dense layer's output than ``x`` (the identity skip path), for every routed
    layer. A tiny random layer is barely affine: enough tokens that the margin is not
    luck."""
    model = route_all(tiny_model(arch, 4), RATIOS).eval()
    report = fit_skip_paths(model, batches(12, seed=0))
    assert report.layer_indices == [1, 2, 3]
    assert all(0.0 < r < 1.0 for r in report.r2)
    held = {"input_ids": torch.cat([b["input_ids"] for b in batches(4, seed=1)])}
    calls = layer_calls(model, lambda: model(**held, use_cache=False))
    for layer in routed_layers(model)[1:]:
        x, kwargs, _ = calls[layer.layer_index]
        with torch.no_grad():
            dense = original_class(type(layer)).forward(layer, x, **kwargs)
            skipped = ~layer.selected_mask(x, mode="topk")
            fitted = (x + layer.skip_path(x) - dense)[skipped].pow(2).sum()
        identity = (x - dense)[skipped].pow(2).sum()
        assert float(fitted) < 0.9 * float(identity)


def test_fit_on_skipped_tokens_falls_back_to_all_when_too_few():
    model = route_all(tiny_model("llama", 2), [1.0, 0.9]).eval()
    report = fit_skip_paths(model, batches(1, rows=1, length=40))
    assert report.tokens == [40]  # 4 skipped < hidden 32: every token


# ------------------------------------------------------------------------------------
# What skipped tokens get
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("rank", [None, 4])
def test_skipped_tokens_get_x_plus_the_map_and_kept_tokens_are_unchanged(arch, rank):
    model = route_all(tiny_model(arch, 4), RATIOS).eval()
    ids, mask = batch_with_padding()
    before = layer_calls(model, lambda: model(input_ids=ids, attention_mask=mask,
                                              use_cache=False))  # fmt: skip
    fit_skip_paths(model, batches(), rank=rank)
    calls = layer_calls(model, lambda: model(input_ids=ids, attention_mask=mask,
                                             use_cache=False))  # fmt: skip
    real = mask.bool()
    # the first routed layer sees the same inputs; its kept tokens are unchanged
    x, kwargs, out = calls[1]
    kept = routed_layers(model)[1].selected_mask(x, kwargs.get("attention_mask"))
    expected = torch.where(
        kept.unsqueeze(-1), before[1][2], x + routed_layers(model)[1].skip_path(x)
    )
    torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-6)
    x, _, out = calls[2]  # ratio 0: every real token takes the map
    expected = x + routed_layers(model)[2].skip_path(x)
    torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_decoding_with_skip_path_equals_full_forward(arch, attn, batch):
    model = route_all(tiny_model(arch, 4, attn=attn), [0.8, 0.5, 0.0, 0.6])
    fit_skip_paths(model, batches(), rank=4)
    calibrate_thresholds(model, batches(2, seed=2))
    model.eval()
    ids, mask = left_padded(batch, 12)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]


def test_router_gradient_compares_the_layer_with_the_skip_path():
    """Training: the gate's gradient is ``(layer(x) - (x + u(x))) sigmoid'(s)``, so a
    skip path that matched the layer exactly would give the router nothing to learn."""
    model = route_all(tiny_model("llama", 2), [1.0, 0.5])
    layer = routed_layers(model)[1]
    skip = SkipPath(32)
    layer.add_module("skip_path", skip)
    ids = torch.randint(4, 128, (2, 10))
    model.train()
    model(input_ids=ids).logits.sum().backward()
    g0 = layer.router.fc2.weight.grad.clone()
    layer.router.zero_grad()
    with torch.no_grad():
        skip.bias.fill_(0.5)
    model(input_ids=ids).logits.sum().backward()
    assert not torch.allclose(g0, layer.router.fc2.weight.grad)


# ------------------------------------------------------------------------------------
# The modifier
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "m"), 4)


def run(path, **fields):
    fields = {"retention": 0.7, "ignore": ["re:.*layers\\.0$"], **fields}
    mod = AdaDSFModifier(**fields)
    model = oneshot(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        dataset=token_dataset(16, 48),
        recipe=[mod],
        num_calibration_samples=16,
        max_seq_length=48,
    )
    return model, mod


def test_modifier_fits_skip_paths_and_keeps_the_default_paper_faithful(tiny_dir):
    model, mod = run(tiny_dir, skip_path="ridge", skip_path_rank=8,
                     skipped_tokens_kv=True)  # fmt: skip
    layers = routed_layers(model)
    assert [m.skipped_tokens_kv for m in layers] == [True] * 3
    for m in layers:
        assert isinstance(m.skip_path, SkipPath) and m.skip_path.rank == 8
        assert float(m.skip_path.up.detach().abs().sum()) > 0
    assert mod.skip_path_report.layer_indices == [1, 2, 3]
    plain, mod = run(tiny_dir)
    assert mod.skip_path_report is None
    for m in routed_layers(plain):
        assert "skip_path" not in m._modules and not m.skipped_tokens_kv


def test_retention_one_with_both_variants_equals_dense(tiny_dir):
    from test_modifier import assert_equals_dense

    model, mod = run(tiny_dir, retention=1.0, skip_path="ridge",
                     skipped_tokens_kv=True)  # fmt: skip
    assert all("skip_path" not in m._modules for m in routed_layers(model))
    assert mod.skip_path_report.layer_indices == []
    assert_equals_dense(model, tiny_dir)


def test_rank_above_the_model_fails_before_calibration(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    mod = AdaDSFModifier(retention=0.7, skip_path="ridge", skip_path_rank=32)
    with pytest.raises(ValueError, match="skip_path_rank must be below the hidden"):
        oneshot(model=model, dataset=token_dataset(4, 16), recipe=[mod],
                num_calibration_samples=4, max_seq_length=16)  # fmt: skip
    assert not routed_layers(model)


@pytest.mark.parametrize("trainable,fits", [("routers", 1), ("routers_and_layers", 2)])
def test_skip_paths_are_refit_after_alignment_that_trained_the_layers(
    tiny_dir, monkeypatch, trainable, fits
):
    import adadsf_modifier.fitting.skip_fields as fields

    calls = []
    real_fit = fields.fit_skip_paths
    monkeypatch.setattr(
        fields, "fit_skip_paths", lambda *a, **k: calls.append(1) or real_fit(*a, **k)
    )
    run(tiny_dir, skip_path="ridge", align_steps=1, align_batch_size=2,
        align_seq_len=16, align_trainable=trainable)  # fmt: skip
    assert len(calls) == fits


def test_recipe_that_would_quantize_a_skip_path_is_refused(tiny_dir):
    from llmcompressor.modifiers.gptq import GPTQModifier

    recipe = [
        AdaDSFModifier(retention=0.7, skip_path="ridge"),
        GPTQModifier(targets=["re:.*skip_path$"], scheme="W8A16"),
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"skip path.*re:\.\*skip_path\.\*"):
        oneshot(model=model, dataset=token_dataset(4, 16), recipe=recipe,
                num_calibration_samples=4, max_seq_length=16)  # fmt: skip
    assert not routed_layers(model)


@pytest.mark.parametrize("rank", [None, 3])
def test_auto_ridge_picks_the_penalty_with_the_least_held_out_error(rank):
    """Many noisy dimensions, few tokens: a tiny penalty overfits, so the held-out
    choice is larger; each fold's squared error is computed exactly from its sums, and
    the grid's shared-eigenbasis errors equal fitting each penalty afresh."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 40, generator=g, dtype=torch.float64)
    y = x[:, :1] * 2.0 + torch.randn(60, 40, generator=g, dtype=torch.float64)
    a, b = RidgeStats(40), RidgeStats(40)
    a.add(x[::2], y[::2])
    b.add(x[1::2], y[1::2])
    fit = fit_ridge(a, rank, ridge=0.1)
    direct = float(((y[1::2] - x[1::2] @ fit.matrix - fit.bias) ** 2).sum())
    assert b.squared_error(fit.matrix, fit.bias) == pytest.approx(direct, rel=1e-9)
    chosen = choose_ridge((a, b), rank)
    assert chosen > RIDGE_GRID[0]  # not the smallest: it overfits
    errors = {
        r: sum(t.squared_error(f.matrix, f.bias) for f, t in
               ((fit_ridge(a, rank, r), b), (fit_ridge(b, rank, r), a)))
        for r in RIDGE_GRID
    }  # fmt: skip
    # at rank k the search's directions are float32 (at h = 40 it tracks all of them)
    assert held_out_errors((a, b), rank) == pytest.approx(
        [errors[r] for r in RIDGE_GRID], rel=1e-9 if rank is None else 1e-5
    )
    assert errors[chosen] == min(errors.values())
    model = route_all(tiny_model("llama", 3), [1.0, 0.5, 0.6]).eval()
    report = fit_skip_paths(model, batches(4), ridge="auto")
    assert all(r in RIDGE_GRID for r in report.ridge)


def test_penalty_search_refining_directions_errs_as_fitting_each_penalty_afresh(
    monkeypatch,
):
    """Where the search tracks fewer directions than the width (h = 200, rank 8), a
    penalty after the first refines the previous penalty's directions instead of an
    ``eigh`` of its own: one full ``eigh`` per fold, and held-out errors (and so the
    choice) as fitting each penalty afresh with a full float64 ``eigh``."""
    from adadsf_modifier.fitting import ridge

    g = torch.Generator().manual_seed(3)
    h, k, n = 200, 8, 1200
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    u, w = (torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64))[0]
            for _ in range(2))  # fmt: skip
    noise = torch.randn(n, h, generator=g, dtype=torch.float64)
    y = x @ (u * 0.9 ** torch.arange(h, dtype=torch.float64)) @ w.T + 0.5 * noise
    a, b = RidgeStats(h), RidgeStats(h)
    a.add(x[::2], y[::2])
    b.add(x[1::2], y[1::2])
    errors = [
        sum(t.squared_error(f.matrix, f.bias) for f, t in
            ((fit_ridge(a, k, r), b), (fit_ridge(b, k, r), a)))
        for r in RIDGE_GRID
    ]  # fmt: skip
    full = []
    top = ridge._top_eigenvectors
    monkeypatch.setattr(
        ridge, "_top_eigenvectors", lambda *a, **kw: full.append(1) or top(*a, **kw)
    )
    searched = held_out_errors((a, b), k)
    assert len(full) == 2  # each fold's first penalty
    assert searched == pytest.approx(errors, rel=1e-4)
    assert choose_ridge((a, b), k) == RIDGE_GRID[errors.index(min(errors))]


def test_low_rank_fit_is_the_full_fit_projected_on_its_top_fitted_directions():
    """The rank-k map is ``W V_k V_k^T`` with ``V_k`` the top-k eigenvectors of the
    fitted values' covariance ``W^T C_xx W``, here from a full ``torch.linalg.eigh``."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 12, generator=g, dtype=torch.float64)
    y = x @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    stats = RidgeStats(12)
    stats.add(x, y + 0.1 * torch.randn(200, 12, generator=g, dtype=torch.float64))
    full, low = fit_ridge(stats, None, 1e-2), fit_ridge(stats, 4, 1e-2)
    xc = x - x.mean(0)
    w = full.matrix
    v = torch.linalg.eigh(w.T @ (xc.T @ xc) @ w)[1][:, -4:]
    torch.testing.assert_close(low.matrix, w @ v @ v.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"skip_path": "linear"}, "skip_path"),
        ({"skip_path_rank": 0}, "skip_path_rank.*positive integer"),
        ({"skip_path_ridge": 0}, "skip_path_ridge.*> 0 or 'auto', got 0"),
        ({"skip_path_ridge": "often"}, "skip_path_ridge.*> 0 or 'auto'"),
    ],
)
def test_bad_skip_path_fields_fail_at_construction(kwargs, text):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=f"(?s){text}"):
        AdaDSFModifier(**kwargs)
