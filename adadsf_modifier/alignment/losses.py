"""Loss terms of AdaDSF's feature-preserving alignment (the paper's fine-tune stage).

``L = w_kl * KL(P_dense || P_sparse) + w_hidden * (1/L) * sum_l || softmax(h_sparse^l) -
softmax(h_dense^l) ||_2 + w_lm * CE(next token)``

Pure tensor functions, no model or training state, so each term can be unit-tested;
the recipe's ``align_loss`` picks one of :data:`LOSS_WEIGHTS`. Every term is
a mean over **real** tokens: padding rows of a batch must not pull the student towards
whatever the teacher does on pad positions, and a batch with more padding must not get a
smaller loss. All arithmetic runs in float32 regardless of the model dtype (bf16 softmax
/ log-softmax over a 49k vocabulary loses too much precision for a KL between two close
distributions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adadsf_modifier.alignment.chunked_kl import forward_kl_mean

__all__ = [
    "LOSS_WEIGHTS",
    "AlignmentLossWeights",
    "AlignmentLossTerms",
    "alignment_loss",
    "causal_lm_loss",
    "hidden_alignment_loss",
    "kl_divergence_loss",
]


@dataclass(frozen=True)
class AlignmentLossWeights:
    """Weights of the three loss terms; a term of weight 0 is not computed, and with
    ``kl == hidden == 0`` the teacher's forward pass is skipped entirely."""

    kl: float = 1.0
    hidden: float = 1.0
    lm: float = 0.0

    @property
    def needs_teacher(self) -> bool:
        """True when a term compares against the dense teacher (KL or hidden)."""
        return self.kl > 0 or self.hidden > 0


#: What ``align_loss`` names: the paper's KL + hidden alignment against the dense
#: teacher, or the causal-LM loss alone (its ablation; no teacher).
LOSS_WEIGHTS = {
    "kl_hidden": AlignmentLossWeights(kl=1.0, hidden=1.0, lm=0.0),
    "lm": AlignmentLossWeights(kl=0.0, hidden=0.0, lm=1.0),
}


@dataclass(frozen=True)
class AlignmentLossTerms:
    """The weighted total (what is back-propagated) and each unweighted term (for
    logging).

    A term whose weight is 0 is not computed and reported as ``None``.
    """

    total: torch.Tensor
    kl: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    lm: torch.Tensor | None = None

    def as_floats(self) -> dict[str, float]:
        """``{"loss": ..., "kl": ..., ...}`` as Python floats (computed terms only)."""
        out = {"loss": float(self.total.detach())}
        for name in ("kl", "hidden", "lm"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value.detach())
        return out


def _real_mask(
    mask: torch.Tensor | None, shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """``[batch, seq]`` bool mask of real tokens (all True when no mask is given)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.shape != shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match tokens {tuple(shape)}"
        )
    return mask.to(device=device, dtype=torch.bool)


def _masked_mean(per_token: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_token [batch, seq]`` over real positions; 0 (with grad) if there
    are none."""
    count = real.sum()
    total = (per_token * real.to(per_token.dtype)).sum()
    return total / count.clamp(min=1).to(per_token.dtype)


def kl_divergence_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``KL(P_teacher || P_student)`` per token (summed over the vocabulary), mean over
    real tokens.

    Forward KL (teacher first) as in the paper: it is mass-covering, so the student is
    pushed to keep every continuation the dense model finds plausible rather than
    collapsing onto its mode. ``teacher_logits`` should carry no gradient (the teacher
    is frozen).
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} differ in shape"
        )
    real = _real_mask(mask, student_logits.shape[:-1], student_logits.device)
    # a few tokens at a time, no float32 copy of the logits (alignment/chunked_kl.py)
    return forward_kl_mean(teacher_logits, student_logits, real)


def hidden_alignment_loss(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(1/L) sum_l mean_tokens || softmax(h_s^l) - softmax(h_t^l) ||_2`` over ``L``
    layers.

    The softmax runs over the hidden dimension, turning each token's hidden state into a
    distribution; comparing distributions instead of raw states makes the term
    insensitive to the residual stream's scale, which grows by orders of magnitude with
    depth (a raw MSE would be dominated by the last layers). Per token the L2 norm of
    the difference, then the mean over real tokens, then the mean over layers (every
    layer counts equally).
    """
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(
            f"student has {len(student_hidden)} hidden states, teacher "
            f"{len(teacher_hidden)}"
        )
    if len(student_hidden) == 0:
        raise ValueError(
            "hidden_alignment_loss needs at least one layer's hidden states"
        )
    real = _real_mask(mask, student_hidden[0].shape[:-1], student_hidden[0].device)
    per_layer = []
    for h_s, h_t in zip(student_hidden, teacher_hidden):
        if h_s.shape != h_t.shape:
            raise ValueError(
                f"hidden state shapes differ: student {tuple(h_s.shape)}, teacher "
                f"{tuple(h_t.shape)}"
            )
        diff = F.softmax(h_s.float(), dim=-1) - F.softmax(h_t.float(), dim=-1)
        per_layer.append(
            _masked_mean(torch.linalg.vector_norm(diff, ord=2, dim=-1), real)
        )
    return torch.stack(per_layer).mean()


def causal_lm_loss(
    student_logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy, mean over positions whose *target* token is real.

    The usual language-modelling loss; alone it is the paper's ablation baseline, and
    with a small weight it can regularise the distillation terms towards the data.
    """
    if student_logits.shape[:-1] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(student_logits.shape)} do not match input_ids "
            f"{tuple(input_ids.shape)}"
        )
    real = _real_mask(mask, input_ids.shape, student_logits.device)
    logits = student_logits[:, :-1, :].float()
    targets = input_ids[:, 1:].to(student_logits.device)
    valid = real[:, 1:] & real[:, :-1]
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    return _masked_mean(per_token, valid)


def alignment_loss(
    weights: AlignmentLossWeights,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    student_logits: torch.Tensor,
    student_hidden: Sequence[torch.Tensor] | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_hidden: Sequence[torch.Tensor] | None = None,
) -> AlignmentLossTerms:
    """Weighted sum of the terms whose weight is > 0; see the module docstring for the
    formula.

    ``student_hidden``/``teacher_hidden`` are the per-layer hidden states to align (one
    tensor per decoder layer, ``[batch, seq, hidden]``); they are only read when
    ``weights.hidden > 0``, the teacher's outputs only when ``weights.needs_teacher``.
    """
    terms: dict[str, torch.Tensor] = {}
    if weights.kl > 0:
        if teacher_logits is None:
            raise ValueError("the KL term (weight > 0) needs teacher_logits")
        terms["kl"] = kl_divergence_loss(teacher_logits, student_logits, attention_mask)
    if weights.hidden > 0:
        if student_hidden is None or teacher_hidden is None:
            raise ValueError(
                "the hidden-alignment term (weight > 0) needs both hidden-state lists"
            )
        terms["hidden"] = hidden_alignment_loss(
            student_hidden, teacher_hidden, attention_mask
        )
    if weights.lm > 0:
        terms["lm"] = causal_lm_loss(student_logits, input_ids, attention_mask)
    total = sum(getattr(weights, name) * value for name, value in terms.items())
    if not isinstance(total, torch.Tensor):
        raise ValueError(f"every loss weight is 0 ({weights}): nothing to train")
    return AlignmentLossTerms(total=total, **terms)
