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
from test_causal_routing import incremental_logits, left_padded
from test_routing import positions
from tiny_models import DISTINCT_ARCHITECTURES, save_tiny_model, token_dataset
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


def compress_tiny(
    tmp_path, name: str, num_layers: int, model=None, arch="llama", **fields
):
    """A tiny model (Llama by default) through ``oneshot`` with the shipped recipe
    ``name``, its ``AdaDSFModifier`` block changed by ``fields`` and 2 alignment steps
    (CPU time only)."""
    if model is None:
        path = save_tiny_model(arch, str(tmp_path / arch), num_layers=num_layers)
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


@pytest.mark.parametrize("arch", DISTINCT_ARCHITECTURES)
def test_the_variant_recipe_builds_fitted_skip_paths_and_keeps_keys_values(
    tmp_path, arch
):
    """The shipped variant on every kind of layer, end to end: a ratio-1 layer needs
    no map; the compressed model decodes from its cache as one full forward does."""
    # a skip-path rank below the tiny model's hidden size (32)
    model = compress_tiny(tmp_path, "adadsf.yaml", 3, arch=arch, skip_path_rank=8)
    layers = routed_layers(model)
    assert len(layers) == 2  # layer 0 stays dense
    assert any(layer.retention_ratio < 1.0 for layer in layers)
    for layer in layers:
        partial = layer.retention_ratio < 1.0
        assert (skip_path_of(layer) is not None) == partial and layer.skipped_tokens_kv
        assert layer.causal_threshold is not None
    ids, mask = left_padded(2, 10)
    model.eval()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=False,
                     position_ids=positions(mask)).logits  # fmt: skip
        inc, _ = incremental_logits(model, ids, mask, prefill=4)
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)


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
