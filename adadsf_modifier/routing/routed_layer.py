"""A decoder layer that runs only on the tokens its router selects.

The routed layer is the *same module object* with its class swapped for a subclass of
the original decoder-layer class (``RoutedLlamaDecoderLayer(RoutedLayer,
LlamaDecoderLayer)``): parameter names, hooks, ``isinstance`` checks, GPTQ
``targets``/``ignore`` and the sequential pipeline's ``sequential_targets`` (which match
by class name along the MRO) all keep working, and a reference anyone took to the layer
before routing still points at the routed layer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from adadsf_modifier.routing.architectures import (
    ROUTED_CLASS_MARKER,
    original_class,
    sliding_windows,
)
from adadsf_modifier.routing.cache import routed_cache_layer
from adadsf_modifier.routing.class_swap import swap_class
from adadsf_modifier.routing.decode import (
    decode_step,
    decode_step_keeping_kv,
    gated,
    pass_through,
)
from adadsf_modifier.routing.kv_keep import stored_keys
from adadsf_modifier.routing.paths import check_dense_cache, run_routed, skip_all
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.skip_path import SkipPath, skip_path_of
from adadsf_modifier.routing.sub_blocks import (
    attention_block,
    check_route_target,
    mlp_block,
    route_mlp,
)
from adadsf_modifier.routing.token_choice import choose_tokens
from adadsf_modifier.utils import first_real_tokens, real_token_mask

__all__ = [
    "RoutedLayer",
    "route_layer",
    "unroute_layer",
    "routed_class_for",
    "routed_layers",
]

_UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_ROUTED_CLASSES: dict[type, type] = {}


class RoutedLayer(nn.Module):
    """Mixin for routed decoder layers; ``isinstance(layer, RoutedLayer)`` finds them.

    The selected tokens (see :mod:`adadsf_modifier.routing.modes`) run the original
    layer, attending only among themselves (and, with a KV cache, to the earlier tokens
    that ran this layer) at their original positions; the others leave it bit-identical.
    Two variants, off by default (the paper): a fitted ``skip_path`` child gives the
    skipped tokens ``x + u(x)`` instead of ``x``
    (:mod:`~adadsf_modifier.routing.skip_path`), and ``skipped_tokens_kv`` lets them
    keep contributing keys/values, so the selected tokens attend to the full context
    (:mod:`~adadsf_modifier.routing.kv_keep`). With ``route_target`` ``attention`` or
    ``mlp`` only that sub-block is routed (:mod:`~adadsf_modifier.routing.sub_blocks`).
    The update of a selected token is multiplied by a straight-through gate
    ``1 + sigmoid(s) - sigmoid(s).detach()``: exactly 1 in value (so an untrained
    router at r = 1 reproduces the dense layer exactly), while the router receives
    ``d loss / d out * (out - skipped) * sigmoid'(s)`` as gradient (``skipped``: what
    the token would get if it skipped).
    """

    router: TokenRouter
    retention_ratio: float
    layer_index: int
    cache_kwarg: str
    routing_mode: str = "auto"
    causal_threshold: float | None = None
    keep_first_token: bool = True
    #: keys per query of this layer's sliding-window attention (None: full causal)
    attention_window: int | None = None
    #: skipped tokens still give keys/values to the attention of the tokens that run
    #: (see :mod:`adadsf_modifier.routing.kv_keep`); their skip path itself is the
    #: ``skip_path`` child module (:class:`SkipPath`), absent for the identity
    skipped_tokens_kv: bool = False
    #: what the router decides: the whole ``layer``, or only its ``attention`` or
    #: ``mlp`` sub-block (:mod:`~adadsf_modifier.routing.sub_blocks`)
    route_target: str = "layer"
    #: a :class:`~adadsf_modifier.routing.recorder.RoutingRecorder` while one is
    #: attached: the layer then reports what it ran (see ``recorder.py``)
    routing_recorder: Any = None

    def resolved_routing_mode(self) -> str:
        mode = self.routing_mode
        if mode == "auto":
            return (
                "causal"
                if (not self.training and self.causal_threshold is not None)
                else "topk"
            )
        return mode

    def select_tokens(
        self,
        scores: torch.Tensor,
        real: torch.Tensor,
        mode: str | None = None,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(index, valid, k_max)`` of the tokens this layer runs (``index`` None if
        none), by the rule of ``mode`` (``token_choice.choose_tokens``).

        The first real token of a sequence (the attention sink every later token attends
        to) always runs while ``keep_first_token`` is set; in top-k mode it counts
        toward ``K``. ``has_past``: the batch continues from a cache.
        """
        return choose_tokens(
            mode or self.resolved_routing_mode(),
            scores,
            real,
            self.forced_tokens(real, has_past, attention_mask),
            float(self.retention_ratio),
            self.causal_threshold,
            lambda: f"layer {self.layer_index}",
        )

    def forced_tokens(
        self,
        real: torch.Tensor,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``[batch, seq]`` bool: the first real token of each row (it always runs
        while ``keep_first_token`` is set), or ``None``. After a cached past it is read
        off the ``attention_mask`` (``utils.first_real_tokens``)."""
        if not self.keep_first_token:
            return None
        if not has_past:
            return real & (real.cumsum(dim=1) == 1)
        if attention_mask is None:
            return None
        return first_real_tokens(attention_mask, real)

    @property
    def grouped_query_attention(self) -> bool:
        attn = getattr(self, "self_attn", None)
        return getattr(attn, "num_key_value_groups", 1) > 1

    def selected_mask(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mode: str | None = None,
        has_past: bool = False,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, seq]`` bool: which tokens of layer input ``x`` this layer would
        run.

        ``scores``: the router's output on ``x`` when the caller already has it.
        """
        batch, q_len = x.shape[:2]
        real = real_token_mask(attention_mask, batch, q_len, x.device)
        if float(self.retention_ratio) >= 1.0:
            return real
        scores = self.router(x) if scores is None else scores
        index, valid, k_max = self.select_tokens(scores, real, mode, has_past)
        out = torch.zeros(batch, q_len + 1, dtype=torch.bool, device=x.device)
        if k_max:
            out = out.scatter(1, index, valid)
        return out[:, :q_len]

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D401 - see class docstring
        if len(args) > 1:  # bind extra positional args to their names once
            bound = inspect.signature(super().forward).bind(*args, **kwargs)
            args, kwargs = (
                (bound.arguments.pop("hidden_states"),),
                dict(bound.arguments),
            )
            kwargs.update(kwargs.pop("kwargs", {}))
        x = args[0] if args else kwargs.pop("hidden_states")
        target = self.route_target
        if target == "layer" or float(self.retention_ratio) >= 1.0:
            return self._route(super().forward, x, kwargs)
        if target == "mlp":
            return route_mlp(self, x, kwargs)
        return mlp_block(self, self._route(attention_block(self), x, kwargs))

    def _route(self, forward: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """Route ``forward`` (the original layer's, or its attention sub-block's) over
        the tokens of ``x``."""
        ratio = float(self.retention_ratio)
        batch, q_len, _ = x.shape
        cache = kwargs.get(self.cache_kwarg)
        # a layer keeping skipped tokens' keys/values caches every position densely
        dense_cache = self.skipped_tokens_kv and ratio > 0.0
        cache_layer = (
            routed_cache_layer(cache, self.layer_index, self.attention_window)
            if cache is not None and ratio < 1.0 and not dense_cache
            else None
        )
        rec = self.routing_recorder

        if ratio <= 0.0:  # a removed layer (ShortGPT-style allocation)
            real = None
            if rec is not None or skip_path_of(self) is not None:
                real = real_token_mask(kwargs.get("attention_mask"), batch, q_len,
                                       x.device)  # fmt: skip
            out, skipped = skip_all(self, x, real)
            if rec is not None:
                rec.record(self.layer_index, "removed", batch=batch,
                           skip_path=skipped)  # fmt: skip
            return pass_through(out, cache_layer)
        impl = getattr(self._adadsf_config, "_attn_implementation", "sdpa")
        if impl in _UNSUPPORTED_ATTENTION:
            raise NotImplementedError(
                "AdaDSF routing supports attn_implementation 'sdpa' and 'eager', got "
                f"{impl!r}"
            )
        attention_mask = kwargs.get("attention_mask")

        if ratio >= 1.0:
            # Every real token runs the layer: call it unchanged (cache included), keep
            # padding. The router only matters for its gradient here, so inference skips
            # it.
            if rec is not None:
                rec.record(self.layer_index, "full", router_ran=torch.is_grad_enabled())
            y = forward(x, **kwargs)
            y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
            if torch.is_grad_enabled():
                y = gated(y, x, self.router(x))
            out = y
            if attention_mask is not None:
                real = real_token_mask(attention_mask, batch, q_len, x.device)
                out = torch.where(real.unsqueeze(-1), y, x)
            return (out, *rest) if rest is not None else out

        scores = self.router(x)

        mode = self.resolved_routing_mode()
        if mode == "causal" and q_len == 1 and self.causal_threshold is not None:
            if self.skipped_tokens_kv:
                if cache is not None:
                    check_dense_cache(cache, self.layer_index)
                return decode_step_keeping_kv(
                    self, forward, x, scores, attention_mask, kwargs, cache
                )
            return decode_step(self, forward, x, scores, attention_mask,
                               kwargs, cache_layer, impl)  # fmt: skip
        real = real_token_mask(attention_mask, batch, q_len, x.device)
        if self.skipped_tokens_kv:
            has_past = stored_keys(cache, self.layer_index) > 0
        else:
            has_past = cache_layer is not None and cache_layer.seen_tokens > 0
        if mode in ("topk", "quantile") and has_past:
            raise RuntimeError(
                f"AdaDSF {mode} routing chooses tokens over the whole "
                f"{'sequence' if mode == 'topk' else 'batch'} and "
                "cannot continue from a KV cache: use causal routing for incremental "
                "decoding (model.eval() after threshold calibration, or "
                "set_routing_mode(model, 'causal'))"
            )
        selection = self.select_tokens(scores, real, mode, has_past, attention_mask)
        return run_routed(self, forward, x, scores, selection, real, kwargs,
                          cache, cache_layer, impl)  # fmt: skip

    def extra_repr(self) -> str:
        thr = (
            "None" if self.causal_threshold is None else f"{self.causal_threshold:.4f}"
        )
        ratio = f"{self.retention_ratio:.4f}"
        return (
            f"layer_index={self.layer_index}, retention_ratio={ratio}, "
            f"routing_mode={self.routing_mode}, causal_threshold={thr}, "
            f"skipped_tokens_kv={self.skipped_tokens_kv}"
        ) + ("" if self.route_target == "layer" else f", route={self.route_target}")


# original_class() walks the MRO past every class carrying this marker
setattr(RoutedLayer, ROUTED_CLASS_MARKER, True)


def routed_class_for(layer_class: type) -> type:
    """``Routed<Name>(RoutedLayer, <Name>)``, created once per original class."""
    if issubclass(layer_class, RoutedLayer):
        return layer_class
    cls = _ROUTED_CLASSES.get(layer_class)
    if cls is None:
        cls = type(
            f"Routed{layer_class.__name__}",
            (RoutedLayer, layer_class),
            {"__module__": __name__, "__doc__": RoutedLayer.__doc__},
        )
        _ROUTED_CLASSES[layer_class] = cls
    return cls


def route_layer(
    layer: nn.Module,
    router: TokenRouter,
    retention_ratio: float,
    layer_index: int,
    cache_kwarg: str,
    config: Any,
    skip_path: SkipPath | None = None,
    skipped_tokens_kv: bool = False,
    route_target: str = "layer",
) -> nn.Module:
    """Turn ``layer`` into a routed layer in place (same object, new class, router
    added).

    ``skip_path``: what skipped tokens get added (``None``: nothing, the identity);
    ``skipped_tokens_kv``: skipped tokens still contribute keys/values;
    ``route_target``: route the whole layer or one sub-block (checked against the
    architecture first).
    """
    check_route_target(route_target, config, skip_path is not None, skipped_tokens_kv)
    if not 0.0 <= retention_ratio <= 1.0:
        raise ValueError(f"retention ratio must be in [0, 1], got {retention_ratio}")
    if isinstance(layer, RoutedLayer):
        raise ValueError(f"layer {layer_index} is already routed")
    param = next(layer.parameters(), None)
    for module in (router, skip_path):
        if param is not None and module is not None:
            dtype = param.dtype if param.is_floating_point() else None
            module.to(device=param.device, dtype=dtype)
    swap_class(layer, routed_class_for(type(layer)))
    layer.add_module("router", router)
    if skip_path is not None:
        layer.add_module("skip_path", skip_path)
    if skipped_tokens_kv:
        layer.skipped_tokens_kv = True
    if route_target != "layer":
        layer.route_target = route_target
    layer.retention_ratio = float(retention_ratio)
    layer.layer_index = int(layer_index)
    layer.cache_kwarg = cache_kwarg
    layer._adadsf_config = config
    windows = sliding_windows(config) if config is not None else ()
    layer.attention_window = (
        windows[layer_index] if layer_index < len(windows) else None
    )
    return layer


def unroute_layer(layer: nn.Module) -> nn.Module:
    """Undo :func:`route_layer`, and the hooks its router put on the layer."""
    if not isinstance(layer, RoutedLayer):
        return layer
    original = original_class(type(layer))
    router = layer._modules.pop("router")
    getattr(router, "detach_from", lambda _layer: None)(layer)  # e.g. FTP's context
    layer._modules.pop("skip_path", None)
    for attr in (
        "skipped_tokens_kv",
        "route_target",
        "retention_ratio",
        "layer_index",
        "cache_kwarg",
        "_adadsf_config",
        "routing_mode",
        "causal_threshold",
        "attention_window",
        "routing_recorder",
    ):
        layer.__dict__.pop(attr, None)
    swap_class(layer, original)
    return layer


def routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """All routed decoder layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]
