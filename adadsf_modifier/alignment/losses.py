"""Loss terms of AdaDSF's feature-preserving alignment (the paper's fine-tune stage).

``L = w_kl * KL(P_dense || P_sparse) + w_hidden * (1/L) * sum_l || softmax(h_sparse^l) -
softmax(h_dense^l) ||_2 + w_lm * CE(next token)``

The recipe's ``align_loss`` picks one of :data:`LOSS_WEIGHTS`. Every term is a mean
over **real** tokens (padding must neither pull the student towards the teacher's pad
outputs nor shrink the loss), computed in float32 whatever the model dtype (a bf16
softmax over a large vocabulary is too coarse for a KL between close distributions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Float32 bytes per temporary ``[chunk, vocab]`` tensor: a few of them live at once,
#: well inside a CPU's last-level cache and far below glibc's mmap threshold (32 MB).
CHUNK_BYTES = 4 << 20


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _ForwardKL(torch.autograd.Function):
    """``sum_i w_i KL(softmax(t_i) || softmax(s_i))`` over rows ``i`` of ``[n, vocab]``
    logits, a chunk of rows at a time; gradient for ``s`` only.

    Written elementwise over a whole batch, every step would allocate about ten
    ``[tokens, vocab]`` float32 tensors, each touched once: on a CPU that memory
    traffic costs more than the lm_head's matmuls. Chunks keep the float32 temporaries
    in the cache; the backward recomputes each chunk's probabilities (``q - p``) from
    the logits instead of saving float32 copies.
    """

    @staticmethod
    def forward(ctx, teacher, student, weight):
        n, vocab = student.shape
        rows = _chunk_rows(vocab)
        lse_t = torch.empty(n, dtype=torch.float32, device=student.device)
        lse_s = torch.empty_like(lse_t)
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for a in range(0, n, rows):
            t = teacher[a : a + rows].float()
            s = student[a : a + rows].float()
            lt = torch.logsumexp(t, dim=-1)
            ls = torch.logsumexp(s, dim=-1)
            p = torch.exp(t - lt.unsqueeze(-1))
            # sum_v p (t - lt - s + ls) = sum_v p (t - s) - (lt - ls) sum_v p
            per_row = (p * (t - s)).sum(-1) - (lt - ls) * p.sum(-1)
            total += (per_row * weight[a : a + rows]).sum()
            lse_t[a : a + rows], lse_s[a : a + rows] = lt, ls
        ctx.save_for_backward(teacher, student, weight, lse_t, lse_s)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        teacher, student, weight, lse_t, lse_s = ctx.saved_tensors
        n, vocab = student.shape
        rows = _chunk_rows(vocab)
        grad = torch.empty_like(student)
        scale = weight * grad_total.float()
        for a in range(0, n, rows):
            b = a + rows
            p = torch.exp(teacher[a:b].float() - lse_t[a:b].unsqueeze(-1))
            q = torch.exp(student[a:b].float() - lse_s[a:b].unsqueeze(-1))
            grad[a:b] = (q - p) * scale[a:b].unsqueeze(-1)
        return None, grad, None


@dataclass(frozen=True)
class AlignmentLossWeights:
    """Weights of the three loss terms; a term of weight 0 is not computed."""

    kl: float = 1.0
    hidden: float = 1.0
    lm: float = 0.0

    @property
    def needs_teacher(self) -> bool:
        return self.kl > 0 or self.hidden > 0


#: What ``align_loss`` names: the paper's KL + hidden alignment, or its causal-LM
#: ablation (no teacher).
LOSS_WEIGHTS = {
    "kl_hidden": AlignmentLossWeights(kl=1.0, hidden=1.0, lm=0.0),
    "lm": AlignmentLossWeights(kl=0.0, hidden=0.0, lm=1.0),
}


@dataclass(frozen=True)
class AlignmentLossTerms:
    """The weighted total (back-propagated) and each unweighted term (``None``: weight
    0)."""

    total: torch.Tensor
    kl: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    lm: torch.Tensor | None = None

    def as_floats(self) -> dict[str, float]:
        out = {"loss": float(self.total.detach())}
        for name in ("kl", "hidden", "lm"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value.detach())
        return out


def _real_mask(
    mask: torch.Tensor | None, shape: torch.Size, device: torch.device
) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.shape != shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match tokens {tuple(shape)}"
        )
    return mask.to(device=device, dtype=torch.bool)


def _masked_mean(per_token: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean over real positions; 0 (with grad) if there are none."""
    count = real.sum()
    total = (per_token * real.to(per_token.dtype)).sum()
    return total / count.clamp(min=1).to(per_token.dtype)


def kl_divergence_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``KL(P_teacher || P_student)`` per token, mean over real tokens. Forward KL as in
    the paper: mass-covering, so the student keeps every continuation the dense model
    finds plausible rather than collapsing onto its mode."""
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} differ in shape"
        )
    real = _real_mask(mask, student_logits.shape[:-1], student_logits.device)
    vocab = student_logits.shape[-1]
    weight = real.reshape(-1).to(torch.float32)
    weight = weight / weight.sum().clamp(min=1)
    return _ForwardKL.apply(
        teacher_logits.detach().reshape(-1, vocab),
        student_logits.reshape(-1, vocab),
        weight,
    )


def hidden_alignment_loss(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(1/L) sum_l mean_tokens || softmax(h_s^l) - softmax(h_t^l) ||_2``. The softmax
    over the hidden dimension makes the term insensitive to the residual stream's
    scale, which grows by orders of magnitude with depth (a raw MSE would be dominated
    by the last layers)."""
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
    """Next-token cross-entropy, mean over positions whose target and input are
    real."""
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
    """Weighted sum of the terms whose weight is > 0 (the module docstring's formula);
    the hidden states are one ``[batch, seq, hidden]`` tensor per decoder layer."""
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
