"""The routed layer's incremental decoding step and the helpers both of its paths share.

Decoding one token per row in causal mode needs no gather/scatter along the sequence:
only the rows whose token passes the layer's threshold run it. Kept apart from
:mod:`adadsf_modifier.routing.routed_layer` (which calls :func:`decode_step`) because
it is the hot path of ``generate()``: one host sync per layer and step, none more.
"""

from __future__ import annotations

from typing import Any

import torch

from adadsf_modifier.routing.cache import RoutedCacheLayer
from adadsf_modifier.routing.selection import attention_mask_kwargs
from adadsf_modifier.utils import real_token_mask

__all__ = ["decode_step", "gated", "pass_through"]


def decode_step(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    cache_layer: RoutedCacheLayer | None,
    impl: str,
) -> Any:
    """One new token per row (causal mode): only the rows whose token passes run
    ``layer``.

    ``forward`` is the original decoder layer's forward (bound). The rows that run are
    picked with one host sync (``index_select`` on the batch), their cached
    keys/values are the slots this layer stored for them, and a mask is built only when
    some of those slots are filler (a row skipped a step another row ran) or out of a
    sliding window.
    """
    batch = x.shape[0]
    first = layer.keep_first_token and (
        cache_layer is None or cache_layer.seen_tokens == 0
    )
    if attention_mask is None:
        real = None
    else:
        real = real_token_mask(attention_mask, batch, 1, x.device)[:, 0]
    rec = layer.routing_recorder
    rows = selected = None  # rows None: every row runs
    if batch == 1:  # one sync, no index ops
        run = (first or float(scores) > layer.causal_threshold) and (
            real is None or bool(real)
        )
        if not run:
            if rec is not None:
                rec.record(layer.layer_index, "skipped", batch=1)
            return pass_through(x, cache_layer)
    else:
        selected = scores[:, 0] > layer.causal_threshold
        if first:
            selected = torch.ones_like(selected)
        if real is not None:
            selected = selected & real
        rows = selected.nonzero().squeeze(1)  # the one host sync of this layer
        if rows.numel() == 0:
            if rec is not None:
                rec.record(layer.layer_index, "skipped", batch=batch)
            return pass_through(x, cache_layer)
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
    past = None
    if cache_layer is None:
        inner[layer.cache_kwarg] = None
        inner["use_cache"] = False
    elif not cache_layer.past_fully_visible(1) or rec is not None:
        past = cache_layer.visible_slots(batch, x.device)
        past = past.reshape(batch, past.shape[-1])  # one query: [batch, slots]
    if past is not None and not cache_layer.past_fully_visible(1):
        seen = past if rows is None else past.index_select(0, rows)
        allowed = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], dim=1)
        inner.update(
            attention_mask_kwargs(
                allowed[:, None, None, :], x.dtype, impl, layer.grouped_query_attention
            )
        )
    if rec is not None:
        ran = torch.ones(batch, dtype=torch.bool) if selected is None else selected
        ran = ran.to(x.device)
        visible = 1 + (past.sum(1) if past is not None else 0)
        path = "in_place" if rows is None else "gather"
        rec.record(layer.layer_index, path, kept=ran, attended=ran * visible)

    if cache_layer is not None and rows is not None:
        with cache_layer.only_rows(rows, batch):
            y = forward(x_in, **inner)
    else:
        y = forward(x_in, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if torch.is_grad_enabled():
        y = gated(y, x_in, scores if rows is None else scores.index_select(0, rows))
    if rows is not None:
        y = x.index_copy(0, rows, y)
    if cache_layer is not None:
        valid = None if rows is None else selected.unsqueeze(1)
        cache_layer.record_step(1, valid, appended=1)
    return (y, *rest) if rest is not None else y


def pass_through(x: torch.Tensor, cache_layer: RoutedCacheLayer | None) -> torch.Tensor:
    """No token runs the layer: ``x`` passes through; the cache only counts the
    positions."""
    if cache_layer is not None:
        cache_layer.record_step(x.shape[1])
    return x


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
