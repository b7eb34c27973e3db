"""FTP's router: one small MLP shared by every routed layer, fed four features.

The MLP is a child of the first layer's :class:`FTPLayerRouter` only (the others hold a
plain reference), so its weights exist once in the state dict. A pre-hook gives the
router each call's mask and positions. A token's position is the number of real tokens
before it, read off the layer's mask (as ``generate()`` derives it: padding must not
count); without a mask, or under a sliding window, it is the ``position_ids`` RoPE sees.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from adadsf_modifier.ftp.features import (
    NUM_FEATURES,
    LayerFeatureStats,
    probe_scores,
    token_features,
)
from adadsf_modifier.ftp.static import static_scores
from adadsf_modifier.routing import RoutedLayer, routed_layers
from adadsf_modifier.utils import allowed_by_mask, real_token_mask

RouterMode = Literal["learned", "static"]


class FTPRouterMLP(nn.Module):
    """``w2 . gelu(W1 f + b1) + b2`` on the features ``f``, in float32."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        if hidden <= 0:
            raise ValueError(f"router hidden size must be > 0, got {hidden}")
        self.hidden = int(hidden)
        self.fc1 = nn.Linear(NUM_FEATURES, self.hidden)
        self.fc2 = nn.Linear(self.hidden, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        w1, b1 = self.fc1.weight.float(), self.fc1.bias.float()
        h = F.gelu(F.linear(features, w1, b1))
        return F.linear(h, self.fc2.weight.float(), self.fc2.bias.float()).squeeze(-1)


class FTPLayerRouter(nn.Module):
    """One routed layer's router: features of ``x`` and its context, scored by the
    shared MLP (``mode="static"``: the static router's scores, top-k only)."""

    def __init__(
        self,
        mlp: FTPRouterMLP,
        stats: LayerFeatureStats,
        hidden_size: int,
        position_scale: int,
        retention: float,
        keep_last: int = 4,
        owner: bool = False,
    ):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.router_hidden_size = mlp.hidden
        self.position_scale = int(position_scale)
        self.keep_last = int(keep_last)
        self.retention = float(retention)
        self.probe_bias = float(stats.bias)
        self.norm_eps = float(stats.eps)
        self.score_mean = float(stats.mean)
        self.score_std = float(stats.std)
        self.register_buffer("probe", stats.probe.clone().float())
        self.register_buffer("quantiles", stats.quantiles.clone().float())
        if owner:
            self.mlp = mlp
        object.__setattr__(self, "_shared_mlp", mlp)
        self.mode: RouterMode = "learned"
        self._context: dict[str, Any] | None = None
        #: while a list: each call appends ``(scores, probe scores, real, ratio)``
        self.collect: list | None = None

    @property
    def shared_mlp(self) -> FTPRouterMLP:
        return self._shared_mlp

    def detach_from(self, layer: nn.Module) -> None:
        """Called by ``unroute_layer``: the layer's context hooks go too."""
        for handle in layer.__dict__.pop("_ftp_hooks", ()) or ():
            handle.remove()

    def flops(self, tokens: int) -> int:
        """Matmul FLOPs: the probe's ``2 h`` and the MLP's ``2 (4 r + r)`` a token."""
        r = self.router_hidden_size
        return 2 * int(tokens) * (self.hidden_size + NUM_FEATURES * r + r)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        (b, s), device = hidden_states.shape[:2], hidden_states.device
        ctx = self._context or {}
        mask = ctx.get("attention_mask")
        pos = ctx.get("position_ids")
        if mask is not None and mask.dim() == 4 and not ctx.get("windowed"):
            pos = allowed_by_mask(mask[:, 0, -s:, :]).sum(-1) - 1  # real keys seen
        elif mask is not None and mask.dim() == 2:
            pos = mask.long().cumsum(-1)[:, -s:] - 1
        elif pos is None or pos.shape[-1] != s:
            pos = torch.arange(s, device=device).unsqueeze(0)
        pos = pos.to(device)
        real = real_token_mask(mask, b, s, device)
        ratio = float(ctx.get("ratio", self.retention))
        probe = probe_scores(hidden_states, self.probe, self.probe_bias, self.norm_eps)
        if self.mode == "static":
            return static_scores(probe, real, self.keep_last)
        feats = token_features(
            probe,
            pos,
            self.score_mean,
            self.score_std,
            self.quantiles,
            1.0 - min(max(ratio, 0.0), 1.0),
            self.position_scale,
        )
        scores = self.shared_mlp(feats)
        if self.collect is not None:
            self.collect.append((scores, probe.detach(), real, ratio))
        return scores

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, mlp_hidden={self.router_hidden_size}, "
            f"mode={self.mode}, keep_last={self.keep_last}"
        )


def _stash(module: nn.Module, args: tuple, kwargs: dict) -> None:
    router = getattr(module, "router", None)
    if isinstance(router, FTPLayerRouter):
        router._context = {
            "position_ids": kwargs.get("position_ids"),
            "attention_mask": kwargs.get("attention_mask"),
            "windowed": getattr(module, "attention_window", None) is not None,
            "ratio": float(getattr(module, "retention_ratio", router.retention)),
        }


def _clear(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    router = getattr(module, "router", None)
    if isinstance(router, FTPLayerRouter):
        router._context = None


def attach_context_hooks(layer: nn.Module) -> None:
    """Give ``layer.router`` each call's positions and mask (idempotent); prepended,
    so that the context is in place before another pre-hook (threshold fitting)."""
    if getattr(layer, "_ftp_hooks", None):
        return
    layer._ftp_hooks = (
        layer.register_forward_pre_hook(_stash, with_kwargs=True, prepend=True),
        layer.register_forward_hook(_clear, with_kwargs=True),
    )


def ftp_layers(model: nn.Module) -> list[RoutedLayer]:
    """The routed layers of ``model`` that FTP routes, in model order."""
    return [m for m in routed_layers(model) if isinstance(m.router, FTPLayerRouter)]
