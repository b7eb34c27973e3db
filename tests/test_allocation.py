"""Allocation formulas, checked against hand computations of the paper's equations."""

import math

import pytest

from adadsf_modifier.fitting.allocation import (
    allocate,
    check_allocation,
    clip_to_budget,
    layer_drop_ratios,
    lowest_ratio_at_most,
    similarity_ratios,
)
from adadsf_modifier.routing.selection import tokens_to_keep

SIMS = [0.62, 0.91, 0.95, 0.97, 0.88, 0.99, 0.93, 0.80]


def _paper_formula(s, t, tau, beta):
    # written out independently of the module, step by step
    m = max(s)
    e = [math.exp((x - m) / tau) for x in s]
    w = [x / sum(e) for x in e]
    wbar = sum(w) / len(w)
    r = [0.05 + 0.9 / (1 + math.exp(-beta * (wbar - x))) for x in w]
    return [t * len(s) / sum(r) * x for x in r]


def test_similarity_formula_matches_paper_equations():
    got = similarity_ratios(SIMS, 0.8, 0.05, 10.0)
    want = _paper_formula(SIMS, 0.8, 0.05, 10.0)
    assert got == pytest.approx(want, abs=1e-12)
    assert sum(got) / len(got) == pytest.approx(0.8, abs=1e-12)


@pytest.mark.parametrize("t", [0.5, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("tau", [0.25, 0.1, 0.05, 0.01])
def test_similarity_allocation_keeps_budget_and_bounds(t, tau):
    r = allocate("similarity", SIMS, t, tau, 10.0, min_retention=0.1)
    assert sum(r) / len(r) == pytest.approx(t, abs=1e-9)
    assert all(0.1 - 1e-12 <= x <= 1.0 for x in r)


def test_clipping_redistributes_excess_like_small_reproduction():
    # 4 layers, one very dissimilar: raw rescale exceeds 1 for three layers
    raw = similarity_ratios([0.90, 0.91, 0.92, 0.999], 0.8, 0.05, 10.0)
    assert max(raw) > 1.0
    r = clip_to_budget(raw, 0.8, 0.05)
    assert r[:3] == pytest.approx([1.0, 1.0, 1.0])
    assert r[3] == pytest.approx(0.2, abs=1e-9)


def test_lower_similarity_gets_more_tokens():
    r = allocate("similarity", SIMS, 0.8, 0.05, 10.0, 0.1)
    order_s = sorted(range(len(SIMS)), key=lambda i: SIMS[i])
    ratios_in_similarity_order = [r[i] for i in order_s]
    assert all(
        a >= b - 1e-12
        for a, b in zip(ratios_in_similarity_order, ratios_in_similarity_order[1:])
    )
    assert r[0] > r[5]  # s=0.62 vs s=0.99


def test_reversed_inverts_the_ranking_with_same_ratios():
    sim = allocate("similarity", SIMS, 0.8, 0.05, 10.0, 0.1)
    rev = allocate("reversed", SIMS, 0.8, 0.05, 10.0, 0.1)
    assert sorted(rev) == pytest.approx(sorted(sim))
    assert rev[5] > rev[0]  # most similar layer now gets the most
    assert sum(rev) / len(rev) == pytest.approx(0.8, abs=1e-9)


def test_random_is_reproducible_with_seed_and_differs_across_seeds():
    a = allocate("random", SIMS, 0.8, 0.05, 10.0, 0.1, seed=3)
    b = allocate("random", SIMS, 0.8, 0.05, 10.0, 0.1, seed=3)
    c = allocate("random", SIMS, 0.8, 0.05, 10.0, 0.1, seed=4)
    assert a == b
    assert a != c
    assert sum(a) / len(a) == pytest.approx(0.8, abs=1e-9)


def test_uniform_and_explicit():
    assert allocate("uniform", SIMS, 0.7, 0.05, 10.0, 0.1) == [0.7] * len(SIMS)
    explicit = [1.0, 0.5] * 4
    assert allocate(explicit, SIMS, 0.7, 0.05, 10.0, 0.1) == explicit
    with pytest.raises(ValueError, match="one ratio per routed decoder layer"):
        allocate([0.5] * 3, SIMS, 0.7, 0.05, 10.0, 0.1)


def test_layer_drop_removes_lowest_block_influence():
    r = layer_drop_ratios(SIMS, 0.75)  # keep 6 of 8: drop the two most similar layers
    assert r == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert sum(r) / len(r) <= 0.75


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(allocation="bogus"), "allocation must be one of"),
        (dict(retention=0.0), r"retention must be in \(0, 1\]"),
        (dict(retention=1.5), r"retention must be in \(0, 1\]"),
        (dict(temperature=0.0), "temperature"),
        (dict(min_retention=0.9, retention=0.8), "min_retention"),
        (dict(beta=-1.0), "beta must be >= 0"),
        (dict(beta=float("nan")), "beta must be >= 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    args = dict(
        allocation="similarity",
        similarities=SIMS,
        retention=0.8,
        temperature=0.05,
        beta=10.0,
        min_retention=0.1,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        allocate(**args)


def test_zero_beta_gives_uniform_ratios():
    assert allocate("similarity", SIMS, 0.7, 0.05, 0.0, 0.1) == pytest.approx(
        [0.7] * len(SIMS)
    )


@pytest.mark.parametrize("retention, n", [(0.1, 4), (0.5, 1), (0.2, 3)])
def test_layer_drop_below_one_layer_is_refused_naming_the_minimum(retention, n):
    sims = SIMS[:n]
    with pytest.raises(ValueError, match=rf"smallest retention it can meet is 1/{n}"):
        allocate("layer_drop", sims, retention, 0.05, 10.0, min(0.1, retention))
    with pytest.raises(ValueError, match="would keep no layer"):
        check_allocation("layer_drop", retention, n)


@pytest.mark.parametrize("retention, n", [(0.25, 4), (0.7, 8), (1.0, 1)])
def test_layer_drop_never_exceeds_the_budget(retention, n):
    ratios = allocate("layer_drop", SIMS[:n], retention, 0.05, 10.0, 0.1)
    assert sum(ratios) / n <= retention + 1e-12
    check_allocation("layer_drop", retention, n)  # feasible: no error


@pytest.mark.parametrize(
    "r, n, k",
    [
        (0.8, 10, 8),
        (0.29, 100, 29),
        (0.5, 1, 1),
        (0.01, 5, 1),
        (1.0, 7, 7),
        (0.5, 0, 0),
        (0.0, 9, 0),
    ],
)
def test_tokens_to_keep(r, n, k):
    assert tokens_to_keep(r, n) == k


@pytest.mark.parametrize("allocation", ["similarity", "reversed", "random", "uniform"])
@pytest.mark.parametrize("retention", [0.05, 0.5, 0.9])
def test_the_lowest_ratio_never_exceeds_what_is_known_before_calibration(
    allocation, retention
):
    bound = lowest_ratio_at_most(allocation, retention)
    ratios = allocate(allocation, SIMS, retention, 0.05, 10.0, min(0.1, retention))
    assert min(ratios) <= bound + 1e-12
    assert lowest_ratio_at_most([0.5, 0.2, 1.0], retention) == 0.2
    assert lowest_ratio_at_most("layer_drop", retention) is None  # whole layers


@pytest.mark.parametrize(
    "fields",
    [dict(retention=1e-9), dict(retention=1e-9, allocation="uniform"),
     dict(retention=0.5, allocation=[0.01, 0.99]), dict(retention=0.02)],
    ids=["tiny_budget", "tiny_uniform", "explicit_tiny_ratio", "below_one_per_row"],
)  # fmt: skip
def test_a_budget_no_row_can_reach_is_refused_before_calibration(
    tmp_path, monkeypatch, fields
):
    """Rows of 16 tokens always run their first token: no layer keeps less than 1/16,
    so these budgets cannot be met; refused before the dense calibration, not after."""
    import torch
    from llmcompressor import oneshot
    from tiny_models import save_tiny_model, token_dataset
    from transformers import AutoModelForCausalLM

    import adadsf_modifier.modifier as modifier_module
    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.constraints import InputError

    def refuse(*args, **kwargs):
        raise AssertionError("the dense calibration ran before the budget was checked")

    monkeypatch.setattr(modifier_module, "run_calibration_batches", refuse)
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(InputError, match="refused before calibration.*cannot reach"):
        oneshot(model=model, recipe=[AdaDSFModifier(**fields)],
                dataset=token_dataset(4, 16), num_calibration_samples=4,
                max_seq_length=16)  # fmt: skip
