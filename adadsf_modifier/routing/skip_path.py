"""What a token that skips a routed layer gets instead of the layer: ``identity``
(the paper) or an affine map ``u(x) = x W^T + b`` (or rank ``k``: ``(x D^T) U^T +
b``) fitted in closed form to the layer's update ``layer(x) - x``
(:mod:`adadsf_modifier.fitting.ridge`). Not an ``nn.Linear`` on purpose: a
quantization recipe targeting ``Linear`` cannot reach it (it is fitted to float
activations and tiny)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SKIP_PATHS", "SkipPath", "install_skip_path", "skip_path_of"]

#: What a skipped token gets: ``identity`` (the input, as in the paper) or ``ridge``
#: (the input plus a fitted affine map of it).
SKIP_PATHS = ("identity", "ridge")


class SkipPath(nn.Module):
    """The update a skipped token receives: ``weight [h, h]`` (``rank=None``) or
    ``down [k, h]``, ``up [h, k]``; ``bias [h]``. Starts at zero: the identity."""

    def __init__(self, hidden_size: int, rank: int | None = None):
        super().__init__()
        if rank is not None and not 0 < int(rank) < int(hidden_size):
            raise ValueError(
                f"skip path rank must be in [1, hidden_size - 1 = {hidden_size - 1}] "
                f"(null for full rank), got {rank}"
            )
        self.hidden_size = int(hidden_size)
        self.rank = None if rank is None else int(rank)
        h = self.hidden_size
        if self.rank is None:
            self.weight = nn.Parameter(torch.zeros(h, h))
        else:
            self.down = nn.Parameter(torch.zeros(self.rank, h))
            self.up = nn.Parameter(torch.zeros(h, self.rank))
        self.bias = nn.Parameter(torch.zeros(h))

    @staticmethod
    def flops_for(tokens: int, hidden_size: int, rank: int | None) -> int:
        """``2 n h^2`` (full rank) or ``2 n 2 h k`` (rank ``k``): matmuls only."""
        h = int(hidden_size)
        per_token = h * h if rank is None else 2 * h * int(rank)
        return 2 * int(tokens) * per_token

    def flops(self, tokens: int) -> int:
        """:meth:`flops_for` this map's shape."""
        return self.flops_for(tokens, self.hidden_size, self.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``u(x)`` (not ``x + u(x)``), in ``x``'s dtype."""
        dtype = x.dtype
        if dtype != self.bias.dtype:
            x = x.to(self.bias.dtype)
        if self.rank is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = F.linear(F.linear(x, self.down), self.up, self.bias)
        return out if out.dtype == dtype else out.to(dtype)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, rank={self.rank}"


def skip_path_of(layer: nn.Module) -> SkipPath | None:
    """The layer's :class:`SkipPath` child, or ``None`` (identity skip path)."""
    module = layer._modules.get("skip_path")
    return module if isinstance(module, SkipPath) else None


def install_skip_path(layer: nn.Module, hidden_size: int, rank: int | None) -> SkipPath:
    """Give ``layer`` a zero :class:`SkipPath` on the device and in the dtype of the
    layer's own first parameter (not the router's: an FTP router may own none, or
    train in float32)."""
    param = next(layer.parameters())
    dtype = param.dtype if param.is_floating_point() else None
    skip = SkipPath(int(hidden_size), rank).to(device=param.device, dtype=dtype)
    layer.add_module("skip_path", skip)
    return skip
