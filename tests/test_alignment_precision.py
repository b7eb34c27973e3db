"""Alignment on half-precision models, its up-front support check, the divergence
advice, and one declaration of every alignment setting's constraint."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from test_alignment import config, routed_pair, router_state
from tiny_models import tiny_model, token_dataset

from adadsf_modifier import AdaDSFModifier, routed_layers
from adadsf_modifier.alignment import (
    AlignmentDivergedError,
    align_model,
    check_alignment_supported,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_aligns_and_keeps_its_dtype(dtype):
    # fp16 used to diverge at step 1: AdamW's eps (1e-8) is 0 in fp16.
    student, teacher = routed_pair()
    student.to(dtype)
    teacher.to(dtype)
    before = router_state(student)
    report = align_model(student, teacher, token_dataset(4, 16), config(steps=3))
    assert report.steps == 3
    assert all(torch.isfinite(torch.tensor(report.losses)))
    after = router_state(student)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(v.dtype == dtype and torch.isfinite(v).all() for v in after.values())
    assert all(p.dtype == dtype for p in student.parameters())


def test_divergence_advice_names_only_settings_that_apply():
    student, teacher = routed_pair()
    layer = routed_layers(student)[1]
    layer.router.fc2.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(AlignmentDivergedError, match="non-finite gradient") as err:
        align_model(
            student,
            teacher,
            token_dataset(4, 16),
            config(steps=2, bf16=False),
        )
    message = str(err.value)
    assert "align_lr" in message
    assert "align_bf16" not in message


def test_non_finite_loss_before_any_update_blames_the_model_not_the_optimizer():
    student, teacher = routed_pair()
    with torch.no_grad():
        teacher.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(AlignmentDivergedError, match="before any update") as err:
        align_model(student, teacher, token_dataset(4, 16), config(steps=2))
    assert "align_lr" not in str(err.value)


def test_unsupported_gradient_checkpointing_is_refused_up_front():
    model = tiny_model("llama")
    model.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        check_alignment_supported(model, config(gradient_checkpointing=True))
    check_alignment_supported(model, config(steps=0, gradient_checkpointing=True))


def test_integer_layer_weights_cannot_train_with_routers_and_layers():
    model = tiny_model("llama")
    proj = model.model.layers[1].mlp.down_proj
    proj.weight = torch.nn.Parameter(
        torch.zeros_like(proj.weight, dtype=torch.int8), requires_grad=False
    )
    with pytest.raises(ValueError, match="torch.int8"):
        check_alignment_supported(model, config(trainable="routers_and_layers"))
    check_alignment_supported(model, config(trainable="routers"))


def test_half_precision_model_passes_the_support_check():
    check_alignment_supported(tiny_model("llama").half(), config())


@pytest.mark.parametrize(
    "name, value",
    [
        ("steps", -1),
        ("lr", 0.0),
        ("batch_size", 0),
        ("seq_len", -5),
        ("trainable", "all"),
    ],
)
def test_recipe_field_and_config_share_one_rule_and_message(name, value):
    with pytest.raises(ValidationError) as field_err:
        AdaDSFModifier(**{f"align_{name}": value})
    with pytest.raises(ValidationError) as config_err:
        config(**{name: value})
    field_msg = field_err.value.errors()[0]["msg"]
    assert field_msg == config_err.value.errors()[0]["msg"]


def test_modifier_refuses_unsupported_alignment_before_touching_the_model(tmp_path):
    from llmcompressor import oneshot
    from tiny_models import save_tiny_model
    from transformers import AutoModelForCausalLM

    path = save_tiny_model("llama", str(tmp_path / "llama"), num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.supports_gradient_checkpointing = False
    modifier = AdaDSFModifier(align_steps=1, align_gradient_checkpointing=True)
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        oneshot(model=model, recipe=[modifier], dataset=token_dataset(4, 8))
    assert not routed_layers(model)
