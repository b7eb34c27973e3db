"""The study's summaries per text: perplexity and measured FLOPs on each text beside
dense on the same tokens, and the kept share on each offline text beside the plan,
held or not within the margin on every text and phase."""

from __future__ import annotations

import pytest

from adadsf_lab.readme_table import block
from adadsf_lab.study.per_text import (
    HOLDS_WITHIN,
    IN_DOMAIN,
    budget_per_text,
    quality_per_text,
)
from adadsf_lab.study.render import _budget_per_text, _quality_per_text

SIZES = {"tokens": 2048, "seq_len": 512, "prompts": 4, "prompt_len": 64,
         "new_tokens": 32}  # fmt: skip


def run(seed, shares, ppl=None, method="adadsf_ridge_kv_err"):
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
        "budget_per_text": {"sizes": SIZES, "texts": texts},
    }


def test_the_budget_holds_only_within_the_margin_on_every_text_and_phase():
    # rank routing's cells, measured by runs of an earlier plug-in, are left out
    shares = [
        {
            "prose": {"causal": (0.82, 0.80), "rank": (0.5, 0.5)},
            "Shakespeare": {"causal": (0.80, 0.86 + d)},
        }
        for d in (-0.01, 0.01)
    ]
    got = budget_per_text([run(0, shares[0], 30.0), run(1, shares[1], 31.0)])
    assert got["holds_within"] == HOLDS_WITHIN == 0.02
    (held,) = got["held"]
    # Shakespeare's decoding keeps 0.86 on average over the two seeds
    assert not held["holds"] and held["gap"] == pytest.approx(0.05)
    assert (held["text"], held["phase"]) == ("Shakespeare", "decode_kept")
    assert {r["mode"] for r in got["rows"]} == {"causal"}
    row = next(r for r in got["rows"] if r["text"] == "Shakespeare")
    assert row["seeds"] == [0, 1] and row["target"] == pytest.approx(0.81)
    assert row["decode_kept"]["mean"] == pytest.approx(0.86)
    lines = "\n".join(_budget_per_text({"budget_per_text": got}))
    assert "causal routing: does not hold within 0.02" in lines
    assert "2048 tokens in rows of 512" in lines


def test_runs_without_the_check_are_left_out_and_nothing_is_rendered_for_none():
    old = {"method": "adadsf", "budget": 0.81, "seed": 0, "ppl_test": 30.0}
    got = budget_per_text([old])
    assert got["rows"] == [] and got["held"] == []
    assert _budget_per_text({"budget_per_text": got}) == []
    assert quality_per_text(None, [old]) == []
    assert _quality_per_text({"quality_per_text": []}) == []


def measured(method, seed, ppl, other, flops=0.84, sha="a", budget=0.81):
    """A run that measured ``other = {text: ppl}`` beside its in-domain ``ppl``."""
    return {
        "method": method,
        "budget": budget,
        "seed": seed,
        "ppl_test": ppl,
        "normalized_flops": flops,
        "other_texts": {
            text: {
                "ppl": p,
                "tokens": 100,
                "normalized_flops": flops + 0.05,
                "sha256": sha,
            }  # fmt: skip
            for text, p in other.items()
        },
    }


def test_each_text_is_summarised_over_seeds_and_against_dense_on_the_same_tokens():
    dense = measured("dense", 0, 30.0, {"code": 5.0, "science": 13.0}, 1.0, budget=1.0)
    runs = [
        measured("adadsf_ridge_kv_err", 0, 33.0, {"code": 6.0, "science": 14.0}),
        measured("adadsf_ridge_kv_err", 1, 35.0, {"code": 8.0, "science": 14.0}),
        # another token stream (another torch's source): never paired with dense
        measured("uniform", 0, 40.0, {"code": 9.0}, sha="b"),
        {"method": "uniform", "budget": 0.81, "seed": 1, "ppl_test": 50.0},
    ]
    rows = quality_per_text(dense, runs)
    cell = {(r["method"], r["text"]): r for r in rows}
    code = cell[("adadsf_ridge_kv_err", "code")]
    assert code["seeds"] == 2 and code["ppl"]["mean"] == pytest.approx(7.0)
    assert code["x_dense"] == pytest.approx(7.0 / 5.0)
    assert code["ppl"]["ci95"] > 0
    assert code["normalized_flops"]["mean"] == pytest.approx(0.89)
    own = cell[("adadsf_ridge_kv_err", IN_DOMAIN)]
    assert own["x_dense"] == pytest.approx(34.0 / 30.0)
    # the uniform run without the measurement is left out of every uniform row
    assert cell[("uniform", IN_DOMAIN)]["ppl"]["mean"] == pytest.approx(40.0)
    assert cell[("uniform", "code")]["x_dense"] is None
    assert cell[("dense", "code")]["x_dense"] == pytest.approx(1.0)
    md = "\n".join(_quality_per_text({"quality_per_text": rows}))
    assert "## Quality and compute per text" in md and "| 1.40 |" in md


def test_the_readme_table_names_the_worst_other_text_with_its_flops():
    dense = measured("dense", 0, 30.0, {"code": 5.0, "science": 13.0}, 1.0, budget=1.0)
    run0 = measured("adadsf_ridge_kv_err", 0, 33.0, {"code": 6.0, "science": 19.5})
    summary = [
        {"method": m, "budget": r["budget"], "seeds": [0],
         "metrics": {k: {"mean": r[k], "ci95": None}
                     for k in ("ppl_test", "normalized_flops")}
                    | {"task_mean": None}}
        for m, r in (("dense", dense), ("adadsf_ridge_kv_err", run0))
    ]  # fmt: skip
    results = {"summary": summary, "quality_per_text": quality_per_text(dense, [run0])}
    lines = block(results)
    row = next(line for line in lines if "shipped recipe" in line)
    # science: 19.5 / 13 = 1.50 is further above dense than code's 6 / 5 = 1.20
    assert row.endswith("| 1.50 on science (0.890) |")
