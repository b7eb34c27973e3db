"""The per-layer token router: a small MLP that scores how much a token needs a
layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TokenRouter"]


class TokenRouter(nn.Module):
    """``score = w2 . gelu(W1 . norm(h) + b1) + b2``, one scalar per token.

    The input is RMS-normalised (without a learned scale) because the residual stream's
    norm grows by orders of magnitude with depth; without it one learning rate cannot
    suit every layer. Kept deliberately tiny (``hidden_size * router_hidden_size``
    weights) so its cost is a rounding error next to the layer it gates (counted in the
    FLOPs model).
    """

    def __init__(
        self, hidden_size: int, router_hidden_size: int = 64, eps: float = 1e-6
    ):
        super().__init__()
        if router_hidden_size <= 0:
            raise ValueError(
                f"router_hidden_size must be > 0, got {router_hidden_size}"
            )
        self.hidden_size = hidden_size
        self.router_hidden_size = router_hidden_size
        self.eps = eps
        self.fc1 = nn.Linear(hidden_size, router_hidden_size)
        self.fc2 = nn.Linear(router_hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden] -> [batch, seq]`` router logits (float32 for stable
        top-k).

        Written with fused functional ops: a decoding step calls the router of every
        layer for a single token, where the cost is per-op dispatch, not arithmetic.
        """
        h = hidden_states
        if h.dtype != self.fc1.weight.dtype:
            h = h.to(self.fc1.weight.dtype)
        h = F.rms_norm(h, (self.hidden_size,), eps=self.eps)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias))
        scores = F.linear(h, self.fc2.weight, self.fc2.bias).squeeze(-1)
        return scores if scores.dtype == torch.float32 else scores.float()
