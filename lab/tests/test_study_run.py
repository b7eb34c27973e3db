"""``adadsf study`` end to end on a tiny config-built Llama (real oneshot, perplexity,
FLOPs, lm-eval and speed plumbing, every limit shrunk), and the orchestration (tuning
choice, FLOPs matching, failures, resume) with a stand-in executor."""

from __future__ import annotations

import json
import math

import pytest
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

from adadsf_lab.study.command import main
from adadsf_lab.study.plan import tune_count
from adadsf_lab.study.settings import StudyInputError, StudySettings
from adadsf_lab.study.spec import model_fingerprint
from adadsf_lab.study.study import run_study

TINY = [
    "--set", "calib_samples=4", "--set", "calib_seq_len=32",
    "--set", "router_hidden_size=4", "--set", "router_init_steps=5",
    "--set", "router_init_tokens=64", "--set", "align_steps=2",
    "--set", "align_seq_len=32", "--set", "tune_lrs=1e-3",
    "--set", "tune_temperatures=0.05", "--set", "ppl_tokens=128",
    "--set", "ppl_val_tokens=96", "--set", "ppl_max_length=64",
    "--set", "ppl_stride=32", "--set", "tasks=piqa", "--set", "task_limit=2",
    "--set", "flops_seq_len=32", "--set", "speed_seq_len=32",
    "--set", "speed_batch_sizes=1", "--set", "decode_prompt=8",
    "--set", "decode_tokens=2", "--set", "calib_batch_size=2",
    "--set", "ppl_batch_size=3",
]  # fmt: skip


RUN_KEYS = ("method", "budget", "seed", "normalized_flops",
            "normalized_flops_with_lm_head", "ppl_test", "ppl_val", "tasks", "task_n",
            "align_seconds", "prefill_speedup", "decode_speedup")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("study") / "m"), 8)


def cache_files(root):
    return {p: p.stat().st_mtime_ns for p in root.rglob("*.json")}


def test_quick_study_end_to_end_resumes_and_reuses_the_cache(
    tiny_dir, tmp_path, capsys
):
    out, cache = tmp_path / "docs", tmp_path / "cache"
    argv = ["--quick", "--model", tiny_dir, "--cache-dir", str(cache), "--output-dir",
            str(out), "--methods", "dense,adadsf,uniform,layer_drop", "--budgets",
            "0.8", "--seeds", "2", *TINY,
            "--set", "tune_temperatures=0.05,0.1"]  # fmt: skip
    # 2 tuning runs (tau 0.05, 0.1) + dense + 3 methods x 2 seeds = 9; stop after 3
    # (an interruption)
    assert main([*argv, "--max-runs", "3"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["runtime"]["runs_computed"] == 3 and first["pending"]
    assert "9 runs (2 tuning on validation, 7 main)" in capsys.readouterr().out
    assert len(cache_files(cache)) == 3

    assert main(argv) == 0  # resumes: only the 6 missing runs are computed
    res = json.loads((out / "results.json").read_text())
    assert res["runtime"]["runs_computed"] == 6 and res["runtime"]["runs_cached"] == 3
    assert not res["pending"] and not res["failed"]
    before = cache_files(cache)
    assert len(before) == 9

    assert main(argv) == 0  # everything cached: renders only, rewrites no run
    again = json.loads((out / "results.json").read_text())
    assert (
        again["runtime"]["runs_computed"] == 0 and again["runtime"]["runs_cached"] == 9
    )
    assert cache_files(cache) == before

    # results.json: the documented shape, numbers from the runs
    assert {"dense", "runs", "comparisons", "command", "date", "hardware"} <= set(res)
    assert res["dense"]["normalized_flops"] == pytest.approx(1.0)
    assert len(res["runs"]) == 6
    for run in res["runs"]:
        for key in RUN_KEYS:
            assert key in run, key
        assert run["task_n"] == {"piqa": 2}
        assert 0.0 < run["normalized_flops"] < 1.0
    # FLOPs counted on the perplexity's own tokens (tuning: the validation split's)
    for run in [res["dense"], *res["runs"]]:
        assert run["flops_split"] == "test"
        assert run["flops_tokens"] == res["settings"]["ppl_tokens"]
    for run in res["tuning"]:
        assert run["flops_split"] == "validation"
        assert run["flops_tokens"] == res["settings"]["ppl_val_tokens"]
    speed = {(r["method"], r["seed"]): r["prefill_speedup"] for r in res["runs"]}
    assert speed[("adadsf", 0)] > 0 and speed[("adadsf", 1)] is None  # speed_seeds=1
    drop = [r for r in res["runs"] if r["method"] == "layer_drop"]
    assert all(r["matched_to"] == "AdaDSF measured FLOPs (seed 0)" for r in drop)
    # every run measures perplexity and FLOPs on the texts outside the calibration
    # corpus; token-routed runs check their budget on each offline text (layer
    # removal's cannot drift)
    for run in [res["dense"], *res["runs"]]:
        assert set(run["other_texts"]) == {"science (SciQ)", "code (Python)"}
        for cell in run["other_texts"].values():
            assert math.isfinite(cell["ppl"]) and cell["ppl"] > 1.0
            assert 0.0 < cell["normalized_flops"] <= 1.0
    for run in res["runs"]:
        if run["method"] == "layer_drop":
            assert "budget_per_text" not in run
            continue
        texts = run["budget_per_text"]["texts"]
        assert set(texts) == {"test (prose)", "test (Shakespeare)", "calibration"}
        for modes in texts.values():
            assert set(modes) == {"causal"}
            for cell in modes.values():
                assert 0.0 <= cell["prefill_kept"] <= 1.0
                assert 0.0 <= cell["decode_kept"] <= 1.0
                assert 0.0 < cell["target"] < 1.0
    assert all(r["layers_kept"] < r["num_layers"] for r in drop)
    assert res["tuned"]["source"] == "validation split"
    assert [r["align_lr"] for r in res["tuning"]] == [1e-3, 1e-3]
    assert sorted(r["temperature"] for r in res["tuning"]) == [0.05, 0.1]
    assert {r["align_lr"] for r in res["runs"] if r["method"] != "layer_drop"} == {1e-3}
    pairs = {(c["a"], c["b"], c["metric"]) for c in res["comparisons"]}
    assert ("adadsf", "uniform", "ppl_test") in pairs
    assert ("adadsf", "layer_drop", "task_mean") in pairs
    assert all(c["n_seeds"] == 2 for c in res["comparisons"])
    md = (out / "RESULTS.md").read_text()
    assert "128 test tokens of the perplexity (rows of 32)" in md
    assert "## Budget per text" in md and "128 tokens in rows of 32" in md
    assert "## Quality and compute per text" in md
    for c in res["comparisons"]:
        assert c["verdict"] in md
    for name in ("results_ppl_vs_flops.png", "results_acc_vs_speedup.png",
                 "results_layer_ratios.png"):  # fmt: skip
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_the_w8a8_arm_quantizes_every_decoder_linear_and_no_router(tiny_dir, tmp_path):
    out = tmp_path / "docs"
    argv = ["--model", tiny_dir, "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(out), "--methods", "dense,adadsf,adadsf_w8a8",
            "--budgets", "0.8", "--seeds", "1", "--set", "w8a8_budgets=0.8",
            "--set", "tune=false", "--set", "speed=false", *TINY]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert not res["failed"]
    runs = {r["method"]: r for r in res["runs"]}
    # 8 layers x (q, k, v, o, gate, up, down); routers and lm_head stay unquantized
    assert runs["adadsf_w8a8"]["quantized_modules"] == 8 * 7
    assert runs["adadsf"]["quantized_modules"] == 0
    assert math.isfinite(runs["adadsf_w8a8"]["ppl_test"])
    pairs = {(c["a"], c["b"]) for c in res["comparisons"]}
    assert ("adadsf_w8a8", "adadsf") in pairs


def test_a_dense_control_fine_tunes_dense_as_its_arm_aligns_paired_at_each_budget(
    tiny_dir, tmp_path
):
    out = tmp_path / "docs"
    argv = ["--model", tiny_dir, "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(out), "--methods", "dense,adadsf_lm_only,dense_lm",
            "--budgets", "0.8", "--seeds", "2", "--set", "tune=false",
            "--set", "speed=false", *TINY]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert not res["failed"]
    runs = {(r["method"], r["seed"]): r for r in res["runs"]}
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    # layer 0 is in the study's ignore, as it stays dense in the routed arms
    layer_params = sum(p.numel() for p in model.model.layers[1:].parameters())
    for seed in (0, 1):
        ctl, arm = runs[("dense_lm", seed)], runs[("adadsf_lm_only", seed)]
        assert ctl["budget"] == 1.0 and ctl["normalized_flops"] == pytest.approx(1.0)
        assert ctl["finetuned_parameters"] == layer_params
        for k in ("align_steps_done", "align_lr", "align_layer_lr", "align_tokens"):
            assert ctl[k] == arm[k], k
        assert ctl["ppl_test"] != res["dense"]["ppl_test"]  # it trained
    # each seed's control trains in its seed's order (the tiny tokenizer makes every
    # row the same, so the numbers cannot show it; the configurations do)
    configs = [json.loads(p.read_text())["config"]
               for p in (tmp_path / "cache").rglob("dense_lm/*.json")]  # fmt: skip
    assert sorted(c["finetune"]["seed"] for c in configs) == [0, 1]
    assert all(c["finetune"]["align_loss"] == "lm"
               and c["finetune"]["ignore"] == [r"re:.*layers\.0$"]
               and c["modifier"] is None for c in configs)  # fmt: skip
    pairs = {(c["a"], c["b"], c["budget"], c["n_seeds"]) for c in res["comparisons"]}
    assert ("adadsf_lm_only", "dense_lm", 0.8, 2) in pairs
    # a row of the 0.8 table beside dense, not a budget of its own nor a target row
    md = (out / "RESULTS.md").read_text()
    assert "### Budget 1\n" not in md
    table = md.split("### Budget 0.8")[1].split("##")[0]
    assert "| dense, fine-tuned as AdaDSF, LM loss only | 2 |" in table
    targets = md.split("## Quality targets")[1].split("## Setup")[0]
    assert "fine-tuned" not in targets and "AdaDSF, LM loss only at 0.8" in targets


def fake_executor(calls, fail=()):
    """Stand-in run: PPL depends on lr and method, FLOPs on the retention."""

    def run(spec, env):
        calls.append(spec.label)
        if spec.method in fail:
            raise RuntimeError("boom")
        mod = spec.config["modifier"] or {}
        lr = mod.get("align_lr", 0.0)
        ppl = 30.0 + abs(lr - 3e-4) * 1e4 + (spec.method == "uniform") + spec.seed
        return {
            "phase": spec.phase, "method": spec.method, "budget": spec.budget,
            "seed": spec.seed, "ppl_val": ppl, "ppl_test": ppl, "align_lr": lr,
            "align_layer_lr": mod.get("align_layer_lr"),
            "temperature": mod.get("temperature"), "beta": mod.get("beta"),
            "normalized_flops": mod.get("retention", 1.0) - 0.013, "num_layers": 30,
            "num_routed": 29, "tasks": {}, "task_n": {}, "task_mean": None,
            "seconds": 1.0, **spec.notes,
        }  # fmt: skip

    return run


def test_max_hours_prices_each_run_at_its_own_budgets_alignment_steps(
    tiny_dir, tmp_path
):
    # a budget with its own alignment steps: each run's estimate is looked up at its
    # own budget (a plan keyed otherwise would fail here with a KeyError)
    s = StudySettings(methods=("dense", "uniform"), budgets=(0.8, 0.7), seeds=1,
                      tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                      budget_align_steps={0.7: 1}, align_batch_size=1,
                      align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls), max_hours=1e-6)  # fmt: skip
    # the cost model prices every run above the 3.6 ms left: none starts
    assert calls == [] and len(res["pending"]) == 3
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls), max_hours=10.0)  # fmt: skip
    assert len(calls) == 3 and not res["pending"]


def test_orchestration_tuning_matching_and_failures(tiny_dir, tmp_path):
    s = StudySettings(methods=("dense", "adadsf", "uniform", "layer_drop"),
                      budgets=(0.8,), seeds=2, tune_lrs=(1e-4, 3e-4, 1e-3),
                      tune_temperatures=(0.1, 0.05), calib_samples=2,
                      calib_seq_len=16, align_steps=2, align_batch_size=1,
                      align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls, fail=("uniform",)))  # fmt: skip
    # stage 1: three learning rates; stage 2: tau 0.1 with the best lr (0.05 reused)
    assert calls[:4] == ["tune:adadsf@0.8/seed0"] * 4
    assert (
        res["tuned"]["align_lr"] == 3e-4
        and res["tuned"]["source"] == "validation split"
    )
    drop = [r for r in res["runs"] if r["method"] == "layer_drop"]
    # AdaDSF measured 0.787 -> 24 of 30 layers -> retention 23/29
    assert [r["flops_target"] for r in drop] == pytest.approx([0.787, 0.787])
    assert {round(r["normalized_flops"] + 0.013, 6) for r in drop} == {
        round(23 / 29, 6)
    }
    assert len(res["failed"]) == 2 and all("uniform" in f for f in res["failed"])
    assert (tmp_path / "o" / "RESULTS.md").is_file()
    # the failed runs are retried next time; the others come from the cache
    calls.clear()
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls))  # fmt: skip
    assert calls == ["main:uniform@0.8/seed0", "main:uniform@0.8/seed1"]
    assert not res["failed"] and res["runtime"]["runs_cached"] == 9


def test_a_method_with_fixed_tune_rates_runs_no_tuning_and_trains_at_them(
    tiny_dir, tmp_path
):
    s = StudySettings(methods=("dense", "adadsf", "layer_drop_healed"),
                      tune_methods=("adadsf", "layer_drop_healed"),
                      tune_rates={"layer_drop_healed": [[3e-4, 1e-5]]},
                      budgets=(0.8,), seeds=1, tune_lrs=(1e-4, 3e-4),
                      tune_temperatures=(0.05,), calib_samples=2, calib_seq_len=16,
                      align_steps=2, align_batch_size=1, align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls))  # fmt: skip
    assert [c for c in calls if c.startswith("tune:")] == ["tune:adadsf@0.8/seed0"] * 2
    fixed = {"align_lr": 3e-4, "align_layer_lr": 1e-5, "source": "fixed by tune_rates"}
    assert res["tuned"]["per_method"] == {"layer_drop_healed": fixed}
    healed = [r for r in res["runs"] if r["method"] == "layer_drop_healed"]
    assert [(r["align_lr"], r["align_layer_lr"]) for r in healed] == [(3e-4, 1e-5)]
    md = (tmp_path / "o" / "RESULTS.md").read_text()
    assert "learning rate 0.0003 (layer weights 1e-05) (fixed by tune_rates)" in md


def test_a_quantized_arm_trains_at_its_base_arms_rates_and_is_compared_to_it(
    tiny_dir, tmp_path
):
    s = StudySettings(methods=("dense", "uniform", "adadsf_ridge_kv_err",
                               "adadsf_ridge_kv_err_w8a8"),
                      tune_methods=("uniform", "adadsf_ridge_kv_err"),
                      tune_rates={"uniform": [[1e-3, 1e-3]],
                                  "adadsf_ridge_kv_err": [[1e-4, 1e-5]]},
                      tune_temperatures=(0.05,), budgets=(0.8,), seeds=2,
                      calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    specs = {}
    base = fake_executor(calls)

    def run(spec, env):
        specs[(spec.method, spec.seed)] = spec.config
        return base(spec, env)

    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c", executor=run)
    arm = res["tuned"]["per_method"]["adadsf_ridge_kv_err_w8a8"]
    assert (arm["align_lr"], arm["align_layer_lr"]) == (1e-4, 1e-5)
    assert "the arm it quantizes" in arm["source"]
    for seed in (0, 1):
        q, v = (
            specs[("adadsf_ridge_kv_err_w8a8", seed)],
            specs[("adadsf_ridge_kv_err", seed)],
        )
        assert q["modifier"] == v["modifier"] and q["data"] == v["data"]
        assert q["quantization"]["scheme"] == "W8A8" and v["quantization"] is None
    pairs = {(c["a"], c["b"], c["n_seeds"]) for c in res["comparisons"]}
    assert ("adadsf_ridge_kv_err_w8a8", "adadsf_ridge_kv_err", 2) in pairs


def test_one_candidate_everywhere_spends_no_tuning_run_and_trains_at_it(
    tiny_dir, tmp_path
):
    s = StudySettings(methods=("dense", "uniform", "adadsf_ridge_kv"),
                      tune_methods=("uniform", "adadsf_ridge_kv"),
                      tune_rates={"uniform": [[1e-3, 1e-3]],
                                  "adadsf_ridge_kv": [[1e-4, 1e-4]]},
                      tune_temperatures=(0.05,), budgets=(0.8,), seeds=1,
                      calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    assert tune_count(s) == 0
    calls: list[str] = []
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls))  # fmt: skip
    assert not [c for c in calls if c.startswith("tune:")] and res["tuning"] == []
    tuned = res["tuned"]
    assert (tuned["align_lr"], tuned["align_layer_lr"], tuned["temperature"]) == (
        1e-3, 1e-3, 0.05)  # fmt: skip
    assert tuned["source"] == "the only candidate (no tuning run)"
    lrs = {(r["method"], r["align_lr"], r["temperature"]) for r in res["runs"]}
    assert lrs == {("uniform", 1e-3, 0.05), ("adadsf_ridge_kv", 1e-4, 0.05)}
    # two temperatures to choose from: the tuning runs are back
    two = s.model_copy(update={"tune_temperatures": (0.05, 0.1)})
    assert tune_count(two) == 2


def test_a_variant_tuned_for_itself_trains_at_its_own_rates_and_sets_the_flops(
    tiny_dir, tmp_path
):
    s = StudySettings(methods=("dense", "adadsf", "adadsf_ridge_kv", "layer_drop"),
                      tune_methods=("adadsf", "adadsf_ridge_kv"),
                      flops_reference="adadsf_ridge_kv", budgets=(0.8,), seeds=2,
                      tune_lrs=(1e-4, 3e-4), tune_temperatures=(0.05,),
                      calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    base = fake_executor(calls)

    def run(spec, env):  # the ridge variant is best at 1e-4 and uses fewer FLOPs
        r = base(spec, env)
        if spec.method == "adadsf_ridge_kv":
            r["ppl_val"] = r["ppl_test"] = 30.0 + abs(r["align_lr"] - 1e-4) * 1e4
            r["normalized_flops"] -= 0.02
        return r

    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c", executor=run)
    assert (
        calls[:4]
        == ["tune:adadsf@0.8/seed0"] * 2 + ["tune:adadsf_ridge_kv@0.8/seed0"] * 2
    )
    assert res["tuned"]["align_lr"] == 3e-4
    assert res["tuned"]["per_method"] == {
        "adadsf_ridge_kv": {"align_lr": 1e-4, "align_layer_lr": None}
    }
    lrs = {
        (r["method"], r["align_lr"]) for r in res["runs"] if r["method"] != "layer_drop"
    }
    assert lrs == {("adadsf", 3e-4), ("adadsf_ridge_kv", 1e-4)}
    # the reference runs first in each seed; layer removal matches its FLOPs
    assert calls[5:8] == ["main:adadsf_ridge_kv@0.8/seed0", "main:adadsf@0.8/seed0",
                          "main:layer_drop@0.8/seed0"]  # fmt: skip
    drop = [r for r in res["runs"] if r["method"] == "layer_drop"]
    assert [r["flops_target"] for r in drop] == pytest.approx([0.767, 0.767])
    assert {r["matched_to"] for r in drop} == {
        "AdaDSF + ridge skip path + K/V measured FLOPs (seed 0)"
    }
    md = (tmp_path / "o" / "RESULTS.md").read_text()
    assert "| method | lr | tau | beta | PPL val | FLOPs |" in md
    assert "AdaDSF + ridge skip path + K/V: learning rate 0.0001." in md
    assert "closest to AdaDSF + ridge skip path + K/V's measured FLOPs" in md


def test_every_seed_of_layer_removal_matches_the_reference_of_seed_0(
    tiny_dir, tmp_path
):
    s = StudySettings(methods=("adadsf", "layer_drop"), budgets=(0.8,), seeds=3,
                      tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    base = fake_executor(calls)

    def run(spec, env):  # causal routing's FLOPs move with the seed
        r = base(spec, env)
        r["retention"] = spec.config["modifier"]["retention"]
        if spec.method == "adadsf":
            r["normalized_flops"] = [0.80, 0.73, 0.76][spec.seed]
        return r

    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c", executor=run)
    drop = sorted((r for r in res["runs"] if r["method"] == "layer_drop"),
                  key=lambda r: r["seed"])  # fmt: skip
    assert [r["flops_target"] for r in drop] == [0.80, 0.80, 0.80]
    assert len({r["retention"] for r in drop}) == 1  # the same layers removed


def test_render_only_renders_runs_computed_with_other_versions_and_computes_none(
    tiny_dir, tmp_path, monkeypatch
):
    import adadsf_lab.study.study as study_mod

    s = StudySettings(methods=("dense", "adadsf", "uniform"), budgets=(0.8,), seeds=2,
                      tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    calls: list[str] = []
    run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
              executor=fake_executor(calls))  # fmt: skip
    assert len(calls) == 5
    # another machine (say the GPU that computed the runs) had other versions
    other = {**study_mod.code_versions(), "torch": "0.0-other"}
    monkeypatch.setattr(study_mod, "code_versions", lambda: other)
    calls.clear()
    res = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls), max_runs=0)  # fmt: skip
    assert res["runtime"]["runs_cached"] == 0 and len(res["pending"]) == 5
    res = run_study(s, tiny_dir, tmp_path / "o2", tmp_path / "c",
                    executor=fake_executor(calls), render_only=True)  # fmt: skip
    assert calls == [] and res["runtime"]["runs_cached"] == 5
    assert not res["pending"] and len(res["runs"]) == 4
    assert res["versions"]["torch"] != "0.0-other"  # the computing machine's
    assert res["hardware"]["summary"] and (tmp_path / "o2" / "RESULTS.md").is_file()
    with pytest.raises(StudyInputError, match="no cached run"):
        run_study(s, tiny_dir, tmp_path / "o3", tmp_path / "empty",
                  render_only=True)  # fmt: skip

    # the code gained a modifier field since: rendering still finds the runs (on the
    # settings they share), computing does not reuse them
    import adadsf_lab.study.plan as plan_mod

    old_fields = plan_mod.modifier_fields
    monkeypatch.setattr(plan_mod, "modifier_fields",
                        lambda *a: {**old_fields(*a), "new_field": 1})  # fmt: skip
    res = run_study(s, tiny_dir, tmp_path / "o4", tmp_path / "c",
                    executor=fake_executor(calls), render_only=True)  # fmt: skip
    assert calls == [] and res["runtime"]["runs_cached"] == 5
    # a shared setting that differs (another alignment budget) is not matched
    s2 = s.model_copy(update={"align_steps": 3})
    res = run_study(s2, tiny_dir, tmp_path / "o5", tmp_path / "c",
                    executor=fake_executor(calls), render_only=True)  # fmt: skip
    assert res["runtime"]["runs_cached"] == 1  # only dense (no modifier) matches


def test_a_damaged_cache_file_is_skipped_by_name_and_a_failed_render_leaves_nothing(
    tiny_dir, tmp_path, logged_warnings
):
    """A cache file that is a JSON list, or a run without its versions, is named and
    skipped, not a traceback; a render that fails removes the output folder it made."""
    s = StudySettings(methods=("dense", "uniform"), budgets=(0.8,), seeds=1,
                      tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    cache = tmp_path / "c"
    run_study(s, tiny_dir, tmp_path / "o", cache, executor=fake_executor([]))
    files = sorted(cache_files(cache))
    assert len(files) == 2
    files[0].write_text("[1, 2]")
    data = json.loads(files[1].read_text())
    del data["config"]["versions"]
    files[1].write_text(json.dumps(data))
    with pytest.raises(StudyInputError, match="no cached run"):
        run_study(s, tiny_dir, tmp_path / "o2", cache, render_only=True)
    assert not (tmp_path / "o2").exists()
    skipped = [m for m in logged_warnings if "not a cached run" in m]
    assert {str(f) for f in files} <= {w.split("ignoring ")[1].split(":")[0]
                                       for w in skipped}  # fmt: skip


def test_runs_of_other_weights_are_named_before_any_run_and_recomputed(
    tiny_dir, tmp_path, logged_warnings
):
    """Another machine converted the same model to other bytes: the study says so
    (and which files differ) before computing, and reuses none of those runs."""
    import shutil

    from safetensors.torch import load_file, save_file

    s = StudySettings(methods=("dense", "uniform"), budgets=(0.8,), seeds=1,
                      tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                      align_batch_size=1, align_seq_len=16)  # fmt: skip
    here, there = tmp_path / "a" / "m", tmp_path / "b" / "m"  # same name, two copies
    shutil.copytree(tiny_dir, here)
    shutil.copytree(tiny_dir, there)
    weights = load_file(there / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3  # what another CPU's conversion might give
    save_file(weights, there / "model.safetensors", metadata={"format": "pt"})
    calls: list[str] = []
    messages = logged_warnings
    run_study(s, str(there), tmp_path / "o", tmp_path / "c",
              executor=fake_executor(calls))  # fmt: skip
    assert len(calls) == 2 and not any("other weights" in m for m in messages)
    kept = [json.loads(p.read_text())["record"]["model_files"]
            for p in (tmp_path / "c").rglob("*.json")]  # fmt: skip
    assert kept and all(set(k) >= {"config.json", "model.safetensors"} for k in kept)
    # rendering computes nothing: the other conversion's runs render as computed
    res = run_study(s, str(here), tmp_path / "r", tmp_path / "c",
                    executor=fake_executor(calls), render_only=True)  # fmt: skip
    assert len(calls) == 2 and res["runtime"]["runs_cached"] == 2
    assert res["model"]["fingerprint"] == model_fingerprint(str(there))
    assert any("holds no run of this machine's conversion" in m for m in messages)
    calls.clear()
    res = run_study(s, str(here), tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls))  # fmt: skip
    assert len(calls) == 2 and res["runtime"]["runs_cached"] == 0
    warned = [m for m in messages if "computed from other weights" in m]
    assert len(warned) == 1
    assert "2 cached runs" in warned[0]
    assert "files that differ: model.safetensors" in warned[0]
    assert "config.json" not in warned[0].split("files that differ:")[1]


def test_plan_only_runs_nothing(tiny_dir, tmp_path, capsys):
    calls: list[str] = []
    res = run_study(StudySettings(), tiny_dir, tmp_path / "o", tmp_path / "c",
                    executor=fake_executor(calls), plan_only=True)  # fmt: skip
    assert calls == [] and res["plan"]["runs"] == {"tune": 5, "main": 175}
    assert res["plan"]["estimated_s"] > 0
    assert "180 runs (5 tuning on validation, 175 main)" in capsys.readouterr().out
    assert not (tmp_path / "o" / "results.json").exists()


def test_plan_prints_each_methods_time_per_run_measured_once_runs_are_cached(
    tiny_dir, tmp_path, capsys
):
    s = StudySettings(methods=("dense", "uniform"), budgets=(0.8,), seeds=2,
                      tune_methods=("uniform",),
                      tune_rates={"uniform": ((1e-3, 1e-3),)},  # no tuning run
                      calib_samples=2, calib_seq_len=16,
                      align_steps=2, align_batch_size=1, align_seq_len=16)  # fmt: skip
    before = run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c",
                       executor=fake_executor([]), plan_only=True)  # fmt: skip
    out = capsys.readouterr().out
    assert "uniform                2 runs" in out and "(cost model)" in out
    modelled = before["plan"]["per_run_s"]["uniform"]
    assert modelled > 1.0  # the cost model's seconds, not a measured 1.0
    run_study(s, tiny_dir, tmp_path / "o", tmp_path / "c", executor=fake_executor([]))
    capsys.readouterr()
    after = run_study(s, tiny_dir, tmp_path / "o2", tmp_path / "c",
                      executor=fake_executor([]), plan_only=True)  # fmt: skip
    out = capsys.readouterr().out
    # the fake runs took 1.0 s each: the plan now says so, per method
    assert after["plan"]["per_run_s"] == {"dense": 1.0, "uniform": 1.0}
    assert "mean of 2 finished runs" in out and "mean of 1 finished run)" in out
    runs = after["plan"]["runs"]  # every run, tuning ones too, measured at 1.0 s
    assert after["plan"]["estimated_s"] == pytest.approx(runs["tune"] + runs["main"])


def test_bad_model_path_fails_before_work(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    code = main(["--model", missing, "--output-dir", str(tmp_path / "o"),
                 "--cache-dir", str(tmp_path / "c")])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code == 2 and err.startswith("adadsf study: error:") and "does not exist" in err
    )
    assert err.count("\n") == 1


def quick_run(tiny_dir, tmp_path, method: str, setting: str, *more: str) -> dict:
    """The one run of ``method`` in a quick, untuned study beside dense, with one
    more ``--set`` (and ``more`` arguments); fails on any failed run."""
    out, cache = tmp_path / "docs", tmp_path / "cache"
    argv = ["--quick", "--model", tiny_dir, "--cache-dir", str(cache), "--output-dir",
            str(out), "--methods", f"dense,{method}", "--budgets", "0.8", "--seeds",
            "1", *TINY, "--set", "tune=false", "--set", setting, *more]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert not res["failed"], res["failed"]
    [run] = res["runs"]
    return run


def test_ftp_runs_in_the_study_with_the_shared_settings(tiny_dir, tmp_path):
    run = quick_run(tiny_dir, tmp_path, "ftp", "calib_samples=8")
    assert run["method"] == "ftp" and run["align_steps_done"] == 2  # = align_steps
    assert 0.0 < run["normalized_flops"] < 1.0
    assert run["num_routed"] == len(run["retention_ratios"]) - 1  # layer 0 ignored
    assert run["prefill_speedup"] > 0  # twins reloaded from FTP's own checkpoint


def test_bfloat16_study_runs_end_to_end_in_that_precision(tiny_dir, tmp_path):
    """...and ``--keep-models`` keeps the routed run's checkpoint (not dense's), which
    reloads routed in that precision."""
    import torch

    import adadsf_modifier

    kept = tmp_path / "models"
    run = quick_run(
        tiny_dir, tmp_path, "adadsf", "dtype=bfloat16", "--keep-models", str(kept)
    )
    [folder] = [p for p in kept.glob("*/*/*") if p.is_dir()]
    assert folder.parts[-3:-1] == ("main", "adadsf")
    model = adadsf_modifier.from_pretrained(folder)
    assert adadsf_modifier.routed_layers(model)
    assert next(model.parameters()).dtype == torch.bfloat16
    out, cache = tmp_path / "docs", tmp_path / "cache"
    assert math.isfinite(run["ppl_test"]) and 0.0 < run["normalized_flops"] < 1.0
    configs = [json.loads(p.read_text())["config"] for p in cache.rglob("*.json")]
    assert configs and all(c["dtype"] == "bfloat16" for c in configs)
    assert "model weights in bfloat16" in (out / "RESULTS.md").read_text()


def test_a_kept_checkpoint_is_saved_before_the_runs_measurements(
    tiny_dir, tmp_path, monkeypatch
):
    """A run that fails (or is stopped) while it measures still leaves the model it
    trained in ``--keep-models``: the save comes first."""
    from adadsf_lab.study import runner

    def broken(*args, **kwargs):
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(runner, "measure_perplexity", broken)
    kept, out = tmp_path / "models", tmp_path / "docs"
    argv = ["--quick", "--model", tiny_dir, "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(out), "--methods", "dense,adadsf", "--budgets", "0.8",
            "--seeds", "1", *TINY, "--set", "tune=false", "--keep-models",
            str(kept)]  # fmt: skip
    main(argv)
    failed = json.loads((out / "results.json").read_text())["failed"]
    assert failed  # every run failed in its measurements...
    [folder] = [p for p in kept.glob("*/*/*") if p.is_dir()]
    assert (folder / "adadsf_config.json").exists()  # ...the routed one kept its model
