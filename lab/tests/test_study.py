"""The results study's pieces without running a model: statistics against hand-computed
values, run identity, the plan, input checks and rendering from results.json."""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import pytest

from adadsf_lab.study.aggregate import build_results
from adadsf_lab.study.arms import finetune_fields, without_retired
from adadsf_lab.study.command import add_study_arguments, build_settings
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.plan import (
    Context,
    Tuned,
    count_runs,
    fixed_rates,
    layer_drop_retention,
    main_specs,
    modifier_fields,
    rate_grid,
    tune_specs,
)
from adadsf_lab.study.render import MARKER, render_markdown
from adadsf_lab.study.settings import StudyInputError, StudySettings
from adadsf_lab.study.spec import RunSpec
from adadsf_lab.study.stats import (
    mean_ci,
    paired_difference,
    resolvable_task_mean_difference,
    t_quantile,
    verdict,
)
from adadsf_lab.study.study import check_output_dir

CTX = Context("tiny", "f" * 64, {"torch": "x"}, "cpu")
TUNED = Tuned(3e-4, 0.05, 10.0, "validation split")


# ------------------------------------------------------------------------ statistics
def test_t_quantiles_match_tables():
    assert t_quantile(1) == pytest.approx(12.7062047, abs=1e-6)
    assert t_quantile(2) == pytest.approx(4.3026527, abs=1e-6)
    assert t_quantile(3) == pytest.approx(3.1824463, abs=1e-6)
    with pytest.raises(ValueError):
        t_quantile(0)


def test_mean_ci_hand_computed():
    # mean 2.5, sd = sqrt(5/3), half-width = t(0.975, 3) * sd / sqrt(4)
    m = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert m.mean == 2.5 and m.n == 4
    assert m.sd == pytest.approx(math.sqrt(5 / 3))
    assert m.ci95 == pytest.approx(3.1824463 * math.sqrt(5 / 3) / 2, abs=1e-6)
    assert m.ci95 == pytest.approx(2.05426026, abs=1e-6)
    one = mean_ci([7.0])
    assert one.mean == 7.0 and one.ci95 is None and one.n == 1
    # missing and non-finite values are left out, not averaged in
    assert mean_ci([1.0, None, math.nan, 3.0]).mean == 2.0
    assert mean_ci([]).n == 0


def test_paired_difference_hand_computed_and_only_common_seeds():
    a = {0: 10.0, 1: 12.0, 2: 11.0, 3: 99.0}  # seed 3 has no partner: ignored
    b = {0: 9.0, 1: 10.0, 2: 12.0}
    d = paired_difference(a, b)
    assert d.seeds == (0, 1, 2) and d.diffs == (1.0, 2.0, -1.0)
    assert d.mean_diff == pytest.approx(2 / 3)
    # sd = sqrt(7/3); half = t(0.975, 2) * sd / sqrt(3)
    assert d.ci95 == pytest.approx(
        4.3026527 * math.sqrt(7 / 3) / math.sqrt(3), abs=1e-6
    )
    assert d.ci95 == pytest.approx(3.79458303, abs=1e-6)
    assert d.p_value == pytest.approx(0.52859548, abs=1e-6)
    assert d.significant is False
    # a constant shift is significant with any number of seeds >= 2
    shifted = paired_difference({0: 5.0, 1: 6.0}, {0: 4.0, 1: 5.0})
    assert shifted.mean_diff == 1.0 and shifted.ci95 == 0.0 and shifted.significant
    assert paired_difference({0: 1.0}, {1: 1.0}) is None
    single = paired_difference({0: 3.0}, {0: 1.0})
    assert (
        single.mean_diff == 2.0 and single.ci95 is None and single.significant is None
    )


def test_paired_differs_from_unpaired():
    """Paired: the shared seed-to-seed variation cancels (here entirely)."""
    a = {0: 10.0, 1: 20.0, 2: 30.0}
    b = {s: v + 1.0 for s, v in a.items()}
    d = paired_difference(a, b)
    assert d.mean_diff == -1.0 and d.ci95 == 0.0 and d.significant
    assert mean_ci(list(a.values())).ci95 > 20  # unpaired intervals overlap widely


def test_verdict_sentences_both_directions():
    d = paired_difference({0: 30.0, 1: 31.0, 2: 29.0}, {0: 33.0, 1: 34.0, 2: 32.5})
    text = verdict("AdaDSF", "uniform", 0.8, "ppl_test", d, lower_is_better=True)
    assert text.startswith("AdaDSF vs uniform at 0.8: test PPL -3.17 ± 0.72 (3 seeds)")
    assert text.endswith("significant: AdaDSF is better")
    text = verdict("uniform", "AdaDSF", 0.8, "ppl_test", paired_difference(
        {0: 33.0, 1: 34.0, 2: 32.5}, {0: 30.0, 1: 31.0, 2: 29.0}), True)  # fmt: skip
    assert text.endswith("significant: AdaDSF is better")
    acc = paired_difference({0: 0.5, 1: 0.6}, {0: 0.55, 1: 0.45})
    text = verdict("a", "b", 0.7, "task_mean", acc, lower_is_better=False)
    assert "(2 seeds), not significant" in text and "mean accuracy +0.050" in text
    one = verdict("a", "b", 0.9, "ppl_test", paired_difference({0: 2}, {0: 1}), True)
    assert "1 seed" in one and "no verdict" in one
    assert "no paired runs" in verdict("a", "b", 0.9, "ppl_test", None, True)


def test_resolvable_difference():
    # one task, n = 100, p = 0.5: 1.96 * sqrt(2) * sqrt(0.25 / 100)
    assert resolvable_task_mean_difference({"t": 100}) == pytest.approx(0.13859038)
    # seven tasks of 1000: sqrt(7 * 0.25 / 1000) / 7 * 1.96 * sqrt(2)
    seven = {f"t{i}": 1000 for i in range(7)}
    expect = 1.959964 * math.sqrt(2) * math.sqrt(7 * 0.25 / 1000) / 7
    assert resolvable_task_mean_difference(seven) == pytest.approx(expect, rel=1e-5)
    assert resolvable_task_mean_difference({"t": 100}, {"t": 0.9}) == pytest.approx(
        1.959964 * math.sqrt(2) * math.sqrt(0.09 / 100), rel=1e-5
    )
    assert resolvable_task_mean_difference({}) is None


def test_examples_needed_to_resolve_two_points_in_the_seven_task_mean():
    from adadsf_lab.study.cost import TASK_SIZES
    from adadsf_lab.study.stats import task_n_to_resolve

    # 1.96^2 * 2 * 0.25 / (7 * 0.02^2) = 685.98 examples per task (by hand)
    seven = {f"t{i}": 100 for i in range(7)}
    need = task_n_to_resolve(seven, 0.02)
    assert need == {t: 686 for t in seven}
    assert resolvable_task_mean_difference(need) <= 0.02
    assert resolvable_task_mean_difference({t: 685 for t in seven}) > 0.02
    assert task_n_to_resolve({}, 0.02) is None
    assert task_n_to_resolve(seven, 0.0) is None
    # the real tasks: arc_challenge, openbookqa and arc_easy have only 299, 500 and
    # 570 examples; the others make up for them, none past its own file
    settings = StudySettings().model_dump(mode="json")  # the 7 tasks
    real = {t: 100 for t in settings["tasks"]}
    need = task_n_to_resolve(real, 0.02, TASK_SIZES)
    assert all(need[t] <= TASK_SIZES[t] for t in real)
    assert {t: need[t] for t in ("arc_challenge", "openbookqa", "arc_easy")} == {
        "arc_challenge": 299,
        "openbookqa": 500,
        "arc_easy": 570,
    }
    assert resolvable_task_mean_difference(need) <= 0.02
    fewer = {t: n - 1 if n < TASK_SIZES[t] else n for t, n in need.items()}
    assert resolvable_task_mean_difference(fewer) > 0.02  # and no fewer would do
    # every example of the seven files resolves 0.0186: 0.018 is out of reach
    assert task_n_to_resolve(real, 0.018, TASK_SIZES) is None
    # RESULTS.md says what 2 points would take where the study's n fall short
    dense = record("dense", 1.0, 0, 30.0, 0.5, 1.0)
    dense["task_n"] = real
    meta = study_meta("c", "h", runs_total=1)
    res = build_results(dense, [], [], TUNED.__dict__, settings, meta)
    assert res["task_resolution"]["task_n_for_wanted"] == need
    md = render_markdown(res)
    assert "Resolving 0.020 the same way would take n = piqa 1296, arc_easy 570" in md
    res["task_resolution"]["task_n_for_wanted"] = None  # as for a wanted 0.018
    assert (
        "out of reach with these tasks' files: all of their examples resolve 0.019"
        in (render_markdown(res))
    )


# ------------------------------------------------------------------------ identity
def test_run_key_is_stable_and_covers_every_field():
    s = StudySettings()
    fields = modifier_fields(s, "adadsf", 0.8, 0, TUNED)
    a = RunSpec.create("main", "adadsf", 0.8, 0, {"modifier": fields})
    b = RunSpec.create("main", "adadsf", 0.8, 0, {"modifier": dict(fields)})
    assert a.key == b.key and len(a.key) == 64
    changed = dict(fields, router_init_steps=fields["router_init_steps"] + 1)
    assert RunSpec.create("main", "adadsf", 0.8, 0, {"modifier": changed}).key != a.key
    assert RunSpec.create("main", "adadsf", 0.8, 1, {"modifier": fields}).key != a.key
    noted = RunSpec.create("main", "adadsf", 0.8, 0, {"modifier": fields}, {"x": 1})
    assert noted.key == a.key  # notes describe a run, they do not define it
    # every AdaDSFModifier field is in the configuration, lifecycle state is not
    assert {"retention", "temperature", "align_w_kl", "router_init_tokens"} <= set(
        fields
    )
    assert "initialized_" not in fields and "align_dataset" not in fields
    # a field the plug-in retired stays in the key at the value every run had, so
    # the runs computed before its retirement are still found; it never reaches the
    # modifier
    assert fields["route_target"] == "layer" and fields["align_anneal_steps"] == 0
    assert "route_target" not in without_retired(fields, "adadsf")
    assert "threshold_passes" not in fields


def test_method_fields():
    s = StudySettings()
    lm = modifier_fields(s, "adadsf_lm_only", 0.8, 1, TUNED)
    assert (lm["align_w_kl"], lm["align_w_hidden"], lm["align_w_lm"]) == (0, 0, 1)
    assert lm["seed"] == 1 and lm["align_seed"] == 1
    # the shipped variant on the LM loss: only the loss weights differ from the variant
    v = modifier_fields(s, "adadsf_ridge_kv_err", 0.8, 1, TUNED)
    v_lm = modifier_fields(s, "adadsf_ridge_kv_err_lm_only", 0.8, 1, TUNED)
    assert {k for k in v if v[k] != v_lm[k]} == {
        "align_w_kl", "align_w_hidden", "align_w_lm"}  # fmt: skip
    assert (v_lm["align_w_kl"], v_lm["align_w_hidden"], v_lm["align_w_lm"]) == (0, 0, 1)
    assert modifier_fields(s, "layer_drop", 0.8, 0, TUNED)["align_steps"] == 0
    healed = modifier_fields(s, "layer_drop_healed", 0.8, 0, TUNED)
    assert (
        healed["align_steps"] == s.align_steps and healed["allocation"] == "layer_drop"
    )
    assert modifier_fields(s, "adadsf_no_align", 0.8, 0, TUNED)["align_steps"] == 0
    for m in ("uniform", "reversed", "random", "adadsf"):
        f = modifier_fields(s, m, 0.8, 0, TUNED)
        assert f["align_lr"] == 3e-4 and f["align_steps"] == s.align_steps


# ------------------------------------------------------------------------ the plan
def test_count_runs_default_study():
    # dense 1 + 18 methods x 3 budgets x 3 seeds + 2 W8A8 arms at 0.8 x 3 seeds + 2
    # dense controls at 1.0 x 3 seeds = 175 main; tuning: 3 learning rates + 3
    # temperatures - the shared default = 5
    assert count_runs(StudySettings()) == {"tune": 5, "main": 175}
    quick = StudySettings(methods=("dense", "adadsf"), budgets=(0.8,), seeds=2)
    assert count_runs(quick) == {"tune": 5, "main": 3}
    assert count_runs(StudySettings(tune=False))["tune"] == 0


def test_cost_model_prices_a_bfloat16_alignment_below_a_float32_one():
    from adadsf_lab.study.cost import cpu_align_seconds, estimate_run_seconds

    fp32, bf16 = StudySettings(), StudySettings(dtype="bfloat16")
    assert cpu_align_seconds(bf16, 135e6) < cpu_align_seconds(fp32, 135e6)
    assert cpu_align_seconds(StudySettings(align_bf16=True), 135e6) == (
        cpu_align_seconds(bf16, 135e6)
    )
    # twice the steps, about twice the price; dense runs do not align at all
    double = StudySettings(align_steps=2 * fp32.align_steps)
    assert cpu_align_seconds(double, 135e6) == pytest.approx(
        2 * cpu_align_seconds(fp32, 135e6)
    )
    for phase in ("tune", "main"):
        dense = estimate_run_seconds(fp32, phase, "dense", 135e6, "cpu")
        assert dense == estimate_run_seconds(bf16, phase, "dense", 135e6, "cpu")


def _aligned_entry(
    method, seconds, tokens, fingerprint="f", device="cpu", dtype="float32"
):
    config = {"method": method, "phase": "main", "device": device, "dtype": dtype,
              "model": {"fingerprint": fingerprint}}  # fmt: skip
    record = {"seconds": 2 * seconds, "align_seconds": seconds, "align_tokens": tokens}
    return {"config": config, "record": record}


def test_cost_model_takes_the_alignment_rate_this_host_measured():
    from adadsf_lab.study.cost import (
        estimate_run_seconds,
        measured_align_rate,
        per_run_estimates,
    )

    s = StudySettings(methods=("dense", "uniform", "adadsf"), budgets=(0.8,))
    # uniform's runs on this host aligned at 2 ms a token; entries of another model,
    # device or dtype, and unaligned runs, say nothing about this host's rate
    cached = [
        _aligned_entry("uniform", 300.0, 150_000),
        _aligned_entry("uniform", 500.0, 250_000),
        _aligned_entry("uniform", 9e9, 1, fingerprint="other"),
        _aligned_entry("uniform", 9e9, 1, device="cuda"),
        _aligned_entry("uniform", 9e9, 1, dtype="bfloat16"),
        _aligned_entry("adadsf_no_align", 9e9, 0),
    ]
    assert measured_align_rate(cached, "f", "cpu", "float32") == pytest.approx(2e-3)
    assert measured_align_rate([], "f", "cpu", "float32") is None
    per_run = per_run_estimates(s, cached, "f", "cpu", 135e6)
    tokens = s.align_steps * s.align_batch_size * s.align_seq_len
    # its own runs' mean seconds (300 and 500 outside alignment), each alignment
    # rescaled to the plan's tokens at the 2 ms a token it measured
    assert per_run[("main", "uniform", 0.8)] == (pytest.approx(400 + tokens * 2e-3), 2)
    modelled = estimate_run_seconds(s, "main", "adadsf", 135e6, "cpu")
    from adadsf_lab.study.cost import cpu_align_seconds

    # adadsf has no finished run: the model's estimate with the measured alignment
    assert per_run[("main", "adadsf", 0.8)] == (
        pytest.approx(modelled - cpu_align_seconds(s, 135e6) + tokens * 2e-3),
        0,
    )


def test_a_budgets_own_alignment_steps_price_its_runs():
    """Finished 100-step runs price a budget's 50-step runs at half their alignment
    (a --max-hours deadline otherwise refuses runs that fit), and the plan's total
    counts each budget's runs at that budget's price."""
    from adadsf_lab.study.cost import (
        method_seconds,
        per_run_estimates,
        plan_seconds,
    )

    s = StudySettings(methods=("dense", "uniform"), budgets=(0.8, 0.7), seeds=2,
                      align_steps=100, align_batch_size=8, align_seq_len=512,
                      budget_align_steps={0.7: 50}, tune=False)  # fmt: skip
    tokens_100 = 100 * 8 * 512
    # one finished 100-step run of uniform: 1000 s of alignment, 500 s of the rest
    cached = [_aligned_entry("uniform", 1000.0, tokens_100)]
    cached[0]["record"]["seconds"] = 1500.0
    per_run = per_run_estimates(s, cached, "f", "cpu", 135e6)
    assert per_run[("main", "uniform", 0.8)] == (pytest.approx(1500.0), 1)
    assert per_run[("main", "uniform", 0.7)] == (pytest.approx(1000.0), 1)
    # two seeds at each budget: the mean of one run is (1500 + 1000) / 2
    assert method_seconds(s, per_run, "uniform") == (pytest.approx(1250.0), 1)
    dense = per_run[("main", "dense", 1.0)][0]
    assert plan_seconds(s, per_run) == pytest.approx(dense + 2 * 1500 + 2 * 1000)


def test_cost_model_prices_ftps_search_and_router_training():
    from adadsf_lab.study.cost import estimate_run_seconds

    def cost(method, rate=1e-3, **kw):
        s = StudySettings(tasks=(), speed=False, **kw)
        return estimate_run_seconds(s, "main", method, 135e6, "cpu", rate)

    # FTP does the calibration and evaluation of an unaligned AdaDSF run, plus its
    # features, genetic search and router training; the training grows with its steps
    # (the study's alignment steps) at the alignment rate, batch 1 x 512 tokens
    assert cost("ftp") > cost("adadsf_no_align")
    assert cost("ftp", align_steps=200) - cost("ftp", align_steps=100) == (
        pytest.approx(100 * 512 * 1e-3)
    )
    steps = StudySettings().align_steps
    assert cost("ftp", rate=2e-3) - cost("ftp") == pytest.approx(steps * 512 * 1e-3)


def test_cost_model_prices_tasks_and_speed_in_main_runs_only():
    from adadsf_lab.study.cost import estimate_run_seconds

    def cost(phase, **kw):
        return estimate_run_seconds(StudySettings(**kw), phase, "adadsf", 135e6, "cpu")

    bare = dict(tasks=(), speed=False)
    for phase in ("tune", "main"):  # tuning runs score neither tasks nor speed
        assert (cost(phase) > cost(phase, **bare)) == (phase == "main")
    # one request per forward costs more than batches of 8 (the CPU default)
    assert (
        cost("main", task_batch_size=1)
        > cost("main")
        == cost("main", task_batch_size=8)
    )
    # the main run counts FLOPs on its test tokens, tuning on its validation tokens
    assert cost("main", ppl_tokens=65536, **bare) > cost("main", **bare)
    assert cost("tune", ppl_tokens=65536) == cost("tune")


def skip_fields(f: dict) -> tuple:
    return f["skip_path"], f["skip_path_rank"], f["skipped_tokens_kv"]


def test_skip_path_methods_pass_their_modifier_fields():
    s = StudySettings()
    f = modifier_fields(s, "adadsf_ridge_kv", 0.8, 0, TUNED)
    assert skip_fields(f) == ("ridge", 64, True)
    assert f["align_steps"] == s.align_steps
    assert (
        modifier_fields(s, "adadsf_ridge_kv_no_align", 0.8, 0, TUNED)["align_steps"]
        == 0
    )
    drop = modifier_fields(s, "layer_drop_ridge", 0.8, 0, TUNED)
    assert drop["allocation"] == "layer_drop" and drop["skip_path"] == "ridge"
    assert drop["align_steps"] == 0 and not drop["skipped_tokens_kv"]
    assert modifier_fields(s, "adadsf", 0.8, 0, TUNED)["skip_path"] == "identity"
    ftp = modifier_fields(s, "ftp_ridge_kv", 0.8, 0, TUNED)
    assert skip_fields(ftp) == ("ridge", 64, True)
    assert ftp["train_steps"] == s.align_steps
    assert modifier_fields(s, "ftp", 0.8, 0, TUNED)["skip_path"] == "identity"


def test_a_quantized_arm_is_its_base_arm_plus_gptq_and_nothing_else():
    s = StudySettings()
    quantized = [m for m in METHODS.values() if m.quantize]
    assert {m.name for m in quantized} >= {"adadsf_w8a8", "adadsf_ridge_kv_err_w8a8"}
    for m in quantized:
        base = METHODS[m.base]
        assert not base.quantize and base.modifier == m.modifier
        assert (m.align, m.lm_loss_only) == (base.align, base.lm_loss_only)
        assert modifier_fields(s, m.name, 0.8, 1, TUNED) == modifier_fields(
            s, base.name, 0.8, 1, TUNED
        )
    # the shipped W8A8 recipe's sparsity stage is the variant's arm
    f = modifier_fields(s, "adadsf_ridge_kv_err_w8a8", 0.8, 0, TUNED)
    assert skip_fields(f) == ("ridge", 64, True) and f["router_init"] == "skip_error"


def test_a_dense_control_trains_with_its_arms_alignment_and_nothing_else():
    from adadsf_lab.study.tuning import _with_bases

    s = StudySettings()
    controls = [m for m in METHODS.values() if m.dense_control]
    assert {m.name: m.base for m in controls} == {
        "dense_lm": "adadsf_lm_only",
        "dense_lm_ridge_kv_err": "adadsf_ridge_kv_err_lm_only",
    }
    own = {"align_lr": 1e-4, "align_layer_lr": 1e-5}
    rates = _with_bases(s, {"adadsf_ridge_kv_err_lm_only": own})
    assert rates["dense_lm_ridge_kv_err"]["source"].endswith("the arm it controls")
    tuned = Tuned(1e-3, 0.05, 10.0, "validation split", 3e-4, per_method=rates)
    for m in controls:
        f = finetune_fields(s, m.name, 2, tuned)
        arm = modifier_fields(s, m.base, 0.8, 2, tuned)
        keys = [f"align_{k}" for k in ("steps", "lr", "layer_lr", "batch_size",
                                       "seq_len", "bf16", "trainable")]  # fmt: skip
        assert {k: f[k] for k in keys} == {k: arm[k] for k in keys}
        assert f["seed"] == arm["align_seed"] == 2
        assert f["align_loss"] == "lm"
        assert f["ignore"] == list(s.ignore)
    shared = finetune_fields(s, "dense_lm", 0, tuned)
    assert shared["align_layer_lr"] == 3e-4  # shared rates
    own = finetune_fields(s, "dense_lm_ridge_kv_err", 0, tuned)
    assert own["align_layer_lr"] == 1e-5
    with pytest.raises(ValueError, match="not a dense control"):
        finetune_fields(s, "dense", 0, tuned)
    # a control is not tuned: it trains as its arm does
    with pytest.raises(ValueError, match="dense control: it trains at the rates of"):
        StudySettings(tune_methods=("adadsf", "dense_lm"))


def test_layer_learning_rate_is_tuned_with_each_rate_and_reaches_the_modifier():
    s = StudySettings(tune_lrs=(3e-4, 1e-3), tune_layer_lrs=(1e-5, 1e-4))
    # stage 1: 2 x 2 rate pairs; stage 2: 3 temperatures, the default one shared
    assert count_runs(s)["tune"] == 4 + 3 - 1
    tuned = Tuned(1e-3, 0.05, 10.0, "validation split", 1e-4)
    f = modifier_fields(s, "layer_drop_healed", 0.8, 0, tuned)
    assert (f["align_lr"], f["align_layer_lr"]) == (1e-3, 1e-4)
    assert modifier_fields(s, "adadsf", 0.8, 0, TUNED)["align_layer_lr"] is None


def test_tune_methods_choose_their_own_rates_with_the_first_ones_tau_and_beta():
    s = StudySettings(
        methods=("dense", "adadsf", "adadsf_ridge_kv", "layer_drop_healed"),
        tune_methods=("adadsf", "adadsf_ridge_kv"),
        tune_lrs=(1e-3,),
        tune_layer_lrs=(1e-4, 1e-3),
    )
    # adadsf: 2 rate pairs + 3 temperatures - the shared default; ridge_kv: 2 pairs
    assert count_runs(s)["tune"] == 2 + 3 - 1 + 2
    base = Tuned(1e-3, 0.1, 5.0, "validation split", 1e-3)
    own = tune_specs(s, CTX, method="adadsf_ridge_kv", base=base)
    assert {x.method for x in own} == {"adadsf_ridge_kv"}
    mods = [x.config["modifier"] for x in own]
    assert [m["align_layer_lr"] for m in mods] == [1e-4, 1e-3]
    assert {(m["temperature"], m["beta"], m["skip_path"]) for m in mods} == {
        (0.1, 5.0, "ridge")
    }
    own_rates = {"adadsf_ridge_kv": {"align_lr": 3e-4, "align_layer_lr": 1e-4}}
    tuned = Tuned(1e-3, 0.1, 5.0, "validation split", 1e-3, own_rates)
    rates = {
        m: (f["align_lr"], f["align_layer_lr"], f["temperature"])
        for m in ("adadsf", "adadsf_ridge_kv", "layer_drop_healed")
        for f in [modifier_fields(s, m, 0.8, 0, tuned)]
    }
    assert rates == {
        "adadsf": (1e-3, 1e-3, 0.1),
        "adadsf_ridge_kv": (3e-4, 1e-4, 0.1),
        "layer_drop_healed": (1e-3, 1e-3, 0.1),  # not listed: the first one's rates
    }


def test_tune_rates_replace_a_methods_grid_and_one_pair_fixes_its_rates():
    s = StudySettings(
        methods=("dense", "adadsf_ridge_kv_err", "uniform", "layer_drop_healed"),
        tune_methods=("adadsf_ridge_kv_err", "uniform", "layer_drop_healed"),
        tune_lrs=(1e-3,),
        tune_layer_lrs=(1e-4, 1e-3),
        tune_temperatures=(0.05,),
        tune_rates={
            "adadsf_ridge_kv_err": [[1e-4, 1e-5], [1e-4, None], [1e-3, 1e-4]],
            "layer_drop_healed": [[1e-3, 1e-3]],
        },  # fmt: skip
    )
    assert rate_grid(s, "adadsf_ridge_kv_err") == [
        (1e-4, 1e-5), (1e-4, None), (1e-3, 1e-4)
    ]  # fmt: skip
    assert rate_grid(s, "uniform") == [(1e-3, 1e-4), (1e-3, 1e-3)]  # the product
    assert fixed_rates(s, "layer_drop_healed") == {
        "align_lr": 1e-3, "align_layer_lr": 1e-3, "source": "fixed by tune_rates"
    }  # fmt: skip
    assert fixed_rates(s, "uniform") is None
    # the first method's three pairs (its one temperature is among them), uniform's
    # two, none for layer removal
    assert count_runs(s)["tune"] == 3 + 2
    mods = [x.config["modifier"] for x in tune_specs(s, CTX)]
    assert [(m["align_lr"], m["align_layer_lr"]) for m in mods] == [
        (1e-4, 1e-5), (1e-4, None), (1e-3, 1e-4)
    ]  # fmt: skip
    assert {m["router_init"] for m in mods} == {"skip_error"}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tune_rates": {"uniform": [[1e-3, None]]}}, "are not among tune_methods"),
        ({"tune_rates": {"adadsf": []}}, "give no rate pair"),
        ({"tune_methods": ("layer_drop_healed",)}, "put a routed method first"),
        ({"tune_methods": ("adadsf", "ftp")}, "'ftp' is not an aligned method"),
        ({"tune_methods": ("adadsf", "layer_drop")}, "is not an aligned method"),
        (
            {"methods": ("dense", "adadsf"), "tune_methods": ("adadsf", "uniform")},
            "tune_methods ['uniform'] are not among the methods",
        ),
        ({"flops_reference": "layer_drop_healed"}, "is not a routed method"),
        ({"flops_reference": "nope"}, "is not a routed method"),
    ],
)
def test_tune_methods_and_flops_reference_are_checked(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StudySettings(**fields)


def test_ablations_run_on_fewer_seeds_after_the_main_methods():
    s = StudySettings(
        methods=("dense", "adadsf", "uniform", "adadsf_no_align"),
        budgets=(0.8,),
        seeds=3,
        ablation_seeds=1,
    )
    assert count_runs(s)["main"] == 1 + 2 * 3 + 1
    specs = list(main_specs(s, CTX, TUNED, lambda budget: None))
    assert [(x.method, x.seed) for x in specs][-2:] == [
        ("uniform", 2),
        ("adadsf_no_align", 0),
    ]
    with pytest.raises(ValueError, match="unknown method"):
        StudySettings(ablation_methods=("nope",))


def test_layer_drop_retention_matches_measured_flops():
    # SmolLM2: 30 layers, layer 0 never routed; AdaDSF measured 0.787 -> keep 24 of 30
    assert layer_drop_retention(0.787, 30, 29) == (23 / 29, 23)
    assert layer_drop_retention(0.70, 30, 29) == (20 / 29, 20)
    assert layer_drop_retention(0.0, 30, 29)[1] == 1  # at least one routed layer
    assert layer_drop_retention(1.2, 30, 29) == (1.0, 29)


def test_main_specs_order_and_layer_drop_matching():
    s = StudySettings(methods=("layer_drop", "uniform", "adadsf", "dense"), seeds=2,
                      budgets=(0.8, 0.9))  # fmt: skip
    refs = {0.8: {"flops": 0.787, "seed": 0, "num_layers": 30, "num_routed": 29}}
    specs = list(main_specs(s, CTX, TUNED, refs.get))
    assert specs[0].method == "dense"
    # the tune budget (0.8) first, one seed at a time, AdaDSF first in each seed
    labels = [(x.budget, x.seed, x.method) for x in specs[1:]]
    assert labels[:6] == [
        (0.8, 0, "adadsf"), (0.8, 0, "layer_drop"), (0.8, 0, "uniform"),
        (0.8, 1, "adadsf"), (0.8, 1, "layer_drop"), (0.8, 1, "uniform"),
    ]  # fmt: skip
    assert [b for b, _, _ in labels[6:]] == [0.9] * 6
    drop08 = [x for x in specs if x.method == "layer_drop" and x.budget == 0.8]
    assert drop08[0].config["modifier"]["retention"] == pytest.approx(23 / 29)
    assert drop08[0].notes["matched_to"] == "AdaDSF measured FLOPs (seed 0)"
    drop09 = [x for x in specs if x.method == "layer_drop" and x.budget == 0.9]
    assert drop09[0].config["modifier"]["retention"] == 0.9  # no reference: nominal
    assert drop09[0].notes["matched_to"] == "nominal budget"
    # speed is measured for the first speed_seeds seeds only
    uni = [x for x in specs if x.method == "uniform" and x.budget == 0.8]
    assert uni[0].config["eval"]["speed"] and uni[1].config["eval"]["speed"] is None
    assert len({x.key for x in specs}) == len(specs)


def test_a_budget_with_its_own_methods_and_steps_keeps_every_other_runs_key():
    """budget_methods / budget_align_steps: the runs at 0.7 are exactly those of a
    50-step study of those methods at 0.7 alone, and every other run keeps the key it
    has without them (a pinned study's cached runs stay found)."""
    base = dict(methods=("dense", "adadsf", "uniform", "layer_drop_healed"), seeds=2,
                budgets=(0.8, 0.7), align_steps=100, tune_budget=0.8)  # fmt: skip
    refs = {b: {"flops": b - 0.01, "seed": 0, "num_layers": 30, "num_routed": 29}
            for b in (0.8, 0.7)}  # fmt: skip
    s = StudySettings(**base, budget_methods={0.7: ("adadsf", "layer_drop_healed")},
                      budget_align_steps={0.7: 50})  # fmt: skip
    specs = list(main_specs(s, CTX, TUNED, refs.get))
    at07 = [x for x in specs if x.budget == 0.7]
    assert {x.method for x in at07} == {"adadsf", "layer_drop_healed"}
    assert {x.config["modifier"]["align_steps"] for x in at07} == {50}
    assert {x.config["data"]["align_rows"] for x in at07} == {50 * 8}
    assert count_runs(s)["main"] == len(specs) == 1 + 3 * 2 + 2 * 2
    plain = StudySettings(**base)
    others = {x.key for x in main_specs(plain, CTX, TUNED, refs.get) if x.budget != 0.7}
    assert {x.key for x in specs if x.budget != 0.7} == others
    alone = StudySettings(**{**base, "budgets": (0.7,), "align_steps": 50,
                             "methods": ("adadsf", "layer_drop_healed")})  # fmt: skip
    assert {x.key for x in at07} == {
        x.key for x in main_specs(alone, CTX, TUNED, refs.get)
    }
    # the tune runs train at the tune budget's steps
    tuned_at = StudySettings(
        **{**base, "tune_budget": 0.7}, budget_align_steps={0.7: 50}
    )
    assert {x.config["modifier"]["align_steps"] for x in tune_specs(tuned_at, CTX)} == {
        50
    }


def test_budget_seeds_cut_a_budgets_seeds_without_touching_any_runs_key():
    """budget_seeds: an int cuts every method at that budget, a dict the methods it
    names; the runs left are exactly (same keys) those of the full plan."""
    base = dict(methods=("dense", "adadsf", "uniform", "layer_drop"), seeds=3,
                budgets=(0.9, 0.8, 0.7), tune_budget=0.8)  # fmt: skip
    refs = {b: {"flops": b - 0.01, "seed": 0, "num_layers": 30, "num_routed": 29}
            for b in (0.9, 0.8, 0.7)}  # fmt: skip
    full = list(main_specs(StudySettings(**base), CTX, TUNED, refs.get))
    s = StudySettings(**base, budget_seeds={0.9: 1, 0.7: {"uniform": 2, "adadsf": 1}})
    specs = list(main_specs(s, CTX, TUNED, refs.get))

    def seeds(method, budget):
        return sorted(x.seed for x in specs if (x.method, x.budget) == (method, budget))

    assert [seeds(m, 0.9) for m in ("adadsf", "uniform", "layer_drop")] == [[0]] * 3
    assert [seeds(m, 0.8) for m in ("adadsf", "uniform")] == [[0, 1, 2]] * 2
    assert seeds("adadsf", 0.7) == [0] and seeds("uniform", 0.7) == [0, 1]
    assert seeds("layer_drop", 0.7) == [0, 1, 2]  # not named: keeps its seeds
    assert count_runs(s)["main"] == len(specs) == 1 + 3 + 9 + 6
    assert {x.key for x in specs} <= {x.key for x in full}
    assert s.seeds_at("adadsf", 0.7) == [0]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"budget_align_steps": {0.6: 50}}, "budget_align_steps: budget(s) [0.6]"),
        ({"budget_seeds": {0.6: 1}}, "budget_seeds: budget(s) [0.6]"),
        (
            {"budget_seeds": {0.7: {"ftp": 1}}},
            "budget_seeds at 0.7: ['ftp'] are not among the methods",
        ),
        (
            {"budget_seeds": {0.7: {"dense": 1, "uniform": 1}}},
            "budget_seeds at 0.7: ['dense'] have no run there",
        ),
        (
            {
                "budget_seeds": {0.7: {"uniform": 1}},
                "budget_methods": {0.7: ("adadsf",)},
            },
            "budget_seeds at 0.7: ['uniform'] have no run there",
        ),
        ({"budget_seeds": {0.7: {}}}, "budget_seeds at 0.7: names no method"),
        ({"budget_methods": {0.6: ("adadsf",)}}, "budget_methods: budget(s) [0.6]"),
        (
            {"budget_methods": {0.8: ("adadsf", "ftp")}},
            "budget_methods at 0.8: ['ftp'] are not among the methods",
        ),
        (
            {
                "methods": ("adadsf_lm_only", "dense_lm"),
                "budget_align_steps": {0.8: 50},
            },
            "budget_align_steps with the dense control(s) ['dense_lm']",
        ),
    ],
)
def test_per_budget_settings_name_only_studied_budgets_and_methods(fields, message):
    base = {"methods": ("dense", "adadsf", "uniform"), "budgets": (0.8, 0.7)}
    with pytest.raises(ValueError, match=re.escape(message)):
        StudySettings(**{**base, **fields})


def test_tune_specs_two_stages():
    s = StudySettings(tune_lrs=(1e-4, 3e-4), tune_temperatures=(0.1, 0.05))
    stage1 = tune_specs(s, CTX)
    assert [x.config["modifier"]["align_lr"] for x in stage1] == [1e-4, 3e-4]
    assert {x.config["eval"]["validation_only"] for x in stage1} == {True}
    stage2 = tune_specs(s, CTX, best_lrs=(3e-4, None))
    assert [x.config["modifier"]["temperature"] for x in stage2] == [0.1, 0.05]
    assert stage2[1].key == stage1[1].key  # the default (tau 0.05) is not run twice


# ------------------------------------------------------------------------ input checks
def parse(*argv):
    p = argparse.ArgumentParser()
    add_study_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "adadsf,nope"], "unknown method(s) ['nope']"),
        (["--budgets", "0.8", "1.5"], "outside (0, 1]"),
        (["--budgets", "0"], "outside (0, 1]"),
        (["--budgets", "abc"], "not a number"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--set", "nope=1"], "expected KEY=VALUE"),
        (["--set", "tasks=piqa,mmlu"], "unknown task(s) ['mmlu']"),
        (["--set", "ppl_stride=1024"], "must not exceed ppl_max_length"),
        (
            ["--budgets", "0.8", "--set", "budget_align_steps={0.7: 50}"],
            "budget_align_steps: budget(s) [0.7] are not among the budgets [0.8]",
        ),
        (
            ["--quick", "--set", "task_limit=0"],
            "task_limit: must be a positive integer",
        ),
    ],
)
def test_bad_input_is_one_clear_line(argv, message):
    with pytest.raises(StudyInputError) as err:
        build_settings(parse(*argv))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_from_arguments():
    s = build_settings(parse("--quick", "--methods", "dense", "uniform", "--budgets",
                             "0.9,0.7", "--set", "task_limit=null", "--set",
                             "speed_batch_sizes=1,2", "--set",
                             "budget_align_steps={0.7: 1}"))  # fmt: skip
    assert s.methods == ("dense", "uniform") and s.budgets == (0.9, 0.7)
    assert s.seeds == 1 and s.task_limit is None and s.speed_batch_sizes == (1, 2)
    assert s.at_budget(0.7).align_steps == 1 and s.at_budget(0.9).align_steps == 2
    assert build_settings(parse()).seeds == 3


def test_output_dir_checks(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StudyInputError, match="not a directory"):
        check_output_dir(blocker, False)
    with pytest.raises(StudyInputError, match="not writable"):
        check_output_dir(blocker / "sub", False)
    theirs = tmp_path / "docs"
    theirs.mkdir()
    (theirs / "RESULTS.md").write_text("# hand-written\n")
    with pytest.raises(StudyInputError, match="--overwrite"):
        check_output_dir(theirs, False)
    assert (theirs / "RESULTS.md").read_text() == "# hand-written\n"
    check_output_dir(theirs, True)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "RESULTS.md").write_text(MARKER + "\nold\n")
    (ours / "results.json").write_text(json.dumps({"generator": "adadsf study"}))
    assert check_output_dir(ours, False) == ours  # a study may re-render its own


# ------------------------------------------------------------------------ rendering
def record(method, budget, seed, ppl, acc, flops):
    return {"method": method, "budget": budget, "seed": seed, "ppl_test": ppl,
            "ppl_test_topk": ppl + 1, "ppl_val": ppl - 1, "task_mean": acc,
            "tasks": {"piqa": acc}, "task_n": {"piqa": 200}, "normalized_flops": flops,
            "normalized_flops_with_lm_head": flops + 0.01, "seconds": 10.0,
            "align_seconds": 5.0}  # fmt: skip


def study_meta(command, hardware, runs_total, computed=0):
    """The run-independent part of ``results.json`` that ``build_results`` is given."""
    return {
        "command": command,
        "date": "2026-11-30",
        "hardware": {"summary": hardware},
        "model": {"name": "tiny", "fingerprint": "ab" * 32},
        "runtime": {
            "this_invocation_s": 1.0,
            "sum_of_runs_s": 60.0,
            "runs_total": runs_total,
            "runs_computed": computed,
            "runs_cached": runs_total - computed,
        },
    }


def test_markdown_numbers_come_from_results_json():
    settings = StudySettings(tasks=("piqa",)).model_dump(mode="json")
    runs = [record("adadsf", 0.8, s, 40.0 + s, 0.5, 0.787) for s in range(3)]
    runs += [record("uniform", 0.8, s, 43.5 + s, 0.48, 0.791) for s in range(3)]
    meta = study_meta("adadsf study --test", "test box", runs_total=6, computed=6)
    res = build_results(None, runs, [], TUNED.__dict__, settings, meta)
    json.dumps(res)  # JSON-able as it stands
    cmp = [c for c in res["comparisons"] if c["metric"] == "ppl_test"][0]
    assert (cmp["a"], cmp["b"], cmp["budget"], cmp["n_seeds"]) == (
        "adadsf",
        "uniform",
        0.8,
        3,
    )
    assert cmp["mean_diff"] == pytest.approx(-3.5) and cmp["ci95"] == 0.0
    md = render_markdown(res)
    assert md.startswith(MARKER)
    assert (
        "AdaDSF (similarity) vs uniform (MoD) at 0.8: test PPL -3.50 ± 0.00 (3 seeds)"
        in md
    )
    assert "adadsf study --test" in md and "test box" in md
    # the adadsf row: FLOPs 0.787 (all seeds equal: ± 0.000), PPL 41.00 ± 2.48
    ppl = res["summary"][0]["metrics"]["ppl_test"]
    assert f"41.00 ± {ppl['ci95']:.2f}" in md
    runs[0]["ppl_test"] = 49.0  # mean of 49, 41, 42
    md2 = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert "44.00 ±" in md2 and "41.00 ±" not in md2


def test_render_with_nothing_finished():
    settings = StudySettings().model_dump(mode="json")
    meta = study_meta("adadsf study", "h", runs_total=81)
    meta["pending"] = ["main:adadsf@0.8/seed0"]
    md = render_markdown(build_results(None, [], [], TUNED.__dict__, settings, meta))
    assert "no paired comparison is available yet" in md
    assert "pending: main:adadsf@0.8/seed0" in md


def test_results_md_gives_a_budgets_own_steps_methods_and_seeds():
    settings = StudySettings(
        tasks=("piqa",), methods=("dense", "adadsf", "uniform"), budgets=(0.8, 0.7),
        align_steps=100, budget_methods={0.7: ("adadsf",)},
        budget_align_steps={0.7: 50}, budget_seeds={0.8: {"uniform": 1}},
    ).model_dump(mode="json")  # fmt: skip
    runs = [record("adadsf", b, s, 40.0, 0.5, b) for b in (0.8, 0.7) for s in range(3)]
    meta = study_meta("adadsf study", "h", runs_total=6)
    md = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert "alignment 100 steps x 8 rows x 512 tokens = 409,600 tokens" in md
    assert "; at budget 0.7 (only `adadsf`): 50 steps (204,800 tokens)" in md
    assert "at budget 0.8, 1 seed for `uniform`: 100 steps" in md
    assert "### Budget 0.7" in md


def test_results_json_carries_the_quality_targets_and_results_md_says_them():
    settings = StudySettings(tasks=("piqa",)).model_dump(mode="json")
    dense = record("dense", 1.0, 0, 30.0, 0.5, 1.0)
    runs = [record("adadsf", 0.8, s, 36.0, 0.5, 0.84) for s in range(3)]  # 1.20x
    meta = study_meta("adadsf study", "h", runs_total=4)
    res = build_results(dense, runs, [], TUNED.__dict__, settings, meta)
    (row,) = res["targets"]
    assert row["ppl_met"] is False and "missed by 0.100" in row["sentence"]
    md = render_markdown(res)
    assert "## Quality targets" in md and row["sentence"] in md


def test_ppl_plot_draws_each_target_over_its_own_flops_range_only():
    from adadsf_lab.study.plots import target_segments

    # PPL_TARGETS: <= 0.75 FLOPs -> 1.30x dense, (0.75, 0.85] -> 1.10x dense
    segs = target_segments(30.0, 0.70, 1.0)
    assert [(a, b, r) for a, b, _, r in segs] == [
        (0.70, 0.75, 1.30),
        (0.75, 0.85, 1.10),
    ]
    assert [y for _, _, y, _ in segs] == pytest.approx([39.0, 33.0])
    # a plot of 0.80-0.95 shows only the 1.10x limit, from its left edge to 0.85
    assert target_segments(30.0, 0.80, 0.95) == [
        (0.80, 0.85, pytest.approx(33.0), 1.10)
    ]
    assert target_segments(30.0, 0.90, 1.0) == []  # no target above 0.85 FLOPs


def test_every_method_has_its_own_look_in_the_plots():
    from adadsf_lab.study.plots import styles

    every = styles(set(METHODS) | {"unregistered"})
    looks = [(tuple(c) if not isinstance(c, str) else c, m) for c, m in every.values()]
    assert len(every) == len(METHODS) + 1 and len(set(looks)) == len(looks)
    assert every["dense"] == ("black", "*")
    # a method keeps its look whatever else a study has, as long as the set is equal
    assert styles({"dense", "adadsf"})["adadsf"] == styles({"adadsf"})["adadsf"]


def test_a_recorded_command_reads_each_option_once_with_the_value_argparse_took():
    import shlex

    from adadsf_lab.study.argv import canonical_command

    # what benchmarks/results_study_829b1cc_render.sh hands the study: the pinned
    # script's arguments, then the wrapper's, then the render's
    raw = (
        "adadsf study --methods dense,uniform --budgets 0.81 --seeds 3 "
        "--set dtype=bfloat16 --set 'tune_rates={uniform: [[1e-3, 1e-3]]}' "
        "--cache-dir /a/cache --output-dir /a/out --methods dense uniform adadsf "
        "--set 'tune_rates={adadsf: [[1e-4, 1e-4]]}' --set w8a8_budgets=0.81 "
        "--output-dir=/b/out --render-only --cache-dir /c/cache --render-only "
        "--set task-limit=50 --meth dense,uniform,adadsf --set ' task_limit=100'"
    )
    canon = canonical_command(raw)
    assert canon == (
        "adadsf study --methods dense,uniform,adadsf --budgets 0.81 --seeds 3 "
        "--set dtype=bfloat16 --set 'tune_rates={adadsf: [[1e-4, 1e-4]]}' "
        "--set w8a8_budgets=0.81 --set ' task_limit=100' --cache-dir /c/cache "
        "--output-dir /b/out --render-only"
    )
    assert canonical_command(canon) == canon

    # the independent reference: the study's own parser reads both alike
    def parsed(command: str) -> tuple[dict, dict]:
        parser = argparse.ArgumentParser()
        add_study_arguments(parser)
        ns = parser.parse_args(shlex.split(command)[2:])
        settings = build_settings(ns).model_dump(mode="json")
        return settings, {k: v for k, v in vars(ns).items() if k != "overrides"}

    assert parsed(canon) == parsed(raw)
    assert parsed(canon)[0]["task_limit"] == 100
    # a value that starts with a dash stays attached to its option
    dashed = canonical_command("adadsf study --output-dir=-out --output-dir=-out2")
    assert dashed == "adadsf study --output-dir=-out2"
    assert parsed(dashed)[1]["output_dir"] == "-out2"
    assert canonical_command("adadsf study --set 'unbalanced") == (
        "adadsf study --set 'unbalanced"
    )


def test_a_multi_valued_option_stays_one_option_in_the_canonical_command():
    from adadsf_lab.study.argv import canonical_command

    # argparse keeps only the last --methods: "a b" must not become two options
    assert canonical_command("adadsf study --methods x --methods a b") == (
        "adadsf study --methods a b"
    )


def test_results_md_states_the_options_its_invocations_share_once():
    from adadsf_lab.study.argv import shared_options

    a = "adadsf study --methods dense,a --seeds 3 --set dtype=bfloat16 --max-hours 1"
    b = "adadsf study --seeds 3 --methods dense,b --set dtype=bfloat16 --set x=1"
    c = "adadsf study --seeds 3 --set dtype=bfloat16"
    common, rest = shared_options([a, b, c])
    assert common == "adadsf study --seeds 3 --set dtype=bfloat16"
    assert rest == [
        "--methods dense,a --max-hours 1",
        "--methods dense,b --set x=1",
        "",
    ]
    # nothing is lost: the shared part and each rest make up each command again
    for cmd, extra in zip([a, b, c], rest):
        assert sorted(f"{common} {extra}".split()) == sorted(cmd.split())
    # unsplittable: nothing shared, the commands whole
    assert shared_options([a, "adadsf study --set 'x"]) == (
        "",
        [a, "adadsf study --set 'x"],
    )

    settings = StudySettings(tasks=("piqa",)).model_dump(mode="json")
    runs = [record("adadsf", 0.8, s, 36.0, 0.5, 0.84) for s in range(3)]
    meta = study_meta("adadsf study --render-only", "box", runs_total=3)
    meta["computed_by"] = [a, b, c]
    md = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert f"- runs computed by 3 invocations of `{common}`, each adding:" in md
    assert "  - `--methods dense,a --max-hours 1`" in md
    assert "  - nothing" in md
    meta["computed_by"] = [a]
    md = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert f"- runs computed by: `{a}`" in md


def test_results_md_names_each_machine_when_the_runs_were_spread_over_several():
    settings = StudySettings(tasks=("piqa",)).model_dump(mode="json")
    runs = [record("adadsf", 0.8, s, 36.0, 0.5, 0.84) for s in range(3)]
    meta = study_meta("adadsf study", "box B", runs_total=3)
    meta["computed_on"] = {"box A": 1, "box B": 2}
    md = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert "- runs computed on: box A (1 run)\n- runs computed on: box B (2 runs)" in md
    meta["computed_on"] = {"box B": 3}  # all here: the hardware line says it
    md = render_markdown(build_results(None, runs, [], TUNED.__dict__, settings, meta))
    assert "runs computed on" not in md


def test_render_says_which_tokens_each_run_counted_its_flops_on():
    from adadsf_lab.study.render import _flops_text

    settings = {"flops_batch": 4, "flops_seq_len": 512}
    new = {"flops_tokens": 32768, "flops_split": "test"}
    old = {}
    first = "the first 4 x 512 test tokens"
    whole = "the 32,768 test tokens of the perplexity (rows of 512)"
    text = _flops_text({"settings": settings, "dense": new, "runs": [new, new]})
    assert text == whole
    text = _flops_text({"settings": settings, "dense": old, "runs": [old]})
    assert text.startswith(first) and "§12" in text
    text = _flops_text({"settings": settings, "dense": new, "runs": [old, old, new]})
    assert text.startswith(whole) and f"2 older cached runs on {first} only" in text


# ------------------------------------------------------------------------ the cache
def test_cache_round_trip_is_atomic_strict_json_and_keyed(tmp_path):
    from adadsf_lab.study.run_cache import RunCache

    cache = RunCache(tmp_path)
    spec = RunSpec.create("main", "uniform", 0.8, 1, {"modifier": {"retention": 0.8}})
    assert cache.get(spec) is None
    path = cache.put(spec, {"ppl_test": float("nan"), "tasks": {"piqa": 0.5}})
    assert path.name == f"{spec.key}.json" and path.parent.name == "uniform"
    assert "NaN" not in path.read_text()  # strict JSON: non-finite -> null
    assert cache.get(spec) == {"ppl_test": None, "tasks": {"piqa": 0.5}}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left
    other = RunSpec.create("main", "uniform", 0.8, 1, {"modifier": {"retention": 0.7}})
    assert cache.get(other) is None
    # a file under the right name but holding another configuration is not trusted
    cache.path_for(other).write_text(path.read_text())
    assert cache.get(other) is None
    path.write_text("{truncated")
    assert cache.get(spec) is None


def test_under_a_deadline_no_run_starts_that_would_not_finish_before_it(tmp_path):
    from adadsf_lab.study.run_cache import RunCache
    from adadsf_lab.study.study import _Runner

    def spec(method: str, seed: int) -> RunSpec:
        return RunSpec.create("main", method, 0.8, seed, {"modifier": {"x": 1}})

    cost = {"layer_drop": 60.0, "adadsf": 3600.0}  # estimated seconds per run
    ran: list[str] = []

    def executor(s, env):
        ran.append(s.label)
        return {"method": s.method, "seed": s.seed}

    runner = _Runner(RunCache(tmp_path), None, 4, time.time() + 600.0, None,
                     executor, {}, estimate=lambda s: cost[s.method])  # fmt: skip
    assert runner.run(spec("layer_drop", 0)) is not None  # 60 s fits in 600
    assert runner.run(spec("adadsf", 0)) is None  # an hour does not: not started
    assert runner.stopped
    # nor does a cheap run after it start: the plan's order is kept
    assert runner.run(spec("layer_drop", 1)) is None
    assert ran == [spec("layer_drop", 0).label]
    assert runner.pending == [spec("adadsf", 0).label, spec("layer_drop", 1).label]
    # a finished run is still read from the cache after the stop
    assert runner.run(spec("layer_drop", 0)) == {"method": "layer_drop", "seed": 0}


def test_layer_removal_without_its_flops_reference_is_warned_before_it_runs():
    from adadsf_lab.study.plan import nominal_budget_warning

    with_ref = StudySettings(methods=("dense", "adadsf", "layer_drop"), budgets=(0.8,))
    assert nominal_budget_warning(with_ref) is None
    alone = StudySettings(methods=("dense", "layer_drop", "layer_drop_healed"),
                          budgets=(0.8,), flops_reference="adadsf")  # fmt: skip
    warning = nominal_budget_warning(alone)
    assert "layer_drop@0.8, layer_drop_healed@0.8 keep the layers" in warning
    assert "flops_reference adadsf does not run" in warning
    # the reference left out at one budget only: only that budget's runs are named
    part = StudySettings(methods=("dense", "adadsf", "layer_drop"), budgets=(0.8, 0.7),
                         budget_methods={0.7: ("layer_drop",)})  # fmt: skip
    assert nominal_budget_warning(part).startswith("layer_drop@0.7 keep")
