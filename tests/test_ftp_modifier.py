"""FTPModifier through llm-compressor's entry points, and its genetic scheduler."""

import copy
from pathlib import Path

import pytest
import torch
import yaml
from llmcompressor import oneshot
from llmcompressor.modifiers.factory import ModifierFactory
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.recipe import Recipe
from pydantic import ValidationError
from tiny_models import save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifiers)
from adadsf_modifier import FTPModifier, routed_layers
from adadsf_modifier.ftp import genetic_schedule, load_ftp

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("ftp") / "m"), 4)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def small_recipe(**overrides) -> str:
    data = yaml.safe_load((RECIPES / "ftp.yaml").read_text())
    body = data["sparsity_stage"]["sparsity_modifiers"]["FTPModifier"]
    body.update(validation_batches=2, ga_population=4, ga_generations=2, train_steps=5)
    body.update(overrides)
    return yaml.safe_dump(data)


def test_registered_and_both_recipes_instantiate():
    assert ModifierFactory._registered_registry["FTPModifier"] is FTPModifier
    (mod,) = Recipe.create_instance(str(RECIPES / "ftp.yaml")).modifiers
    assert isinstance(mod, FTPModifier) and mod.retention == 0.75
    mods = Recipe.create_instance(str(RECIPES / "ftp_w8a8.yaml")).modifiers
    assert [type(m) for m in mods] == [FTPModifier, GPTQModifier]
    assert "re:.*router.*" in mods[1].ignore
    text = Recipe.from_modifiers([FTPModifier(schedule=[0.5, 1.0])]).yaml()
    (again,) = Recipe.create_instance(text).modifiers
    assert again.schedule == [0.5, 1.0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(retention=0.0), "retention"),
        (dict(retention=0.5, min_retention=0.6), "min_retention"),
        (dict(ga_population=1), "ga_population"),
        (dict(schedule=[0.5, 1.5]), "schedule"),
        (dict(lr=-1.0), "lr"),
        (dict(train_routing="topk"), "train_routing"),
    ],
)
def test_bad_fields_fail_with_one_line_errors(kwargs, field):
    with pytest.raises(ValidationError) as err:
        FTPModifier(**kwargs)
    assert field in str(err.value)


def test_oneshot_routes_meets_budget_keeps_weights_and_reloads(llama_dir, tmp_path):
    model = load(llama_dir)
    reference = copy.deepcopy(model.state_dict())
    oneshot(model=model, recipe=small_recipe(), dataset=token_dataset(8, 16),
            num_calibration_samples=8, max_seq_length=16,
            output_dir=str(tmp_path))  # fmt: skip
    layers = routed_layers(model)
    assert [m.layer_index for m in layers] == [1, 2, 3]  # layer 0 ignored
    ratios = [m.retention_ratio for m in layers]
    assert sum(ratios) / 3 == pytest.approx(0.75, abs=1e-9)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    assert all(".router." in k for k in set(state) - set(reference))
    again = load_ftp(tmp_path, dtype=torch.float32)
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = (m(input_ids=ids, use_cache=False).logits for m in (model, again))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_explicit_schedule_of_wrong_length_fails_before_work(llama_dir):
    model = load(llama_dir)
    with pytest.raises(ValueError, match="schedule lists 2 ratios for 4 routed"):
        FTPModifier(schedule=[0.5, 0.5]).apply_to(model, [{"input_ids": None}])
    assert not routed_layers(model)


def test_genetic_schedule_needs_held_out_batches(llama_dir):
    model = load(llama_dir)
    batches = [{"input_ids": torch.randint(4, 128, (2, 8))}]
    with pytest.raises(ValueError, match="holds out validation_batches=1"):
        FTPModifier().apply_to(model, batches)
    with pytest.raises(ValueError, match="calibration set is empty"):
        FTPModifier(schedule="uniform").apply_to(model, [])
    assert not routed_layers(model)


def _target_loss(target):
    def loss(ratios):
        return sum((r - t) ** 2 for r, t in zip(ratios, target))

    return loss


def test_scheduler_meets_budget_bounds_cost_and_is_reproducible():
    target = [0.3, 0.9, 0.5, 0.7, 0.6]
    calls = []

    def evaluate(ratios):
        calls.append(ratios)
        return _target_loss(target)(ratios)

    kw = dict(num_layers=5, retention=0.6, min_retention=0.2, population=6,
              generations=5, seed=3)  # fmt: skip
    a = genetic_schedule(evaluate, **kw)
    assert len(calls) == a.evaluations <= 6 * 6
    b = genetic_schedule(_target_loss(target), **kw)
    assert a.ratios == b.ratios
    assert sum(a.ratios) / 5 == pytest.approx(0.6, abs=1e-9)
    assert all(0.2 <= r <= 1.0 for r in a.ratios)
    assert a.loss < a.uniform_loss  # it moved toward the optimum
    assert a.best_per_generation == sorted(a.best_per_generation, reverse=True)
    c = genetic_schedule(_target_loss(target), **{**kw, "seed": 4})
    assert c.ratios != a.ratios


def test_recipe_with_empty_ftp_body_uses_defaults():
    from llmcompressor.recipe import Recipe

    from adadsf_modifier import FTPModifier

    text = "sparsity_stage:\n  sparsity_modifiers:\n    FTPModifier:\n"
    [mod] = Recipe.create_instance(text).modifiers
    assert isinstance(mod, FTPModifier)
    assert mod.retention == FTPModifier().retention
