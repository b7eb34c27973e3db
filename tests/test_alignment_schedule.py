"""Learning rates of the alignment stage: the schedule's factors against hand-computed
values, the layers' own rate, and the recipe fields' checks."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from test_alignment import config, routed_pair, snapshot
from tiny_models import token_dataset

from adadsf_modifier import AdaDSFModifier, routed_layers
from adadsf_modifier.alignment import align_model
from adadsf_modifier.alignment.schedule import lr_factor, make_optimizer, retention_at


def test_constant_schedule_without_warmup_is_one_throughout():
    c = config(steps=5)
    assert [lr_factor(k, c) for k in range(1, 6)] == [1.0] * 5


def test_warmup_then_cosine_factors_match_hand_computed_values():
    c = config(steps=6, warmup_steps=2, lr_schedule="cosine")
    # warm-up: 1/3, 2/3; cosine over the 4 remaining steps: 0.5 (1 + cos(pi i / 4))
    h = math.sqrt(0.5)
    expected = [1 / 3, 2 / 3, 1.0, (1 + h) / 2, 0.5, (1 - h) / 2]
    got = [lr_factor(k, c) for k in range(1, 7)]
    assert got == pytest.approx(expected)
    assert min(got) > 0  # no step wasted at rate 0


def test_optimizer_rates_follow_the_schedule_per_group():
    c = config(steps=4, lr=1e-2, layer_lr=1e-4, trainable="routers_and_layers",
               lr_schedule="cosine", warmup_steps=1)  # fmt: skip
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt, sched = make_optimizer([a, b], [True, False], c)
    seen = []
    for _ in range(c.steps):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for k, (router_lr, layer_lr) in enumerate(seen, start=1):
        assert router_lr == pytest.approx(1e-2 * lr_factor(k, c))
        assert layer_lr == pytest.approx(1e-4 * lr_factor(k, c))


def test_layer_lr_moves_layer_weights_far_less_than_routers():
    moved = {}
    for layer_lr in (None, 1e-9):
        student, teacher = routed_pair()
        before = snapshot(student)
        align_model(
            student,
            teacher,
            token_dataset(4, 16),
            config(steps=2, lr=1e-2, layer_lr=layer_lr, trainable="routers_and_layers"),
        )
        after = snapshot(student)
        delta = {k: (after[k] - before[k]).abs().max().item() for k in before}
        moved[layer_lr] = (
            max(v for k, v in delta.items() if ".router." in k),
            max(v for k, v in delta.items() if "self_attn" in k or "mlp" in k),
        )
    assert moved[None][1] > 1e-3  # at the routers' rate the layers move
    assert moved[1e-9][1] < 1e-7  # at their own tiny rate they barely do
    assert moved[1e-9][0] > 1e-3  # while the routers still learn


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(align_steps=4, align_warmup_steps=4), "warmup_steps \\(4\\) must be"),
        (dict(align_lr_schedule="linear"), "align_lr_schedule must be one of"),
        (dict(align_layer_lr=1e-4), "layer_lr is set but trainable is 'routers'"),
        (dict(align_layer_lr=0.0), "align_layer_lr"),
        (dict(align_warmup_steps=-1), "align_warmup_steps"),
        (
            dict(align_steps=4, align_routers_first_steps=2),
            "routers_first_steps \\(2\\) is set but trainable is 'routers'",
        ),
        (
            dict(
                align_steps=4,
                align_routers_first_steps=4,
                align_trainable="routers_and_layers",
            ),  # fmt: skip
            "routers_first_steps \\(4\\) must be smaller than steps \\(4\\)",
        ),
    ],
)
def test_bad_rate_fields_fail_at_construction(kwargs, text):
    with pytest.raises(ValidationError, match=text):
        AdaDSFModifier(**kwargs)


def test_retention_anneals_linearly_to_the_allocation():
    assert [retention_at(k, 0.6, 4) for k in range(1, 6)] == pytest.approx(
        [0.9, 0.8, 0.7, 0.6, 0.6]
    )
    assert retention_at(1, 0.6, 0) == 0.6  # no annealing: the allocation at once
    assert retention_at(3, 0.0, 4) == pytest.approx(0.25)  # a removed layer too


def test_training_sees_annealed_retention_and_ends_at_the_allocation():
    student, teacher = routed_pair()
    layers = routed_layers(student)
    targets = [m.retention_ratio for m in layers]
    seen: list[float] = []
    layer = next(m for m in layers if m.retention_ratio < 1.0)
    layer.register_forward_pre_hook(lambda m, a: seen.append(m.retention_ratio))
    align_model(student, teacher, token_dataset(4, 16),
                config(steps=4, anneal_steps=3))  # fmt: skip
    r = layer.retention_ratio
    assert seen == pytest.approx([retention_at(k, r, 3) for k in range(1, 5)])
    assert seen[0] > seen[1] > seen[2] == pytest.approx(r)
    assert [m.retention_ratio for m in layers] == targets  # restored exactly


def test_anneal_longer_than_training_is_refused():
    with pytest.raises(ValidationError, match="anneal_steps \\(5\\) must not exceed"):
        AdaDSFModifier(align_steps=4, align_anneal_steps=5)


def test_routers_first_steps_train_the_routers_alone_then_the_layers():
    """The first steps match a routers-only run (same losses and clipping norms: the
    layers neither moved nor entered the norm), and the layers move afterwards."""

    def run(**kw):
        student, teacher = routed_pair()
        before = snapshot(student)
        rep = align_model(student, teacher, token_dataset(4, 16),
                          config(lr=1e-2, grad_clip=0.5, **kw))  # fmt: skip
        after = snapshot(student)
        layers = [k for k in before if "self_attn" in k or "mlp" in k]
        return rep, max((after[k] - before[k]).abs().max().item() for k in layers)

    first, moved = run(steps=3, trainable="routers_and_layers", routers_first_steps=2)
    alone, _ = run(steps=2, trainable="routers")
    joint, _ = run(steps=3, trainable="routers_and_layers")
    assert first.losses[:2] == pytest.approx(alone.losses, rel=1e-5)
    assert first.grad_norms[:2] == pytest.approx(alone.grad_norms, rel=1e-5)
    assert moved > 1e-3  # the third step trained the layers
    # and the comparison can tell: training the layers from step 1 changes step 2
    assert joint.grad_norms[0] != pytest.approx(alone.grad_norms[0], rel=1e-3)
    assert joint.losses[1] != pytest.approx(alone.losses[1], rel=1e-5)


def test_routers_first_steps_with_nothing_routing_added_is_refused():
    """A dense model's own weights (the study's dense control): in the routers-only
    steps nothing would train, silently."""
    student, teacher = routed_pair()
    layers = [p for n, p in student.named_parameters() if "mlp" in n]
    c = config(steps=3, trainable="routers_and_layers", routers_first_steps=1)
    with pytest.raises(ValueError, match="none of the parameters to train was added"):
        align_model(student, teacher, token_dataset(4, 16), c, params=layers)
