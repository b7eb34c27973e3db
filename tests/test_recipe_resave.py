"""A checkpoint reloaded with ``adadsf_modifier.from_pretrained`` and saved again keeps
a ``recipe.yaml`` that llm-compressor reads back into the modifiers that made it, each
once (``checkpoint._compat.write_model_recipe``).

llm-compressor 0.14 merges the folder's recipe with the session's and renames stage
keys both have (``default_stage`` -> ``default_stage_0`` / ``_1``), which its own
parser then skips; in the process that ran ``oneshot`` it also appends that run's
recipe to a reloaded copy of its output a second time.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from llmcompressor import oneshot
from llmcompressor.core import active_session
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.recipe import Recipe
from test_checkpoint_save_load import routed_model
from tiny_models import save_tiny_model, token_dataset

import adadsf_modifier
from adadsf_modifier import AdaDSFModifier, FTPModifier
from adadsf_modifier.checkpoint._compat import _distinct_stages

FTP_SETTINGS = dict(retention=0.75, ignore=["re:.*layers\\.0$"], router_hidden_size=16,
                    validation_batches=2, ga_population=4, ga_generations=2,
                    train_steps=5, keep_last_tokens=4, seed=0)  # fmt: skip
ADADSF_SETTINGS = dict(retention=0.8, ignore=["re:.*layers\\.0$"], seed=0)
GPTQ_YAML = """
sparsity_stage:
  sparsity_modifiers:
    AdaDSFModifier: {retention: 0.8, ignore: ["re:.*layers\\\\.0$"], seed: 0}
quantization_stage:
  quantization_modifiers:
    GPTQModifier:
      targets: [Linear]
      scheme: W8A8
      ignore: [lm_head, "re:.*router.*"]
"""


pytestmark = pytest.mark.usefixtures("single_thread")


def run_oneshot(model, recipe, out=None):
    return oneshot(model=model, recipe=recipe, dataset=token_dataset(8, 16),
                   num_calibration_samples=8, max_seq_length=16,
                   output_dir=None if out is None else str(out))  # fmt: skip


def saved_modifiers(folder) -> list:
    """The modifiers llm-compressor (with our recipe guard) reads from the folder's
    recipe.yaml, which must be plain YAML."""
    text = (folder / "recipe.yaml").read_text()
    assert "!!python" not in text
    assert isinstance(yaml.safe_load(text), dict)
    return Recipe.create_instance(str(folder / "recipe.yaml")).modifiers


def resave(src, dest):
    adadsf_modifier.from_pretrained(src, dtype=torch.float32).save_pretrained(str(dest))
    return saved_modifiers(dest)


@pytest.mark.parametrize(
    ("cls", "settings"),
    [(AdaDSFModifier, ADADSF_SETTINGS), (FTPModifier, FTP_SETTINGS)],
    ids=["adadsf", "ftp"],
)
def test_reloaded_checkpoint_saved_again_lists_its_modifier_once(
    tmp_path, cls, settings
):
    """Made from modifier objects (stage `default_stage`, the stage an empty session
    recipe has too), saved again in the oneshot's process and in a fresh session."""
    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=4)
    run_oneshot(base, [cls(**settings)], tmp_path / "out")
    (made,) = saved_modifiers(tmp_path / "out")
    assert type(made) is cls
    assert made.model_dump(include=set(settings)) == settings
    # the oneshot's session still holds its recipe: it must not be added again
    (again,) = resave(tmp_path / "out", tmp_path / "same_process")
    assert again.model_dump() == made.model_dump()
    (twice,) = resave(tmp_path / "same_process", tmp_path / "twice")
    assert twice.model_dump() == made.model_dump()
    active_session().reset()  # a fresh process: an empty `default_stage` session
    (fresh,) = resave(tmp_path / "out", tmp_path / "fresh")
    assert fresh.model_dump() == made.model_dump()
    for folder in ("same_process", "twice", "fresh"):
        text = (tmp_path / folder / "recipe.yaml").read_text()
        assert text == (tmp_path / "out" / "recipe.yaml").read_text()


def test_two_stage_recipe_with_gptq_resaved_keeps_both_modifiers(tmp_path):
    """An adadsf_w8a8-like recipe (AdaDSF, then GPTQ W8A8), reloaded compressed and
    saved again in the oneshot's process."""
    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=3)
    run_oneshot(base, GPTQ_YAML, tmp_path / "out")
    made = saved_modifiers(tmp_path / "out")
    assert [type(m) for m in made] == [AdaDSFModifier, GPTQModifier]
    again = resave(tmp_path / "out", tmp_path / "resaved")
    assert [m.model_dump() for m in again] == [m.model_dump() for m in made]


def test_oneshot_on_a_reloaded_checkpoint_adds_its_stage_after_the_saved_one(tmp_path):
    """GPTQ run on a reloaded AdaDSF checkpoint: both recipes are `default_stage`; the
    saved one comes first, both under keys llm-compressor reads, each once."""
    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=3)
    run_oneshot(base, [AdaDSFModifier(**ADADSF_SETTINGS)], tmp_path / "out")
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "out", dtype=torch.float32)
    gptq = GPTQModifier(targets="Linear", scheme="W8A8",
                        ignore=["lm_head", "re:.*router.*"])  # fmt: skip
    run_oneshot(reloaded, [gptq], tmp_path / "quantized")
    made = saved_modifiers(tmp_path / "quantized")
    assert [type(m) for m in made] == [AdaDSFModifier, GPTQModifier]
    assert made[0].model_dump(include=set(ADADSF_SETTINGS)) == ADADSF_SETTINGS
    again = resave(tmp_path / "quantized", tmp_path / "resaved")
    assert [m.model_dump() for m in again] == [m.model_dump() for m in made]


def test_a_session_that_ran_on_another_model_adds_nothing(tmp_path):
    base = save_tiny_model("llama", str(tmp_path / "base"), num_layers=4)
    run_oneshot(base, [AdaDSFModifier(**ADADSF_SETTINGS)])
    assert active_session().lifecycle.recipe.modifiers  # the session ran a recipe
    routed_model().save_pretrained(str(tmp_path / "by_hand"))  # routed without it
    assert saved_modifiers(tmp_path / "by_hand") == []


def test_a_recipe_with_merged_stage_keys_is_repaired_on_save(tmp_path):
    """A checkpoint re-saved before the fix (`default_stage_0` + an empty
    `default_stage_1`) is saved again with the stage llm-compressor reads."""
    active_session().reset()
    routed_model().save_pretrained(str(tmp_path / "ckpt"))
    body = {"default_modifiers": {"AdaDSFModifier": {"retention": 0.7}}}
    broken = {"default_stage_0": body, "default_stage_1": {}}
    (tmp_path / "ckpt" / "recipe.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(ValueError, match="instantiated 0"):
        saved_modifiers(tmp_path / "ckpt")  # what our recipe guard says
    (again,) = resave(tmp_path / "ckpt", tmp_path / "resaved")
    assert isinstance(again, AdaDSFModifier) and again.retention == 0.7
    text = yaml.safe_load((tmp_path / "resaved" / "recipe.yaml").read_text())
    assert text == {"default_stage": body}


def test_stages_keep_their_order_and_get_keys_the_parser_reads():
    a, g, x = ({"m": {name: {}}} for name in ("A", "G", "X"))
    entries = [("default_stage", a), ("quantization_stage", g), ("args", {"k": 1}),
               ("default_0_stage", x), ("default_stage_1", {}),
               ("quantization_stage", g), ("default_stage", x), ("args", {"k": 2}),
               ("default_stage", {"m": {"Y": {}}})]  # fmt: skip
    out = _distinct_stages(entries)
    assert list(out.items()) == [
        ("default_1_stage", a),
        ("quantization_stage", g),
        ("args", {"k": 1}),
        ("default_0_stage", x),
        ("default_2_stage", {"m": {"Y": {}}}),
    ]
    assert _distinct_stages([("default_stage_0", a), ("default_stage_1", {})]) == {
        "default_stage": a
    }
