"""The alignment optimizer's learning rates: one per parameter group, over time.

Two groups: the parameters routing *added* (routers, skip paths), which start from a
warm start or a closed-form fit, and the decoder layers' *pre-trained* weights. A rate
high enough to move a fresh router moves a pre-trained weight too far: at the rate
tuned for AdaDSF's routers (1e-3) the healing loss of layer removal with ridge maps
*rose* (``docs/measurements.md`` §8). ``layer_lr`` gives the second group its own rate.

The schedule multiplies every group's rate by the same factor: linear warm-up over
``warmup_steps``, then constant or half a cosine towards 0. No step runs at rate 0
(the first warm-up step and the last cosine step both get a positive factor): with a
few dozen steps, a wasted step is a few percent of the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from adadsf_modifier.alignment.config import AlignmentConfig

__all__ = ["lr_factor", "make_optimizer"]


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
    factor: Callable[[int], float] = lambda epoch: lr_factor(epoch + 1, config)  # noqa: E731
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
