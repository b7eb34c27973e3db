"""``adadsf_modifier.recipe_checks``: a recipe that would quantize the routers is
refused before any work, and the check needs no knowledge of the AdaDSF modifier."""

from __future__ import annotations

import ast
import inspect

import pytest
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

from adadsf_modifier import recipe_checks
from adadsf_modifier.constraints import InputError
from adadsf_modifier.recipe_checks import check_recipe_keeps_routers_unquantized

LAYERS = ["model.layers.1", "model.layers.2"]


@pytest.mark.parametrize(
    "modifier",
    [GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
     QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
     GPTQModifier(targets=["re:.*layers\\.2\\..*"], scheme="W4A16")],
)  # fmt: skip
def test_quantization_reaching_a_router_is_refused(modifier):
    # an InputError: the command line reports it in one line
    with pytest.raises(InputError, match=r"router `model\.layers\.\d\.router\.fc1`"):
        check_recipe_keeps_routers_unquantized(LAYERS, [modifier])


def test_routers_ignored_or_untargeted_pass():
    ignore = ["lm_head", "re:.*router.*"]
    check_recipe_keeps_routers_unquantized(
        LAYERS,
        [SmoothQuantModifier(smoothing_strength=0.8),
         GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore),
         GPTQModifier(targets=["re:.*mlp.*"], scheme="W4A16")],
    )  # fmt: skip


def test_modifiers_initialised_before_routing_are_not_checked():
    """They attached their schemes before the routers existed."""
    earlier = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    earlier.initialized_ = True
    check_recipe_keeps_routers_unquantized(LAYERS, [earlier])


def test_no_session_and_no_modifiers_means_nothing_to_check():
    check_recipe_keeps_routers_unquantized(LAYERS)


def test_the_check_does_not_identify_modifiers_by_class_name():
    """No `type(m).__name__ == "AdaDSFModifier"` string match, and no import of the
    modifier (it imports this module): of the package, only the leaf of constraints
    and errors."""
    tree = ast.parse(inspect.getsource(recipe_checks))
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert "AdaDSFModifier" not in names
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    modules = {getattr(n, "module", "") or "" for n in imports}
    assert {m for m in modules if "adadsf_modifier" in m} == {
        "adadsf_modifier.constraints"
    }


def test_oneshot_refuses_a_later_gptq_that_targets_the_routers(tmp_path):
    from llmcompressor import oneshot
    from tiny_models import save_tiny_model, token_dataset

    from adadsf_modifier import AdaDSFModifier

    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=3)
    recipe = [
        AdaDSFModifier(retention=0.8),
        GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    ]
    with pytest.raises(ValueError, match=r"router.*re:\.\*router\.\*"):
        oneshot(model=base, dataset=token_dataset(4, 8), recipe=recipe,
                num_calibration_samples=4, max_seq_length=8)  # fmt: skip
