"""The AdaDSF recipes ship the configuration the shipped study measures: the modifier
fields the study builds for its variant at the recipe's budget (from the study's own
settings file, ``lab/shipped_study.yaml``) are the recipe's, field for field, so a
recipe cannot drift from what its numbers describe."""

from __future__ import annotations

from pathlib import Path

import yaml

from adadsf_lab.study.arms import modifier_fields, without_retired
from adadsf_lab.study.plan import single_candidate
from adadsf_modifier import AdaDSFModifier

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_METHOD = "adadsf_ridge_kv_err"


def _study_settings():
    from adadsf_lab.study.settings import StudySettings

    data = yaml.safe_load((ROOT / "lab" / "shipped_study.yaml").read_text())
    return StudySettings(**data)


def test_the_shipped_recipe_is_the_variant_the_study_runs():
    s = _study_settings()
    shipped = yaml.safe_load((ROOT / "recipes" / "adadsf.yaml").read_text())
    block = shipped["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    assert SHIPPED_METHOD == s.tune_methods[0]
    tuned = single_candidate(s)  # the study fixes the variant's rates: one candidate
    assert tuned is not None
    # the fields as the modifier takes them (a run's key spells a few the older way)
    fields = modifier_fields(s, SHIPPED_METHOD, block["retention"], 0, tuned)
    measured = without_retired(fields, "adadsf")
    assert block["retention"] in s.budgets
    for field, value in block.items():
        if field == "seed":
            continue
        assert field in measured, f"{field}: not a field the study sets"
        assert measured[field] == value, field
    # what the recipe leaves unset is the modifier's default, as in the study's runs
    defaults = AdaDSFModifier(**block).model_dump(include=set(measured))
    for field, value in measured.items():
        if field not in block and field in defaults and field != "seed":
            assert defaults[field] == value, field


def test_the_layer_removal_recipe_is_the_study_s_healed_layer_removal():
    """``recipes/layer_removal.yaml`` trains as the study's "layer removal + healing"
    arm (its rates fixed by ``tune_rates``), field for field; its retention is its own
    (the study matches that arm's FLOPs to the shipped variant's, the recipe states a
    ratio that keeps as many whole layers on SmolLM2)."""
    from dataclasses import replace

    from adadsf_lab.study.plan import fixed_rates

    s = _study_settings()
    data = yaml.safe_load((ROOT / "recipes" / "layer_removal.yaml").read_text())
    block = data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    rates = fixed_rates(s, "layer_drop_healed")
    assert rates is not None
    tuned = replace(single_candidate(s), per_method={"layer_drop_healed": rates})
    fields = modifier_fields(s, "layer_drop_healed", block["retention"], 0, tuned)
    measured = without_retired(fields, "adadsf")
    for field, value in block.items():
        if field == "seed":
            continue
        assert field in measured, f"{field}: not a field the study sets"
        assert measured[field] == value, field
    # every layer runs all of its tokens or none: no rule picks tokens while healing
    idle = {"seed", "align_routing"}
    defaults = AdaDSFModifier(**block).model_dump(include=set(measured))
    for field, value in measured.items():
        if field not in block and field in defaults and field not in idle:
            assert defaults[field] == value, field


def test_runs_the_current_plug_in_computed_keep_their_keys():
    """Retiring a recipe field must not orphan a cached run: every run of the shipped
    study that today's algorithm versions computed has, field for field, the modifier
    configuration the study builds for it now (a retired field stays in the key at
    its one value, ``arms._RETIRED``), so ``adadsf study`` finds it instead of
    computing it again."""
    import json
    from dataclasses import replace

    from adadsf_lab.study.methods import METHODS
    from adadsf_lab.study.plan import fixed_rates
    from adadsf_modifier.algorithm_versions import ALGORITHM_VERSIONS

    s = _study_settings()
    fixed = {m: fixed_rates(s, m) for m in s.tune_methods}
    per_method = {m: rates for m, rates in fixed.items() if rates is not None}
    tuned = replace(single_candidate(s), per_method=per_method)  # as the study tunes
    checked = 0
    for path in sorted((ROOT / "docs/results/runs/main").glob("*/*.json")):
        data = json.loads(path.read_text())
        config = data["config"]
        method = METHODS.get(config.get("method") or path.parent.name)
        then = config["versions"]["algorithm"]
        current = all(ALGORITHM_VERSIONS[area] == v for area, v in then.items())
        if not current or config.get("modifier") is None or method.modifier != "adadsf":
            continue
        at = s.at_budget(config["budget"])
        mod = config["modifier"]
        built = modifier_fields(at, method.name, mod["retention"], mod["seed"], tuned)
        assert built == mod, path.name
        checked += 1
    assert checked >= 1  # the recompute of issue 66 has started
