"""AdaDSFModifier through llm-compressor's own entry points (oneshot, YAML recipes)."""

import copy
from pathlib import Path

import pytest
import torch
import yaml
from llmcompressor import oneshot
from llmcompressor.modifiers import Modifier
from llmcompressor.recipe import Recipe
from pydantic import ValidationError
from tiny_models import ARCHITECTURES, save_tiny_model, token_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifier)
from adadsf_modifier import AdaDSFModifier, RoutedLayer, routed_layers

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "adadsf_paper.yaml"
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        a: save_tiny_model(a, str(root / a), num_layers=NUM_LAYERS)
        for a in ARCHITECTURES
    }


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run(path, recipe, **kwargs):
    kwargs.setdefault("dataset", token_dataset(8, 16))
    return oneshot(
        model=load(path),
        recipe=recipe,
        num_calibration_samples=8,
        max_seq_length=16,
        **kwargs,
    )


def recipe_with(**overrides) -> str:
    data = yaml.safe_load(RECIPE.read_text())
    data["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"].update(overrides)
    return yaml.safe_dump(data)


def assert_equals_dense(model, path):
    dense = load(path)
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        for kw in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
            real = kw.get("attention_mask", torch.ones_like(ids)).bool()
            torch.testing.assert_close(
                model.eval()(**kw).logits[real],
                dense(**kw).logits[real],
                atol=1e-5,
                rtol=0,
            )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_oneshot_retention_one_routes_every_layer_and_equals_dense(arch, model_dirs):
    model = run(model_dirs[arch], [AdaDSFModifier(retention=1.0)])
    layers = routed_layers(model)
    assert len(layers) == NUM_LAYERS and all(isinstance(x, RoutedLayer) for x in layers)
    assert_equals_dense(model, model_dirs[arch])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_yaml_recipe_retention_one_equals_dense(arch, model_dirs):
    model = run(model_dirs[arch], recipe_with(retention=1.0))
    assert len(routed_layers(model)) == NUM_LAYERS
    assert_equals_dense(model, model_dirs[arch])


def test_yaml_recipe_file_resolves_and_routes(model_dirs):
    recipe = Recipe.create_instance(str(RECIPE))
    (mod,) = recipe.modifiers
    assert isinstance(mod, AdaDSFModifier) and mod.retention == 0.8
    model = run(model_dirs["llama"], str(RECIPE))
    assert len(routed_layers(model)) == NUM_LAYERS


def test_saved_recipe_yaml_round_trips():
    mod = AdaDSFModifier(
        retention=0.7, allocation=[1.0, 0.6, 0.6, 0.6], ignore=["re:.*\\.0$"]
    )
    text = Recipe.from_modifiers([mod]).yaml()
    (again,) = Recipe.create_instance(text).modifiers
    assert isinstance(again, AdaDSFModifier)
    assert again.model_dump(
        include={"retention", "allocation", "ignore"}
    ) == mod.model_dump(include={"retention", "allocation", "ignore"})


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_retention_budget_and_bounds(arch, model_dirs):
    mod = AdaDSFModifier(retention=0.8, min_retention=0.3)
    run(model_dirs[arch], [mod])
    assert len(mod.similarities) == NUM_LAYERS
    ratios = mod.retention_ratios
    assert len(ratios) == NUM_LAYERS
    assert sum(ratios) / len(ratios) == pytest.approx(0.8, abs=1e-6)
    assert all(0.3 - 1e-9 <= r <= 1.0 for r in ratios)
    # lower similarity -> at least as many tokens
    pairs = sorted(zip(mod.similarities, ratios))
    assert all(a[1] >= b[1] - 1e-9 for a, b in zip(pairs, pairs[1:]))


def test_reversed_gives_more_tokens_to_more_similar_layers(model_dirs):
    sim, rev = (
        AdaDSFModifier(retention=0.8),
        AdaDSFModifier(retention=0.8, allocation="reversed"),
    )
    run(model_dirs["llama"], [sim])
    run(model_dirs["llama"], [rev])
    s = sim.similarities
    hi, lo = s.index(max(s)), s.index(min(s))
    assert sim.retention_ratios[lo] >= sim.retention_ratios[hi]
    assert rev.retention_ratios[hi] >= rev.retention_ratios[lo]
    assert sim.retention_ratios != rev.retention_ratios


def test_random_allocation_is_reproducible(model_dirs):
    a, b = (
        AdaDSFModifier(allocation="random", seed=5),
        AdaDSFModifier(allocation="random", seed=5),
    )
    ma = run(model_dirs["llama"], [a])
    mb = run(model_dirs["llama"], [b])
    assert a.retention_ratios == b.retention_ratios
    for la, lb in zip(routed_layers(ma), routed_layers(mb)):
        assert torch.equal(la.router.fc1.weight, lb.router.fc1.weight)


def test_ignore_keeps_layers_dense(model_dirs):
    mod = AdaDSFModifier(retention=0.75, ignore=["re:.*layers\\.0$"])
    model = run(model_dirs["llama"], [mod])
    assert [r.layer_index for r in routed_layers(model)] == [1, 2, 3]
    assert mod.retention_ratios[0] == 1.0
    assert sum(mod.retention_ratios[1:]) / 3 == pytest.approx(0.75, abs=1e-6)


def test_layer_drop_removes_whole_layers(model_dirs):
    mod = AdaDSFModifier(retention=0.5, allocation="layer_drop")
    model = run(model_dirs["llama"], [mod])
    assert sorted(mod.retention_ratios) == [0.0, 0.0, 1.0, 1.0]
    dropped = [r for r in routed_layers(model) if r.retention_ratio == 0.0]
    x = torch.randn(1, 5, model.config.hidden_size)
    assert torch.equal(dropped[0](x), x)


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        (dict(retention=0.0), "retention", r"\(0, 1\]"),
        (dict(retention=-0.5), "retention", r"\(0, 1\]"),
        (dict(retention=1.2), "retention", r"\(0, 1\]"),
        (dict(temperature=0.0), "temperature", "> 0"),
        (dict(temperature=-1.0), "temperature", "> 0"),
        (dict(allocation="learned"), "allocation", "must be one of"),
        (dict(allocation=[0.5, 1.5]), "allocation", r"\(0, 1\]"),
        (dict(min_retention=0.9, retention=0.8), "min_retention", "retention=0.8"),
        (dict(router_hidden_size=0), "router_hidden_size", "positive"),
        (dict(beta=-1.0), "beta", ">= 0"),
        (dict(beta=float("inf")), "beta", "finite"),
        (dict(router_init="learned"), "router_init", "similarity"),
        (dict(router_init="random"), "router_init", "skip_error"),
        (dict(route_target="mlp"), "route_target", "whole decoder layer"),
        (dict(importance="loss"), "importance", "no longer supported"),
        (dict(align_anneal_steps=5), "align_anneal_steps", "remove it from the recipe"),
        (dict(align_grad_clip=0.0), "align_grad_clip", "norm 1"),
        (dict(align_weight_decay=0.01), "align_weight_decay", "no weight decay"),
        (dict(routing_mode="rank"), "routing_mode", "adadsf calibrate"),
        (dict(seed=1, align_seed=2), "align_seed", "seeded by `seed`"),
        (dict(align_w_kl=1.0, align_w_lm=1.0), "align_w_kl", "align_loss: kl_hidden"),
        (dict(align_w_lm=1.0, align_loss="kl_hidden"), "align_w_kl", "align_loss"),
    ],
)
def test_bad_fields_fail_at_construction_naming_field_and_range(kwargs, field, text):
    with pytest.raises(ValidationError, match=text) as err:
        AdaDSFModifier(**kwargs)
    assert field in str(err.value)


def test_a_retired_field_at_what_the_plug_in_does_loads_with_a_warning(
    logged_warnings,
):
    """An older recipe naming a retired field at the value that describes what the
    plug-in still does (or a field that had no effect) builds the same modifier."""
    old = AdaDSFModifier(threshold_passes=2, route_target="layer", align_warmup_steps=0,
                         routing_mode="causal")  # fmt: skip
    assert old.model_dump() == AdaDSFModifier().model_dump()
    assert any("`route_target` is no longer a recipe" in m for m in logged_warnings)
    # the alignment's former knobs at the values that are now fixed or implied
    old = AdaDSFModifier(seed=3, align_seed=3, align_grad_clip=1.0,
                         align_weight_decay=0.0)  # fmt: skip
    assert old.model_dump() == AdaDSFModifier(seed=3).model_dump()


@pytest.mark.parametrize(
    "weights, loss",
    [({"align_w_kl": 1.0, "align_w_hidden": 1.0}, "kl_hidden"),
     ({"align_w_kl": 0.0, "align_w_hidden": 0.0, "align_w_lm": 1.0}, "lm"),
     ({"align_w_lm": 0.0}, "kl_hidden")],
)  # fmt: skip
def test_the_retired_loss_weights_read_as_the_loss_they_name(
    weights, loss, logged_warnings
):
    """Recipes before ``align_loss`` (and older checkpoints' ``recipe.yaml``) spelled
    the loss as three weights, unset ones at their defaults (1, 1, 0)."""
    assert AdaDSFModifier(**weights).align_loss == loss
    assert any(f"read as `align_loss: {loss}`" in m for m in logged_warnings)


def test_unknown_yaml_field_is_rejected():
    bad = recipe_with(retension=0.8)
    with pytest.raises(Exception, match="retension"):
        Recipe.create_instance(bad)


def _assert_untouched(model, reference):
    assert not routed_layers(model)
    ref = reference.state_dict()
    assert model.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_explicit_list_of_wrong_length_fails_before_rewriting(model_dirs):
    model = load(model_dirs["llama"])
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="one ratio per routed decoder layer"):
        oneshot(
            model=model,
            dataset=token_dataset(4, 16),
            num_calibration_samples=4,
            recipe=[AdaDSFModifier(allocation=[0.5, 0.5, 0.5])],
        )
    _assert_untouched(model, reference)


def test_empty_calibration_set_fails_and_leaves_model_untouched(model_dirs):
    model = load(model_dirs["llama"])
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="calibration set is empty"):
        oneshot(model=model, dataset=DataLoader([]), recipe=[AdaDSFModifier()])
    _assert_untouched(model, reference)


def test_missing_calibration_data_fails_clearly(model_dirs):
    model = load(model_dirs["llama"])
    with pytest.raises(ValueError, match="needs calibration data"):
        oneshot(model=model, recipe=[AdaDSFModifier()])
    assert not routed_layers(model)


def test_all_padding_calibration_fails_clearly(model_dirs):
    ids = torch.randint(4, 128, (2, 8))
    loader = DataLoader(
        [
            {"input_ids": ids[i], "attention_mask": torch.zeros(8, dtype=torch.long)}
            for i in range(2)
        ],
        batch_size=2,
    )
    model = load(model_dirs["llama"])
    with pytest.raises(ValueError, match="no real tokens"):
        oneshot(model=model, dataset=loader, recipe=[AdaDSFModifier()])
    assert not routed_layers(model)


def test_padded_calibration_ignores_padding(model_dirs):
    """Similarities over a padded batch equal those over the same rows without
    padding."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 128, (n,), generator=g) for n in (10, 6)]
    padded = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    padded[0], mask[0] = rows[0], 1
    padded[1, 4:], mask[1, 4:] = rows[1], 1  # left padding
    batched = DataLoader(
        [{"input_ids": padded[i], "attention_mask": mask[i]} for i in range(2)],
        batch_size=2,
    )
    single = DataLoader(
        [{"input_ids": r, "attention_mask": torch.ones_like(r)} for r in rows],
        batch_size=1,
    )
    a, b = AdaDSFModifier(), AdaDSFModifier()
    oneshot(model=load(model_dirs["llama"]), dataset=batched, recipe=[a])
    oneshot(model=load(model_dirs["llama"]), dataset=single, recipe=[b])
    # the left-padded row is at shifted positions: rotary attention is shift-invariant
    assert a.similarities == pytest.approx(b.similarities, abs=1e-5)


def test_second_adadsf_fails_before_calibrating(model_dirs, monkeypatch):
    model = run(model_dirs["llama"], [AdaDSFModifier(retention=0.75)])
    calls = []
    monkeypatch.setattr(
        AdaDSFModifier, "_calibrate", lambda self, *a: calls.append(1) or [0.5] * 4
    )
    with pytest.raises(ValueError, match="already routed"):
        oneshot(
            model=model,
            dataset=token_dataset(8, 16),
            recipe=[AdaDSFModifier(retention=0.5)],
            num_calibration_samples=8,
            max_seq_length=16,
        )
    assert calls == []


def test_layer_drop_below_one_layer_fails_before_rewriting(model_dirs):
    model = load(model_dirs["llama"])
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="would keep no layer"):
        run_on(model, [AdaDSFModifier(retention=0.2, allocation="layer_drop")])
    _assert_untouched(model, reference)


def run_on(model, recipe):
    return oneshot(
        model=model,
        recipe=recipe,
        dataset=token_dataset(8, 16),
        num_calibration_samples=8,
        max_seq_length=16,
    )


def _renamed(stage: str, group: str) -> str:
    data = yaml.safe_load(RECIPE.read_text())
    body = data["sparsity_stage"]["sparsity_modifiers"]
    return yaml.safe_dump({stage: {group: body}})


@pytest.mark.parametrize(
    "stage, group", [("sparsity", "sparsity_modifiers"), ("sparsity_stage", "mods")]
)
def test_recipe_naming_adadsf_outside_stage_groups_is_refused(stage, group):
    with pytest.raises(ValueError, match="ending in `_stage`"):
        Recipe.create_instance(_renamed(stage, group))


def test_recipe_with_empty_adadsf_body_uses_defaults():
    text = "sparsity_stage:\n  sparsity_modifiers:\n    AdaDSFModifier:\n"
    recipe = Recipe.create_instance(text)
    [mod] = recipe.modifiers
    assert isinstance(mod, AdaDSFModifier)
    assert mod.retention == AdaDSFModifier().retention


_LIFECYCLE = set(Modifier.model_fields)  # llm-compressor's, not the recipe's


def test_a_boolean_is_refused_for_every_field_that_is_not_one():
    """``retention: true`` would read as 1.0 (every layer at ratio 1, silently): each
    field of both modifiers whose type is not a boolean refuses one, alone or in a
    list, while the boolean fields take it."""
    from adadsf_modifier import FTPModifier
    from adadsf_modifier.constraints import InputError

    for cls in (AdaDSFModifier, FTPModifier):
        for name, field in cls.model_fields.items():
            if name in _LIFECYCLE or name == "align_dataset":  # rows, checked apart
                continue
            if field.annotation is bool:
                assert getattr(cls(**{name: True}), name) is True
                continue
            for value in (True, [True, 0.5]):
                with pytest.raises(ValidationError, match="holds a boolean") as err:
                    cls(**{name: value})
                assert name in str(err.value) and isinstance(
                    err.value.errors()[0]["ctx"]["error"], InputError
                )


def test_a_boolean_retention_in_a_yaml_recipe_is_refused():
    with pytest.raises(Exception, match="retention: True` holds a boolean"):
        Recipe.create_instance(recipe_with(retention=True))
