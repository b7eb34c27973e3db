"""The per-layer token router: a small MLP that scores how much a token needs a layer."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TokenRouter"]


class TokenRouter(nn.Module):
    """``score = w2 . act(W1 . norm(h))``, one scalar per token.

    The input is RMS-normalised (without a learned scale) because the residual stream's norm grows
    by orders of magnitude with depth; without it one learning rate cannot suit every layer.
    Kept deliberately tiny (``hidden_size * router_hidden_size`` weights) so its cost is a rounding
    error next to the layer it gates (counted in the FLOPs model).
    """

    def __init__(self, hidden_size: int, router_hidden_size: int = 64, eps: float = 1e-6):
        super().__init__()
        if router_hidden_size <= 0:
            raise ValueError(f"router_hidden_size must be > 0, got {router_hidden_size}")
        self.hidden_size = hidden_size
        self.router_hidden_size = router_hidden_size
        self.eps = eps
        self.fc1 = nn.Linear(hidden_size, router_hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(router_hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden] -> [batch, seq]`` router logits (float32 for stable top-k)."""
        h = hidden_states.to(self.fc1.weight.dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.fc2(self.act(self.fc1(h))).squeeze(-1).float()
