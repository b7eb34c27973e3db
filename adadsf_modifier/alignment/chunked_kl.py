"""The forward KL between two models' next-token distributions, a few tokens at a time.

Why: written as ``kl_div(log_softmax(s.float()), log_softmax(t.float()))`` over a batch
of 8 x 512 tokens and SmolLM2's 49,152-word vocabulary, every step allocates about ten
fresh ``[tokens, vocab]`` float32 tensors of 805 MB (the casts, both log-softmaxes, the
elementwise KL, their backward), each one page-faulted in and passed over once: on a
CPU that memory traffic costs more than the lm_head's matmuls. Here the same quantity,
exactly
``sum_v p (log p - log q)`` per token, is computed over chunks of tokens small enough
that their float32 temporaries stay in the cache and are reused by the allocator; the
backward recomputes each chunk's probabilities from the logits it keeps (``q - p``,
scaled per token) instead of saving float32 copies. Only the gradient itself, in the
logits' dtype, is a full-size tensor.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_BYTES", "forward_kl_mean"]

#: Float32 bytes per temporary ``[chunk, vocab]`` tensor: a few of them live at once,
#: well inside a CPU's last-level cache and far below glibc's mmap threshold (32 MB).
CHUNK_BYTES = 4 << 20


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _ForwardKL(torch.autograd.Function):
    """``sum_i w_i KL(softmax(t_i) || softmax(s_i))`` over rows ``i`` of ``[n, vocab]``
    logits; gradient for ``s`` only."""

    @staticmethod
    def forward(ctx, teacher, student, weight):  # noqa: D102 - see the class
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
    def backward(ctx, grad_total):  # noqa: D102 - see the class
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


def forward_kl_mean(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """``KL(P_teacher || P_student)`` per position, summed over the vocabulary, mean
    over the positions where ``real`` (``[...]`` bool, the logits' leading shape) is
    true; 0 (with a gradient) when none is. Float32 arithmetic whatever the logits'
    dtype; no gradient reaches the teacher's logits (they are detached)."""
    vocab = student_logits.shape[-1]
    weight = real.reshape(-1).to(torch.float32)
    weight = weight / weight.sum().clamp(min=1)
    return _ForwardKL.apply(
        teacher_logits.detach().reshape(-1, vocab),
        student_logits.reshape(-1, vocab),
        weight,
    )
