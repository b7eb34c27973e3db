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

from adadsf_modifier.routing.cache import RoutedCacheLayer, routed_cache_layer
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.selection import (
    compact_attention_mask,
    gather_position_embeddings,
    gather_tokens,
    is_causal_padding_mask,
    scatter_tokens,
    select_by_mask,
    select_topk,
    to_attention_dtype,
    tokens_to_keep_per_row,
)
from adadsf_modifier.utils import real_token_mask

__all__ = ["RoutedLayer", "route_layer", "unroute_layer", "routed_class_for"]

_UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_ROUTED_CLASSES: dict[type, type] = {}


class RoutedLayer(nn.Module):
    """Mixin for routed decoder layers; ``isinstance(layer, RoutedLayer)`` finds them.

    The selected tokens (see :mod:`adadsf_modifier.routing.modes`) run the original
    layer, attending only among themselves (and, with a KV cache, to the earlier tokens
    that ran this layer) at their original positions; the others leave it bit-identical.
    The update of a selected token is multiplied by a straight-through gate ``1 +
    sigmoid(s) - sigmoid(s).detach()``: exactly 1 in value (so an untrained router at r
    = 1 reproduces the dense layer exactly), while the router receives ``d loss / d out
    * (out - in) * sigmoid'(s)`` as gradient.
    """

    router: TokenRouter
    retention_ratio: float
    layer_index: int
    cache_kwarg: str
    routing_mode: str = "auto"
    causal_threshold: float | None = None
    keep_first_token: bool = True

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
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(index, valid, k_max)`` of the tokens this layer runs (``index`` None if
        none).

        The first real token of a sequence (the attention sink every later token attends
        to) always runs while ``keep_first_token`` is set; in top-k mode it counts
        toward ``K``. ``has_past``: the batch continues from a cache, so it holds no
        first token.
        """
        mode = mode or self.resolved_routing_mode()
        ratio = float(self.retention_ratio)
        if ratio <= 0.0:
            return None, None, 0
        first = None
        if self.keep_first_token and not has_past:
            first = real & (real.cumsum(dim=1) == 1)
            scores = scores.masked_fill(first, float("inf"))
        if mode == "topk":
            keep = tokens_to_keep_per_row(real, ratio)
            k_max = int(keep.max())
            if k_max == 0:
                return None, None, 0
            index, valid = select_topk(scores, real, keep, k_max)
            return index, valid, k_max
        if mode == "causal":
            if self.causal_threshold is None:
                raise RuntimeError(
                    f"layer {self.layer_index} has no causal threshold; calibrate thresholds "
                    "first (adadsf_modifier.routing.calibrate_thresholds)"
                )
            selected = real & (scores > self.causal_threshold)
            if first is not None:
                selected = selected | first
            k_max = int(selected.sum(dim=1).max())
            if k_max == 0:
                return None, None, 0
            index, valid = select_by_mask(selected, k_max)
            return index, valid, k_max
        raise ValueError(f"unknown routing mode {mode!r}")

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
        ratio = float(self.retention_ratio)
        batch, q_len, _ = x.shape
        cache = kwargs.get(self.cache_kwarg)
        cache_layer = (
            routed_cache_layer(cache, self.layer_index)
            if cache is not None and ratio < 1.0
            else None
        )

        if ratio <= 0.0:  # a removed layer (ShortGPT-style allocation)
            return _skipped(x, cache_layer)
        impl = getattr(self._adadsf_config, "_attn_implementation", "sdpa")
        if impl in _UNSUPPORTED_ATTENTION:
            raise NotImplementedError(
                f"AdaDSF routing supports attn_implementation 'sdpa' and 'eager', got {impl!r}"
            )
        attention_mask = kwargs.get("attention_mask")

        if ratio >= 1.0:
            # Every real token runs the layer: call it unchanged (cache included), keep
            # padding. The router only matters for its gradient here, so inference skips
            # it.
            y = super().forward(x, **kwargs)
            y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
            if torch.is_grad_enabled():
                y = _gated(y, x, self.router(x))
            out = y
            if attention_mask is not None:
                real = real_token_mask(attention_mask, batch, q_len, x.device)
                out = torch.where(real.unsqueeze(-1), y, x)
            return (out, *rest) if rest is not None else out

        scores = self.router(x)

        mode = self.resolved_routing_mode()
        if mode == "causal" and q_len == 1 and self.causal_threshold is not None:
            return self._decode_step(
                x, scores, attention_mask, kwargs, cache_layer, impl
            )
        real = real_token_mask(attention_mask, batch, q_len, x.device)
        has_past = cache_layer is not None and cache_layer.seen_tokens > 0
        if mode == "topk" and has_past:
            raise RuntimeError(
                "AdaDSF top-k routing chooses tokens over the whole sequence and cannot "
                "continue from a KV cache: use causal routing for incremental decoding "
                "(model.eval() after threshold calibration, or set_routing_mode(model, "
                "'causal'))"
            )
        index, valid, k_max = self.select_tokens(scores, real, mode, has_past)
        if k_max == 0:
            return _skipped(x, cache_layer)

        inner = dict(kwargs)
        inner["position_embeddings"] = gather_position_embeddings(
            kwargs.get("position_embeddings"), index
        )
        if kwargs.get("position_ids") is not None:
            inner["position_ids"] = gather_tokens(kwargs["position_ids"], index)
        inner.update(
            self._mask_kwargs(
                self._selected_mask(attention_mask, index, valid, cache_layer, impl),
                x.dtype,
                impl,
                float_mask=attention_mask is not None
                and attention_mask.dtype != torch.bool,
            )
        )
        if cache_layer is None:
            inner[self.cache_kwarg] = None
            inner["use_cache"] = False
        x_sel = gather_tokens(x, index)
        y = super().forward(x_sel, **inner)
        y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
        if cache_layer is not None:
            cache_layer.record_step(q_len, valid, appended=k_max)
        if torch.is_grad_enabled():
            y = _gated(y, x_sel, scores.gather(1, index.clamp(max=q_len - 1)))
        out = scatter_tokens(x, index, y)
        return (out, *rest) if rest is not None else out

    def _decode_step(self, x, scores, attention_mask, kwargs, cache_layer, impl):
        """One new token per row (causal mode): only the rows whose token passes run the
        layer.

        No gather/scatter along the sequence and no per-step mask from the model: the
        rows that run are picked with one host sync (``index_select`` on the batch),
        their cached keys/values are the slots this layer stored for them, and a mask is
        built only when some of those slots are filler (a row skipped a step another row
        ran).
        """
        batch = x.shape[0]
        first = self.keep_first_token and (
            cache_layer is None or cache_layer.seen_tokens == 0
        )
        if attention_mask is None:
            real = None
        else:
            real = real_token_mask(attention_mask, batch, 1, x.device)[:, 0]
        rows = selected = None  # rows None: every row runs
        if batch == 1:  # one sync, no index ops
            run = (first or float(scores) > self.causal_threshold) and (
                real is None or bool(real)
            )
            if not run:
                return _skipped(x, cache_layer)
        else:
            selected = scores[:, 0] > self.causal_threshold
            if first:
                selected = torch.ones_like(selected)
            if real is not None:
                selected = selected & real
            rows = selected.nonzero().squeeze(1)  # the one host sync of this layer
            if rows.numel() == 0:
                return _skipped(x, cache_layer)
            if rows.numel() == batch:
                rows = None

        inner = dict(kwargs)
        inner["attention_mask"] = None
        x_in = x
        if rows is not None:
            x_in = x.index_select(0, rows)
            inner["position_embeddings"] = _rows_of(
                kwargs.get("position_embeddings"), rows, batch
            )
            inner["position_ids"] = _rows_of(kwargs.get("position_ids"), rows, batch)
        if cache_layer is None:
            inner[self.cache_kwarg] = None
            inner["use_cache"] = False
        elif not cache_layer.all_slots_valid:
            past = cache_layer.slot_valid(batch, x.device)
            if rows is not None:
                past = past.index_select(0, rows)
            allowed = torch.cat([past, past.new_ones(past.shape[0], 1)], dim=1)[
                :, None, None, :
            ]
            inner.update(self._mask_kwargs(allowed, x.dtype, impl))

        if cache_layer is not None and rows is not None:
            with cache_layer.only_rows(rows, batch):
                y = super().forward(x_in, **inner)
        else:
            y = super().forward(x_in, **inner)
        y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
        if torch.is_grad_enabled():
            y = _gated(
                y, x_in, scores if rows is None else scores.index_select(0, rows)
            )
        if rows is not None:
            y = x.index_copy(0, rows, y)
        if cache_layer is not None:
            valid = None if rows is None else selected.unsqueeze(1)
            cache_layer.record_step(1, valid, appended=1)
        return (y, *rest) if rest is not None else y

    def _mask_kwargs(
        self,
        allowed: torch.Tensor | None,
        dtype: torch.dtype,
        impl: str,
        float_mask: bool = False,
    ) -> dict[str, Any]:
        """The layer keyword(s) that apply the boolean mask ``allowed`` (``None``: no
        mask).

        transformers' SDPA path gives up grouped-query attention whenever an
        ``attention_mask`` is passed and copies every cached key and value ``num_heads /
        num_kv_heads`` times (``repeat_kv``), which on SmolLM2 costs more than the
        layers a token skips. Its ``position_bias`` argument (an additive mask applied
        inside the same SDPA call, made for T5-style biases) keeps ``enable_gqa``, so
        grouped-query layers get the mask that way; others get the usual boolean (SDPA)
        or additive (eager) mask.
        """
        if allowed is None:
            return {"attention_mask": None}
        if impl == "sdpa" and self._grouped_query_attention():
            # is_causal=False: the mask is complete; transformers would otherwise add a
            # top-left causal mask and crop the keys to the query length.
            return {
                "attention_mask": None,
                "is_causal": False,
                "position_bias": to_attention_dtype(allowed, dtype, False),
            }
        return {
            "attention_mask": to_attention_dtype(
                allowed, dtype, impl != "eager" and not float_mask
            )
        }

    def _grouped_query_attention(self) -> bool:
        attn = getattr(self, "self_attn", None)
        return getattr(attn, "num_key_value_groups", 1) > 1

    @staticmethod
    def _selected_mask(attention_mask, index, valid, cache_layer, impl):
        """``None`` when the attention kernel's own behaviour is exact, else an explicit
        mask.

        Without a cached past, SDPA's causal kernel is exact whenever the layer's own
        mask is plain causal + padding: the selected tokens of a row sit in position
        order, padding is never selected, and unused slots trail every used one (so no
        used slot sees them). That keeps the fast causal kernel (it skips the upper
        triangle) for rows that keep different numbers of tokens. One query with an
        all-valid past may see everything.
        """
        batch, k = index.shape
        num_past = cache_layer.num_slots if cache_layer is not None else 0
        past_clean = cache_layer is None or cache_layer.all_slots_valid
        if num_past == 0 and impl != "eager" and is_causal_padding_mask(attention_mask):
            return None
        if k == 1 and attention_mask is None and past_clean:
            return None
        past_valid = cache_layer.slot_valid(batch, index.device) if num_past else None
        return compact_attention_mask(attention_mask, index, valid, past_valid)

    def extra_repr(self) -> str:
        thr = (
            "None" if self.causal_threshold is None else f"{self.causal_threshold:.4f}"
        )
        return (
            f"layer_index={self.layer_index}, retention_ratio={self.retention_ratio:.4f}, "
            f"routing_mode={self.routing_mode}, causal_threshold={thr}"
        )


def _skipped(x: torch.Tensor, cache_layer: RoutedCacheLayer | None) -> torch.Tensor:
    """No token runs the layer: ``x`` passes through; the cache only counts the
    positions."""
    if cache_layer is not None:
        cache_layer.record_step(x.shape[1])
    return x


def _rows_of(value: Any, rows: torch.Tensor, batch: int) -> Any:
    """``value`` (a tensor or tuple of tensors with a leading batch dim) at ``rows``.

    A leading dim of 1 is a broadcast over the batch and is left as is.
    """
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    return (
        value.index_select(0, rows) if value.shape[0] == batch and batch > 1 else value
    )


def _gated(y: torch.Tensor, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``y * g + x * (1 - g)`` with the straight-through gate ``g = 1 + sigmoid(s) -
    sg(...)``.

    ``g`` is exactly 1 in value, so the result equals ``y``; only the router's gradient
    ``d/ds = (y - x) * sigmoid'(s)`` is added. Callers skip it when no gradient is
    needed.
    """
    p = torch.sigmoid(scores)
    gate = (1.0 + (p - p.detach())).unsqueeze(-1).to(y.dtype)
    return y * gate + x * (1 - gate)


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
) -> nn.Module:
    """Turn ``layer`` into a routed layer in place (same object, new class, router
    added)."""
    if not 0.0 <= retention_ratio <= 1.0:
        raise ValueError(f"retention ratio must be in [0, 1], got {retention_ratio}")
    if isinstance(layer, RoutedLayer):
        raise ValueError(f"layer {layer_index} is already routed")
    param = next(layer.parameters(), None)
    if param is not None:
        router.to(
            device=param.device,
            dtype=param.dtype if param.is_floating_point() else None,
        )
    _swap_class(layer, routed_class_for(type(layer)))
    layer.add_module("router", router)
    layer.retention_ratio = float(retention_ratio)
    layer.layer_index = int(layer_index)
    layer.cache_kwarg = cache_kwarg
    layer._adadsf_config = config
    return layer


def unroute_layer(layer: nn.Module) -> nn.Module:
    """Undo :func:`route_layer` (used to leave a model untouched when a later step
    fails)."""
    if not isinstance(layer, RoutedLayer):
        return layer
    original = next(
        c for c in type(layer).__mro__[1:] if not issubclass(c, RoutedLayer)
    )
    del layer._modules["router"]
    for attr in (
        "retention_ratio",
        "layer_index",
        "cache_kwarg",
        "_adadsf_config",
        "routing_mode",
        "causal_threshold",
    ):
        layer.__dict__.pop(attr, None)
    _swap_class(layer, original)
    return layer


def _swap_class(layer: nn.Module, new_class: type) -> None:
    """``layer.__class__ = new_class``, carrying any instance-level ``forward`` along.

    compressed-tensors' offloading (which llm-compressor's pipelines put on every
    module) replaces ``layer.forward`` by a wrapper that calls the class's forward
    *captured when it was installed*, and ``remove_dispatch`` leaves a bound copy of
      that function behind. Either
    would silently bypass (or keep) routing after a class swap, so both are re-pointed.
    """
    old_forward = type(layer).forward
    d = layer.__dict__
    if "_original_forward_func" in d:  # offloaded: the wrapper calls this function
        if d["_original_forward_func"] is not old_forward:
            raise RuntimeError(
                f"{type(layer).__name__}'s offloading wrapper calls {d['_original_forward_func']!r}, "
                "not the class's forward; AdaDSF cannot tell which forward to route"
            )
        d["_original_forward_func"] = new_class.forward
    elif "forward" in d:  # a leftover bound copy of the class's forward
        if getattr(d["forward"], "__func__", None) is not old_forward:
            raise RuntimeError(
                f"{type(layer).__name__} has an instance-level forward ({d['forward']!r}) that "
                "routing would bypass; remove it before routing"
            )
        del d["forward"]
    layer.__class__ = new_class
