"""The study's summary of the budget on each offline text (issue 52): kept shares over
seeds beside the plan, whether each mode holds it within the margin on every text and
phase, and rank routing's test perplexity paired against the thresholds' on the same
runs."""

from __future__ import annotations

import pytest

from adadsf_lab.study.budget_per_text import HOLDS_WITHIN, budget_per_text
from adadsf_lab.study.render import _budget_per_text

SIZES = {"tokens": 2048, "seq_len": 512, "prompts": 4, "prompt_len": 64,
         "new_tokens": 32}  # fmt: skip


def run(seed, shares, ppl=None, ppl_rank=None, method="adadsf_ridge_kv_err"):
    """A run record whose check found ``shares[text][mode] = (prefill, decode)``
    against a plan of 0.81."""
    texts = {
        text: {
            mode: {"prefill_kept": p, "decode_kept": d, "target": 0.81}
            for mode, (p, d) in modes.items()
        }
        for text, modes in shares.items()
    }
    return {
        "method": method,
        "budget": 0.81,
        "seed": seed,
        "ppl_test": ppl,
        "ppl_test_rank": ppl_rank,
        "budget_per_text": {"sizes": SIZES, "texts": texts},
    }


def test_a_mode_holds_the_budget_only_within_the_margin_on_every_text_and_phase():
    shares = [
        {
            "prose": {"causal": (0.82, 0.80), "rank": (0.815, 0.82)},
            "Shakespeare": {"causal": (0.80, 0.86 + d), "rank": (0.82, 0.825)},
        }
        for d in (-0.01, 0.01)
    ]
    got = budget_per_text(
        [run(0, shares[0], 30.0, 30.5), run(1, shares[1], 31.0, 31.3)]
    )
    assert got["holds_within"] == HOLDS_WITHIN == 0.02
    held = {h["mode"]: h for h in got["held"]}
    # causal: Shakespeare's decoding keeps 0.86 on average over the two seeds
    assert not held["causal"]["holds"]
    assert held["causal"]["gap"] == pytest.approx(0.05)
    assert (held["causal"]["text"], held["causal"]["phase"]) == (
        "Shakespeare",
        "decode_kept",
    )
    assert held["rank"]["holds"] and held["rank"]["gap"] == pytest.approx(0.015)
    row = next(
        r for r in got["rows"] if (r["text"], r["mode"]) == ("Shakespeare", "causal")
    )
    assert row["seeds"] == [0, 1] and row["target"] == pytest.approx(0.81)
    assert row["decode_kept"]["mean"] == pytest.approx(0.86)
    (rank,) = got["rank_vs_causal"]
    assert rank["mean_diff"] == pytest.approx(0.4) and rank["n_seeds"] == 2
    lines = "\n".join(_budget_per_text({"budget_per_text": got}))
    assert "rank routing: holds within 0.02" in lines
    assert "causal routing: does not hold within 0.02" in lines
    assert rank["verdict"] in lines and "2048 tokens in rows of 512" in lines


def test_runs_without_the_check_are_left_out_and_nothing_is_rendered_for_none():
    old = {"method": "adadsf", "budget": 0.81, "seed": 0, "ppl_test": 30.0}
    got = budget_per_text([old])
    assert got["rows"] == [] and got["held"] == [] and got["rank_vs_causal"] == []
    assert _budget_per_text({"budget_per_text": got}) == []
