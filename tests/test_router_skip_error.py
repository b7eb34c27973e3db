"""``router_init: skip_error``: each router refit to its layer's skip-path error, then
the map refit on the tokens the new router skips (``fitting.skip_fit``)."""

import math

import pytest
import torch
from test_routing import route_all
from test_skip_path import batches, run
from test_skip_path import tiny_dir as tiny_dir  # noqa: F401  (the module fixture)
from tiny_models import DISTINCT_ARCHITECTURES, tiny_model

from adadsf_modifier.fitting import RouterRefit, fit_skip_paths
from adadsf_modifier.fitting.warm_start import (
    rank_correlation,
    skip_error_target,
    warm_start_router,
)
from adadsf_modifier.routing import TokenRouter, routed_layers

RATIOS = [1.0, 0.5, 0.0, 0.6]


def _maps(model) -> dict[int, dict[str, torch.Tensor]]:
    return {
        m.layer_index: {k: v.clone() for k, v in m.skip_path.state_dict().items()}
        for m in routed_layers(model)
        if 0.0 < m.retention_ratio < 1.0
    }


def _routers(model) -> dict[int, dict[str, torch.Tensor]]:
    return {
        m.layer_index: {k: v.clone() for k, v in m.router.state_dict().items()}
        for m in routed_layers(model)
        if 0.0 < m.retention_ratio < 1.0
    }


def test_skip_error_target_is_the_standardised_log_error():
    err = torch.tensor([1.0, math.e, math.e**2])
    torch.testing.assert_close(skip_error_target(err), torch.tensor([-1.0, 0.0, 1.0]))
    assert skip_error_target(torch.tensor([0.3])).tolist() == [0.0]


def test_refit_routers_then_refits_each_map_on_the_tokens_the_new_router_skips():
    torch.manual_seed(0)
    model = route_all(tiny_model("llama", 4), RATIOS)
    data = batches()
    before = _routers(model)
    # a fixed penalty: with "auto" the refit keeps the penalty chosen for the first
    # map (choosing it is most of a fit's cost), where a plain fit would choose anew
    report = fit_skip_paths(
        model, data, rank=4, ridge=0.1, refit_routers=RouterRefit(64, 20)
    )
    after = _routers(model)
    # every partly routed layer's router was refit (the removed layer has none to fit)
    assert sorted(after) == [1, 3] and len(report.router_rank_corr) == 2
    for i in after:
        assert any(not torch.equal(before[i][k], after[i][k]) for k in after[i])
    # the maps are those a plain fit gives with the refit routers: fit on the tokens
    # the *new* routers skip, on inputs routed by the refit layers below
    maps = _maps(model)
    fit_skip_paths(model, data, rank=4, ridge=0.1)
    for i, m in _maps(model).items():
        for k in m:
            torch.testing.assert_close(m[k], maps[i][k], atol=1e-6, rtol=1e-5)
    assert _routers(model).keys() == after.keys()


def test_the_refit_map_keeps_the_penalty_chosen_for_the_first_one():
    """With ``ridge: auto`` the penalty is chosen once per layer, on the tokens the
    first router skips (what a plain fit chooses), and the map refit after the router
    keeps it."""
    import copy

    torch.manual_seed(0)
    model = route_all(tiny_model("llama", 4), RATIOS)
    twin = copy.deepcopy(model)
    data = batches()
    plain = fit_skip_paths(twin, data, rank=4)
    refit = fit_skip_paths(model, data, rank=4, refit_routers=RouterRefit(64, 20))
    assert refit.ridge == plain.ridge


def test_a_map_fitted_on_all_tokens_is_not_fitted_again_after_the_router_refit(
    monkeypatch,
):
    """Too few tokens skip for a fit on them (4 < hidden 32), so the map is fitted on
    all real tokens, before the router refit and after it alike: the same tokens and
    penalty, so the walk gathers their statistics once and keeps the first fit, which
    is the map a plain fit on all tokens gives."""
    from adadsf_modifier.fitting import skip_fit

    torch.manual_seed(0)
    model = route_all(tiny_model("llama", 2), [1.0, 0.9])
    data = batches(1, rows=1, length=40)
    gathered = []
    stats = skip_fit._fold_stats
    monkeypatch.setattr(
        skip_fit, "_fold_stats", lambda *a, **kw: gathered.append(1) or stats(*a, **kw)
    )
    report = fit_skip_paths(model, data, rank=4, refit_routers=RouterRefit(64, 20))
    assert report.tokens == [40] and len(gathered) == 1
    maps = _maps(model)
    # the plain fit (no router refit) falls back to all real tokens alike
    fit_skip_paths(model, data, rank=4, ridge=report.ridge[0])
    for i, m in _maps(model).items():
        for k in m:
            torch.testing.assert_close(m[k], maps[i][k], atol=0, rtol=0)


def test_a_router_fit_to_the_skip_error_ranks_held_out_tokens_by_it():
    """The fit itself, on a skip error that depends on the input (random tiny models'
    errors barely do): held-out tokens come out in the error's order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 16, generator=g)
    err = torch.exp(1.5 * x[:, 0] - x[:, 3])  # relative errors span ~e^+-5
    router = TokenRouter(16, 16)
    res = warm_start_router(router, x[:400], skip_error_target(err[:400]), 1, 200)
    with torch.no_grad():
        held = rank_correlation(router(x[400:]), err[400:])
    assert res.heldout_rank_corr > 0.8 and held > 0.8


def test_modifier_refits_routers_to_the_skip_error(tiny_dir):  # noqa: F811
    sim_model, sim = run(tiny_dir, skip_path="ridge", skip_path_rank=4)
    err_model, err = run(tiny_dir, skip_path="ridge", skip_path_rank=4,
                         router_init="skip_error")  # fmt: skip
    assert sim.skip_path_report.router_rank_corr == []
    corr = err.skip_path_report.router_rank_corr
    assert len(corr) == len(err.skip_path_report.layer_indices) == 3
    assert all(-1.0 <= c <= 1.0 for c in corr if math.isfinite(c))
    a, b = _routers(sim_model), _routers(err_model)
    assert any(not torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    # the similarity warm start ran first in both (same report)
    assert [r.heldout_rank_corr for r in sim.warm_start_report] == [
        r.heldout_rank_corr for r in err.warm_start_report
    ]


@pytest.mark.parametrize(
    "fields",
    [{}, {"skip_path": "identity"}],
)
def test_skip_error_init_without_a_fitted_skip_path_fails_before_calibration(
    tiny_dir,  # noqa: F811
    fields,
):
    with pytest.raises(ValueError, match="router_init 'skip_error'"):
        run(tiny_dir, router_init="skip_error", **fields)


def _padded_batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        ids = torch.randint(4, 128, (3, 24), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # left padded
        mask[2, -7:] = 0  # right padded
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.mark.parametrize("arch", ["qwen2", *DISTINCT_ARCHITECTURES])
@pytest.mark.parametrize("padded", [False, True])
def test_walk_outputs_made_from_the_dense_run_fit_the_same_maps_as_running_the_layer(
    monkeypatch, arch, padded
):
    """With skipped tokens' keys/values kept, the skip-path walk makes the next layer's
    inputs from the dense run (kept tokens' dense outputs, skipped ones' x + u(x))
    instead of running the routed layer: every map and router it fits must be those
    of the walk that runs the layer."""
    import adadsf_modifier.fitting.skip_fit as skip_fit

    data = _padded_batches() if padded else batches()

    def fitted(derive: bool):
        torch.manual_seed(0)
        model = route_all(tiny_model(arch, 4), RATIOS)
        for layer in routed_layers(model):
            layer.skipped_tokens_kv = True
        with monkeypatch.context() as m:
            if not derive:
                m.setattr(skip_fit, "kept_tokens_run_densely", lambda layer: False)
            fit_skip_paths(
                model, data, rank=4, ridge="auto", refit_routers=RouterRefit(64, 20)
            )
        return _maps(model), _routers(model)

    maps, routers = fitted(True)
    ref_maps, ref_routers = fitted(False)
    assert maps.keys() == ref_maps.keys() and len(maps) == 2
    for i in maps:
        for name in maps[i]:
            torch.testing.assert_close(maps[i][name], ref_maps[i][name])
        for name in routers[i]:
            torch.testing.assert_close(routers[i][name], ref_routers[i][name])
