"""The quality targets read off the study's runs: ratios to dense, the limit that
applies at the measured FLOPs, and the verdict only with enough seeds."""

from __future__ import annotations

import pytest

from adadsf_lab.study.targets import (
    prefill_of_ideal,
    target_rows,
    target_sentence,
)

DENSE = {"method": "dense", "budget": 1.0, "seed": 0, "ppl_test": 30.0,
         "task_mean": 0.40, "normalized_flops": 1.0}  # fmt: skip


def run(method, seed, ppl, flops, *, task=0.40, align=600.0, prefill=None, budget=0.8):
    r = {"method": method, "budget": budget, "seed": seed, "ppl_test": ppl,
         "normalized_flops": flops, "task_mean": task,
         "align_seconds": align}  # fmt: skip
    if prefill is not None:
        r["speed"] = {
            "cells": [
                {
                    "kind": "decode",
                    "batch_size": 1,
                    "seq_len": 128,
                    "fraction_of_ideal": 0.1,
                },
                {
                    "kind": "prefill",
                    "batch_size": 8,
                    "seq_len": 1024,
                    "fraction_of_ideal": 0.2,
                },
                {
                    "kind": "prefill",
                    "batch_size": 1,
                    "seq_len": 1024,
                    "fraction_of_ideal": prefill,
                },
            ]  # fmt: skip
        }
    return r


def test_ratio_to_dense_is_averaged_per_seed_and_held_to_the_limit_at_its_flops():
    # ratios 1.04, 1.09, 1.14 -> mean 1.09; sd 0.05; t(2) = 4.302653
    runs = [run("adadsf", s, 30.0 * r, 0.84) for s, r in enumerate((1.04, 1.09, 1.14))]
    (row,) = target_rows(DENSE, runs)
    assert row["ppl_ratio"]["mean"] == pytest.approx(1.09)
    assert row["ppl_ratio"]["ci95"] == pytest.approx(4.302653 * 0.05 / 3**0.5, 1e-5)
    assert (row["max_flops"], row["max_ratio"]) == (0.85, 1.10)
    assert row["ppl_met"] is True  # the mean, not every seed
    runs[2]["ppl_test"] = 30.0 * 1.18  # mean 1.10333
    (row,) = target_rows(DENSE, runs)
    assert row["ppl_met"] is False
    assert "missed by 0.003" in target_sentence(row)


def test_the_looser_limit_applies_at_lower_flops_and_none_above_085():
    runs = [run("uniform", s, 36.0, 0.74) for s in range(3)]  # 1.20x
    runs += [run("adadsf", s, 31.0, 0.90, align=0.0) for s in range(3)]
    rows = {r["method"]: r for r in target_rows(DENSE, runs)}
    assert (rows["uniform"]["max_ratio"], rows["uniform"]["ppl_met"]) == (1.30, True)
    assert rows["adadsf"]["max_ratio"] is None and rows["adadsf"]["ppl_met"] is None
    text = target_sentence(rows["adadsf"])
    assert "no target above 0.85 FLOPs; no alignment;" in text
    assert rows["adadsf"]["task_met"] is None  # the task limit goes with a PPL target


def test_fewer_than_three_seeds_are_reported_but_not_judged():
    runs = [run("adadsf", s, 33.3, 0.84, align=2000.0) for s in range(2)]  # 1.11x
    (row,) = target_rows(DENSE, runs)
    assert not row["judged"] and row["n_seeds"] == 2
    assert row["ppl_met"] is None and row["align_met"] is None
    text = target_sentence(row)
    assert "(0.840 measured FLOPs, 2 seeds, not judged: fewer than 3)" in text
    assert "limit 1.10 at <= 0.85 FLOPs (0.010 over so far)" in text
    assert "alignment 33.3 min at most (limit 30);" in text  # no verdict


def test_alignment_tasks_and_prefill_each_have_their_own_verdict():
    runs = [
        run("adadsf", 0, 30.0, 0.84, task=0.39, align=1700.0, prefill=0.95),
        run("adadsf", 1, 30.0, 0.84, task=0.375, align=1900.0, prefill=0.91),
        run("adadsf", 2, 30.0, 0.84, task=0.38, align=1500.0, prefill=0.90),
    ]
    (row,) = target_rows(DENSE, runs)
    assert row["align_seconds_max"] == 1900.0 and row["align_met"] is False
    assert row["task_mean_diff"]["mean"] == pytest.approx(-0.055 / 3)
    assert row["task_met"] is True  # 1.8 points under: within 2
    assert row["prefill_of_ideal"]["mean"] == pytest.approx(0.92)
    assert row["prefill_met"] is True
    text = target_sentence(row)
    assert "alignment 31.7 min at most (limit 30): over" in text
    assert "7-task mean -1.8 points vs dense (limit -2): met" in text
    assert "0.92 of its FLOPs ideal (target 0.9): met" in text


def test_prefill_fraction_is_read_from_the_batch1_seq1024_cell_only():
    assert prefill_of_ideal(run("adadsf", 0, 30.0, 0.8, prefill=0.77)) == 0.77
    assert prefill_of_ideal(run("adadsf", 0, 30.0, 0.8)) is None


def test_no_dense_run_no_targets():
    assert target_rows(None, [run("adadsf", 0, 30.0, 0.8)]) == []


def test_alignment_time_is_kept_per_machine_when_the_seeds_ran_on_several():
    runs = [
        run("adadsf", s, 30.0, 0.84, align=a) for s, a in enumerate((3000, 1600, 1700))
    ]
    runs[0]["hardware"] = {"cpu": "AMD EPYC", "summary": "AMD EPYC, 2 CPUs"}
    for r in runs[1:]:
        r["hardware"] = {"cpu": "Intel Xeon", "summary": "Intel Xeon, 2 CPUs"}
    (row,) = target_rows(DENSE, runs)
    assert row["align_seconds_max_by_machine"] == {"AMD EPYC": 3000, "Intel Xeon": 1700}
    assert (
        row["align_seconds_max"] == 3000 and row["align_met"] is False
    )  # every machine
    text = target_sentence(row)
    assert "alignment 50.0 min at most (AMD EPYC: 50.0; Intel Xeon: 28.3)" in text
    runs[0]["hardware"] = runs[1]["hardware"]  # one machine: no breakdown
    assert "at most (limit 30)" in target_sentence(target_rows(DENSE, runs)[0])
