"""FTP's three training losses (only the shared router MLP receives gradients).

- distillation: KL(dense || routed) of the next-token distributions over real tokens;
  the dense model is the same model with every layer run in full (no copy, the LLM
  weights are frozen);
- sparsity constraint: per layer, the kept fraction under the hard gate ``s > 0``
  (straight-through: value of the hard fraction, gradient of ``sigmoid(s)``) squared
  distance to the layer's scheduled ratio;
- guide: binary cross-entropy of the router's gate logits against the static router's
  keep mask, weighted down to 0 over the first steps so the router starts from the
  static rule and then follows the distillation signal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adadsf_modifier.ftp.static import static_keep_mask

__all__ = ["distillation_loss", "sparsity_loss", "guide_loss", "guide_weight_at"]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    real: torch.Tensor,
) -> torch.Tensor:
    """Mean over real tokens of ``KL(softmax(teacher) || softmax(student))``."""
    log_s = F.log_softmax(student_logits.float(), dim=-1)
    log_t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return kl[real].mean()


def hard_kept_fraction(scores: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Straight-through kept fraction of the ``free`` tokens under the gate ``s >
    0``."""
    p = torch.sigmoid(scores)
    gate = (scores > 0).float() + p - p.detach()
    return gate[free].mean()


def sparsity_loss(
    collected: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]],
) -> torch.Tensor:
    """Mean over layers of ``(kept fraction - ratio)^2`` (layers with ratio 1 or no
    free token are skipped). ``collected``: what the layer routers recorded."""
    terms = []
    for scores, _, real, ratio in collected:
        free = real & (real.cumsum(dim=1) > 1)  # the first token always runs
        if ratio >= 1.0 or not bool(free.any()):
            continue
        terms.append((hard_kept_fraction(scores, free) - ratio) ** 2)
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


def guide_loss(
    collected: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]],
    keep_last: int,
) -> torch.Tensor:
    """Mean over layers of the BCE between gate logits and the static keep mask."""
    terms = []
    for scores, probe, real, ratio in collected:
        if ratio >= 1.0 or not bool(real.any()):
            continue
        target = static_keep_mask(probe, real, ratio, keep_last).float()
        terms.append(F.binary_cross_entropy_with_logits(scores[real], target[real]))
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


def guide_weight_at(step: int, weight: float, steps: int) -> float:
    """Linear decay of the guide loss weight from ``weight`` to 0 over ``steps``."""
    if steps <= 0:
        return 0.0
    return weight * max(0.0, 1.0 - step / steps)
