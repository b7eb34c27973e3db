"""The per-layer token router: a small MLP that scores how much a token needs a
layer, and the straight-through gate through which a routed layer passes the router
its gradient (:func:`gated`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TokenRouter", "gated"]


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

    @staticmethod
    def flops_for(tokens: int, hidden_size: int, router_hidden_size: int) -> int:
        """``2 n (h r + r)``: the two linear layers (``h -> r -> 1``) on ``n`` tokens.

        Matmuls only, like the rest of the FLOPs model (the norm, GELU and biases are
        not counted). A static method so the FLOPs model can count routers from a
        config and a width alone.
        """
        r = int(router_hidden_size)
        return 2 * int(tokens) * (int(hidden_size) * r + r)

    def shape_fields(self) -> dict[str, Any]:
        """What, besides the model's hidden size, rebuilds this router's shape (the
        fields a checkpoint stores next to its tensors)."""
        return {
            "router_hidden_size": int(self.router_hidden_size),
            "router_eps": self.eps,
        }

    @classmethod
    def from_shape_fields(
        cls, hidden_size: int, fields: Mapping[str, Any]
    ) -> TokenRouter:
        """A freshly initialised router of the shape :meth:`shape_fields` described
        (``router_eps`` optional: older checkpoints lack it)."""
        eps = fields.get("router_eps")
        return cls(
            int(hidden_size),
            int(fields["router_hidden_size"]),
            eps=1e-6 if eps is None else float(eps),
        )

    def flops(self, tokens: int) -> int:
        """:meth:`flops_for` this router's shape."""
        return self.flops_for(tokens, self.hidden_size, self.router_hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden] -> [batch, seq]`` router logits, computed in float32
        (for a stable top-k and thresholds that mean the same in every dtype).

        Written with few ops: a decoding step calls the router of every layer for a
        single token, where the cost is per-op dispatch, not arithmetic. The whole MLP
        runs in float32 whatever the model's dtype: on CPU a one-row bfloat16 matmul
        costs several times its float32 twin, and a float32 ``rms_norm`` of one row is
        one cheap op, so the float32 router is both the faster and the more exact one
        at decode; in a prefill its matmul is a small share of a layer's.
        """
        return self.score(self.normalise(hidden_states))

    def normalise(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router's input: ``hidden_states`` RMS-normalised in float32, no learned
        scale (so a fit that trains the router on fixed inputs normalises them once)."""
        return F.rms_norm(hidden_states.float(), (self.hidden_size,), eps=self.eps)

    def score(self, normalised: torch.Tensor) -> torch.Tensor:
        """The MLP on :meth:`normalise`'s output: ``[..., hidden] -> [...]``."""
        w1, b1, w2, b2 = self._float_params()
        return F.linear(F.gelu(F.linear(normalised, w1, b1)), w2, b2).squeeze(-1)

    def _float_params(self) -> tuple[torch.Tensor, ...]:
        """``fc1``'s and ``fc2``'s weights and biases in float32.

        Without a gradient, the float32 copies of low-precision parameters are kept
        between calls (four fewer copies in every decoding step of every routed layer)
        and made again when a parameter is replaced or changed in place (its storage
        or version counter moves: ``.to()``, ``load_state_dict``, an optimizer step).
        With a gradient they are made on each call, so the gradient reaches the
        parameters.
        """
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
    """``y * g + x * (1 - g)`` with the straight-through gate ``g = 1 + sigmoid(s) -
    sg(...)``.

    ``g`` is exactly 1 in value, so the result equals ``y``; only the router's gradient
    ``d/ds = (y - x) * sigmoid'(s)`` is added. Callers skip it when no gradient is
    needed.
    """
    p = torch.sigmoid(scores)
    gate = (1.0 + (p - p.detach())).unsqueeze(-1).to(y.dtype)
    return y * gate + x * (1 - gate)
