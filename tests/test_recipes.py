"""The shipped recipes: every one parses; the AdaDSF ones ship the variant the quality
study measured (field for field against the study's own cached run, so a recipe cannot
drift from what its numbers describe), and the paper's AdaDSF stays available."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from llmcompressor import oneshot
from llmcompressor.recipe import Recipe
from tiny_models import save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifiers)
from adadsf_modifier import AdaDSFModifier, routed_layers
from adadsf_modifier.routing.skip_path import skip_path_of

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
VARIANT_RECIPES = ("adadsf.yaml", "adadsf_w8a8.yaml", "adadsf_w4a16.yaml")
# the study's run of the variant these recipes ship (seed 0; docs/study_runs_cpu_...)
MEASURED = ROOT / "docs" / "study_runs_cpu_829b1cc_quality" / "main"
MEASURED_METHOD = "adadsf_ridge_kv_err"


def adadsf_block(name: str) -> dict:
    data = yaml.safe_load((RECIPES / name).read_text())
    return data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_shipped_recipe_instantiates(name):
    recipe = Recipe.create_instance(str(RECIPES / name))
    assert recipe.modifiers


def test_the_adadsf_recipes_ship_one_variant():
    first, *rest = (adadsf_block(name) for name in VARIANT_RECIPES)
    for block in rest:
        assert block == first


def test_the_shipped_variant_is_the_configuration_the_study_measured():
    runs = [
        json.loads(p.read_text()) for p in (MEASURED / MEASURED_METHOD).glob("*.json")
    ]
    # the run RESULTS.md reports (the folder also holds probes at other settings)
    study = json.loads((ROOT / "docs" / "results.json").read_text())["settings"]
    (run,) = [
        r
        for r in runs
        if r["config"]["seed"] == 0
        and r["config"]["budget"] in study["budgets"]
        and r["config"]["modifier"]["align_steps"] == study["align_steps"]
    ]
    measured = run["config"]["modifier"]
    shipped = adadsf_block("adadsf.yaml")
    assert shipped["retention"] == run["config"]["budget"]
    for field, value in shipped.items():
        assert field in measured, f"{field}: not a field of the measured run"
        # YAML lists vs the JSON the study stored
        assert measured[field] == value, field
    # and what the recipe leaves unset is the modifier's default in the measured run
    defaults = AdaDSFModifier(**shipped).model_dump(include=set(measured))
    for field, value in measured.items():
        if field not in shipped and field in defaults:
            assert defaults[field] == value, field


def test_the_paper_recipe_is_the_paper_s_adadsf():
    (mod,) = Recipe.create_instance(str(RECIPES / "adadsf_paper.yaml")).modifiers
    assert isinstance(mod, AdaDSFModifier)
    assert mod.skip_path == "identity" and not mod.skipped_tokens_kv
    assert mod.allocation == "similarity" and mod.route_target == "layer"
    assert mod.align_steps == 0


def test_the_variant_recipe_builds_fitted_skip_paths_and_keeps_keys_values(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"), num_layers=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = yaml.safe_load((RECIPES / "adadsf.yaml").read_text())
    block = data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    block["align_steps"] = 2  # CPU time only
    block["skip_path_rank"] = 8  # below the tiny model's hidden size (32)
    model = oneshot(
        model=model,
        dataset=token_dataset(8, 16),
        recipe=yaml.safe_dump(data),
        num_calibration_samples=8,
        max_seq_length=16,
    )
    layers = routed_layers(model)
    assert len(layers) == 2  # layer 0 stays dense
    for layer in layers:
        assert skip_path_of(layer) is not None and layer.skipped_tokens_kv
        assert layer.causal_threshold is not None
