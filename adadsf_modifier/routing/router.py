"""The per-layer token router and the straight-through gate through which a routed
layer passes it its gradient (:func:`gated`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TokenRouter", "gated"]


class TokenRouter(nn.Module):
    """``score = w2 . gelu(W1 . rms_norm(h) + b1) + b2``, one scalar per token. The
    input is RMS-normalised (no learned scale) because the residual stream's norm
    grows by orders of magnitude with depth, which one learning rate could not suit."""

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

    @staticmethod
    def flops_for(tokens: int, hidden_size: int, router_hidden_size: int) -> int:
        """``2 n (h r + r)``: the two matmuls on ``n`` tokens (static: the FLOPs
        model counts routers from a config)."""
        r = int(router_hidden_size)
        return 2 * int(tokens) * (int(hidden_size) * r + r)

    def flops(self, tokens: int) -> int:
        """:meth:`flops_for` this router's shape."""
        return self.flops_for(tokens, self.hidden_size, self.router_hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden] -> [batch, seq]`` logits, in float32 whatever the
        model's dtype: thresholds mean the same in every dtype, and for the one-token
        calls of decoding a float32 matmul is the cheaper one on a CPU."""
        return self.score(self.normalise(hidden_states))

    def normalise(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router's input, RMS-normalised in float32 (a fit can normalise once)."""
        return F.rms_norm(hidden_states.float(), (self.hidden_size,), eps=self.eps)

    def score(self, normalised: torch.Tensor) -> torch.Tensor:
        """The MLP on :meth:`normalise`'s output: ``[..., hidden] -> [...]``."""
        w1, b1, w2, b2 = self._float_params()
        return F.linear(F.gelu(F.linear(normalised, w1, b1)), w2, b2).squeeze(-1)

    def _float_params(self) -> tuple[torch.Tensor, ...]:
        """The weights and biases in float32; without a gradient the copies are kept
        until a parameter is replaced or changed in place (its storage or version
        moves), saving four copies per layer and decoding step."""
        params = (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return tuple(p.float() for p in params)
        key = tuple((p.data_ptr(), p._version) for p in params)
        cached = self.__dict__.get("_float_cache")
        if cached is None or cached[0] != key:
            cached = (key, tuple(p.detach().float() for p in params))
            self.__dict__["_float_cache"] = cached
        return cached[1]


def gated(y: torch.Tensor, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``y * g + x * (1 - g)`` with ``g = 1 + sigmoid(s) - sg(sigmoid(s))``: equal to
    ``y`` in value, it adds the router's gradient ``(y - x) sigmoid'(s)``."""
    p = torch.sigmoid(scores)
    gate = (1.0 + (p - p.detach())).unsqueeze(-1).to(y.dtype)
    return y * gate + x * (1 - gate)
