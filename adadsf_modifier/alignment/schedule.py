"""What changes over the alignment steps: the learning rate of each parameter group,
and the routed layers' retention (annealed from 1.0 to the allocation).

Two groups: the parameters routing *added* (routers, skip paths), which start from a
warm start or a closed-form fit, and the decoder layers' *pre-trained* weights. A rate
high enough to move a fresh router moves a pre-trained weight too far: at the rate
tuned for AdaDSF's routers (1e-3) the healing loss of layer removal with ridge maps
*rose* (``lab/NOTEBOOK.md`` §8). ``layer_lr`` gives the second group its own rate.

The schedule multiplies every group's rate by the same factor: linear warm-up over
``warmup_steps``, then constant or half a cosine towards 0. No step runs at rate 0
(the first warm-up step and the last cosine step both get a positive factor): with a
few dozen steps, a wasted step is a few percent of the budget.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from adadsf_modifier.alignment.config import AlignmentConfig
from adadsf_modifier.routing import routed_layers

__all__ = ["annealed_retention", "lr_factor", "make_optimizer", "retention_at"]


def lr_factor(step: int, config: AlignmentConfig) -> float:
    """The rate multiplier of optimizer step ``step`` (1-based) of ``config.steps``."""
    warmup = config.warmup_steps
    if step <= warmup:
        return step / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    progress = (step - warmup - 1) / max(config.steps - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(
    masters: Sequence[torch.Tensor],
    added: Sequence[bool],
    config: AlignmentConfig,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``masters`` (``added[i]``: the i-th was added by routing) and its
    scheduler; call ``scheduler.step()`` after every ``optimizer.step()``."""
    layer_lr = config.lr if config.layer_lr is None else config.layer_lr
    groups = [
        {"params": [m for m, a in zip(masters, added) if a], "lr": config.lr},
        {"params": [m for m, a in zip(masters, added) if not a], "lr": layer_lr},
    ]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
    # LambdaLR counts from 0 and applies its factor before the first step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: lr_factor(epoch + 1, config)
    )
    return optimizer, scheduler


def retention_at(step: int, target: float, anneal_steps: int) -> float:
    """A routed layer's retention at optimizer step ``step`` (1-based): linear from
    1.0 towards ``target``, reached at step ``anneal_steps`` (0: ``target`` at once)."""
    done = 1.0 if anneal_steps <= 0 else min(1.0, step / anneal_steps)
    return 1.0 - (1.0 - target) * done


@contextlib.contextmanager
def annealed_retention(
    model: nn.Module, anneal_steps: int
) -> Iterator[Callable[[int], None]]:
    """Yields ``set_step(step)``, which puts every routed layer at its annealed
    retention for that step; the allocated ratios are restored on exit, also when
    training raises. Retention annealing (DLO, arXiv 2407.11030: capacity 1.0 -> 0.9
    over 1,000 steps) lets the routers and layers adapt while the model is still close
    to the dense teacher, instead of starting from the full cut."""
    layers = routed_layers(model)
    targets = [float(m.retention_ratio) for m in layers]

    def set_step(step: int) -> None:
        for layer, target in zip(layers, targets):
            layer.retention_ratio = retention_at(step, target, anneal_steps)

    try:
        yield set_step
    finally:
        for layer, target in zip(layers, targets):
            layer.retention_ratio = target
