"""The shipped recipes: every one parses; the AdaDSF ones ship one variant (the one the
study measures: ``lab/tests/test_shipped_recipe.py``), and the paper's AdaDSF stays
available."""

from __future__ import annotations

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


def test_the_paper_recipe_is_the_paper_s_adadsf():
    (mod,) = Recipe.create_instance(str(RECIPES / "adadsf_paper.yaml")).modifiers
    assert isinstance(mod, AdaDSFModifier)
    assert mod.skip_path == "identity" and not mod.skipped_tokens_kv
    assert mod.allocation == "similarity"
    assert mod.align_steps == 0


def compress_tiny(tmp_path, name: str, num_layers: int, model=None, **fields):
    """A tiny Llama through ``oneshot`` with the shipped recipe ``name``, its
    ``AdaDSFModifier`` block changed by ``fields`` and 2 alignment steps (CPU time
    only)."""
    if model is None:
        path = save_tiny_model("llama", str(tmp_path / "llama"), num_layers=num_layers)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = yaml.safe_load((RECIPES / name).read_text())
    data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"].update(
        align_steps=2, **fields
    )
    return oneshot(
        model=model,
        dataset=token_dataset(8, 16),
        recipe=yaml.safe_dump(data),
        num_calibration_samples=8,
        max_seq_length=16,
    )


def test_the_variant_recipe_builds_fitted_skip_paths_and_keeps_keys_values(tmp_path):
    # a skip-path rank below the tiny model's hidden size (32)
    model = compress_tiny(tmp_path, "adadsf.yaml", 3, skip_path_rank=8)
    layers = routed_layers(model)
    assert len(layers) == 2  # layer 0 stays dense
    for layer in layers:
        assert skip_path_of(layer) is not None and layer.skipped_tokens_kv
        assert layer.causal_threshold is not None


def test_the_layer_removal_recipe_removes_whole_layers_and_heals(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"), num_layers=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = compress_tiny(tmp_path, "layer_removal.yaml", 5, model=model)
    ratios = [layer.retention_ratio for layer in routed_layers(model)]
    assert len(ratios) == 4  # layer 0 stays
    assert sorted(ratios) == [0.0, 1.0, 1.0, 1.0]  # floor(0.83 x 4) = 3 kept whole
    healed = [n for n, p in model.named_parameters() if n in before and not
              torch.equal(p, before[n])]  # fmt: skip
    assert any(".mlp." in n for n in healed)  # the kept layers' weights trained
