"""The routed layer's incremental decoding step and the helpers both of its paths share.

Decoding one token per row in causal mode needs no gather/scatter along the sequence:
only the rows whose token passes the layer's threshold run it. Kept apart from
:mod:`adadsf_modifier.routing.routed_layer` (which calls :func:`decode_step`) because
it is the hot path of ``generate()``: one host sync per layer and step, none more.
Rows that skip take the layer's skip path (:mod:`~adadsf_modifier.routing.skip_path`);
a layer keeping skipped tokens' keys/values (:mod:`~adadsf_modifier.routing.kv_keep`)
decodes with :func:`decode_step_keeping_kv` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from adadsf_modifier.routing.architectures import architecture_for_config
from adadsf_modifier.routing.cache import RoutedCacheLayer
from adadsf_modifier.routing.kv_keep import MergedKV, project_kv, stored_keys
from adadsf_modifier.routing.selection import attention_mask_kwargs
from adadsf_modifier.routing.skip_path import skip_path_of
from adadsf_modifier.utils import allowed_by_mask, first_real_tokens, real_token_mask

__all__ = ["decode_step", "decode_step_keeping_kv", "gated", "pass_through"]


def _decide(
    layer: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    first: bool,
) -> tuple[Any, Any, Any, int, Any]:
    """``(selected, rows, skip_rows, n, real)``: which rows run (``n`` of them, with
    one host sync). ``rows`` / ``skip_rows`` (ascending) are ``None`` unless some rows
    run and some skip; ``selected`` is ``None`` at batch size 1; ``real [batch]``: the
    rows whose new token is not padding (``None``: all)."""
    batch = x.shape[0]
    real = late = None
    if attention_mask is not None:
        real_q = real_token_mask(attention_mask, batch, 1, x.device)
        real = real_q[:, 0]
        if not first and layer.keep_first_token:
            # a row whose past was all padding gets its first real token now
            late = first_real_tokens(attention_mask, real_q)[:, 0]
    if batch == 1 and late is None:  # one sync, no index ops
        run = (first or float(scores) > layer.causal_threshold) and (
            real is None or bool(real)
        )
        return None, None, None, int(run), real
    selected = scores[:, 0] > layer.causal_threshold
    if first:
        selected = torch.ones_like(selected)
    elif late is not None:
        selected = selected | late
    if batch == 1:
        run = bool(selected[0] & real[0]) if real is not None else bool(selected[0])
        return None, None, None, int(run), real
    if real is not None:
        selected = selected & real
    n = int(selected.sum())  # the one host sync of this layer
    if n in (0, batch):
        return selected, None, None, n, real
    order = torch.argsort((~selected).to(torch.int8), stable=True)
    return selected, order[:n], order[n:], n, real


def _skipping(
    batch: int, skip_rows: torch.Tensor | None, real: torch.Tensor | None
) -> torch.Tensor:
    """``[batch]`` 1 for the real rows among ``skip_rows`` (``None``: every row)."""
    count = torch.ones(batch, dtype=torch.long)
    if skip_rows is not None:
        count = torch.zeros(batch, dtype=torch.long).index_fill(0, skip_rows.cpu(), 1)
    return count if real is None else count * real.cpu().long()


def _skip_rows(
    layer: Any, x: torch.Tensor, skip_rows: torch.Tensor | None, real: Any, rec: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` with the skip path applied to ``skip_rows`` (``None``: every row), and,
    while recording, the ``[batch]`` count of real tokens that took it (``None``:
    identity skip path)."""
    skip_map = skip_path_of(layer)
    if skip_map is None:
        return x, None
    count = _skipping(x.shape[0], skip_rows, real) if rec is not None else None
    if skip_rows is None:
        return x + skip_map(x), count
    x_s = x.index_select(0, skip_rows)
    return x.index_copy(0, skip_rows, x_s + skip_map(x_s)), count


def _ran(selected: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    ran = torch.ones(batch, dtype=torch.bool) if selected is None else selected
    return ran.to(device)


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
    rec = layer.routing_recorder
    selected, rows, skip_rows, n, real = _decide(
        layer, x, scores, attention_mask, first
    )
    if n == 0:
        out, skipped = _skip_rows(layer, x, None, real, rec)
        if rec is not None:
            rec.record(layer.layer_index, "skipped", batch=batch, skip_path=skipped)
        return pass_through(out, cache_layer)

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
    base, skipped = x, None
    if rows is not None:
        base, skipped = _skip_rows(layer, x, skip_rows, real, rec)
    if rec is not None:
        ran = _ran(selected, batch, x.device)
        visible = 1 + (past.sum(1) if past is not None else 0)
        path = "in_place" if rows is None else "gather"
        rec.record(layer.layer_index, path, kept=ran, attended=ran * visible,
                   skip_path=skipped)  # fmt: skip

    if cache_layer is not None and rows is not None:
        with cache_layer.only_rows(rows, batch):
            y = forward(x_in, **inner)
    else:
        y = forward(x_in, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if torch.is_grad_enabled():
        y = _gated_step(layer, y, x_in, scores, rows)
    if rows is not None:
        y = base.index_copy(0, rows, y)
    if cache_layer is not None:
        valid = None if rows is None else selected.unsqueeze(1)
        cache_layer.record_step(1, valid, appended=1)
    return (y, *rest) if rest is not None else y


def decode_step_keeping_kv(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    cache: Any,
) -> Any:
    """:func:`decode_step` for a layer whose skipped tokens keep their keys/values.

    Its cache layer is the model's dense one: a row that runs is a plain dense decoding
    step (the model's own mask and cache); a row that skips still appends its keys and
    values. When only some rows run, the skipping rows' keys/values are computed
    separately and merged into the one cache update (:class:`MergedKV`).
    """
    batch = x.shape[0]
    idx = layer.layer_index
    first = layer.keep_first_token and stored_keys(cache, idx) == 0
    rec = layer.routing_recorder
    selected, rows, skip_rows, n, real = _decide(
        layer, x, scores, attention_mask, first
    )
    spec = architecture_for_config(layer._adadsf_config)
    pe = kwargs.get("position_embeddings")
    if n == 0:
        if cache is not None:
            k, v = project_kv(layer, spec, x, pe)
            cache.update(k, v, idx)
        out, skipped = _skip_rows(layer, x, None, real, rec)
        if rec is not None:
            kv = _skipping(batch, None, real) if cache is not None else None
            rec.record(idx, "skipped", batch=batch, skip_path=skipped, kv=kv)
        return out
    inner = dict(kwargs)
    x_in, base, skipped, kv = x, x, None, None
    if rows is not None:
        x_in = x.index_select(0, rows)
        k, v = project_kv(
            layer, spec, x.index_select(0, skip_rows), _rows_of(pe, skip_rows, batch)
        )
        keys = k.new_zeros(batch, *k.shape[1:]).index_copy(0, skip_rows, k)
        values = v.new_zeros(batch, *v.shape[1:]).index_copy(0, skip_rows, v)
        inner[layer.cache_kwarg] = MergedKV(keys, values, None, 1, cache, rows=rows)
        inner["use_cache"] = cache is not None
        for key in ("position_embeddings", "position_ids", "attention_mask"):
            inner[key] = _rows_of(kwargs.get(key), rows, batch)
        base, skipped = _skip_rows(layer, x, skip_rows, real, rec)
        kv = _skipping(batch, skip_rows, real) if rec is not None else None
    if rec is not None:
        ran = _ran(selected, batch, x.device)
        if attention_mask is not None and attention_mask.dim() == 4:
            visible = allowed_by_mask(attention_mask[:, 0, -1, :]).sum(-1)
        else:
            visible = stored_keys(cache, idx) + 1
        path = "in_place" if rows is None else "gather"
        rec.record(idx, path, kept=ran, attended=ran * visible, skip_path=skipped,
                   kv=kv)  # fmt: skip
    y = forward(x_in, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if torch.is_grad_enabled():
        y = _gated_step(layer, y, x_in, scores, rows)
    if rows is not None:
        y = base.index_copy(0, rows, y)
    return (y, *rest) if rest is not None else y


def _gated_step(layer, y, x_in, scores, rows) -> torch.Tensor:
    skip_map = skip_path_of(layer)
    base = x_in if skip_map is None else x_in + skip_map(x_in)
    return gated(y, base, scores if rows is None else scores.index_select(0, rows))


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
