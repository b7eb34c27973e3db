"""A routed layer's prefill path (``0 < r < 1``): the selected tokens run the layer on a
compacted batch, the others take the skip path, the results are scattered back.

Split from :mod:`adadsf_modifier.routing.routed_layer` (which decides the path) so each
variant of the path lives in one place: the skip path (identity, or a fitted map,
:mod:`~adadsf_modifier.routing.skip_path`) and, with ``skipped_tokens_kv``, the skipped
tokens' keys/values joining the kept tokens' attention
(:mod:`~adadsf_modifier.routing.kv_keep`). Everything works on the whole batch at once;
the only host syncs are the compacted widths.
"""

from __future__ import annotations

from typing import Any

import torch

from adadsf_modifier.routing.architectures import architecture_for_config
from adadsf_modifier.routing.cache import RoutedCacheLayer
from adadsf_modifier.routing.decode import gated
from adadsf_modifier.routing.kept_attention import KeptQueries, causal_kernel_applies
from adadsf_modifier.routing.kv_keep import (
    MergedKV,
    gather_for_kept,
    project_kv,
    query_rows_mask,
    skipped_kv,
    stored_keys,
)
from adadsf_modifier.routing.selection import (
    attended_pairs,
    attention_mask_kwargs,
    gather_tokens,
    scatter_tokens,
    selected_attention_mask,
)
from adadsf_modifier.routing.skip_path import skip_path_of
from adadsf_modifier.routing.token_choice import positions_of

__all__ = ["run_routed", "skip_all", "skipped_slots", "check_dense_cache"]


def skipped_slots(
    real: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(index, valid)`` of the real tokens not at the positions ``index`` (the
    selected ones, unused slots holding ``seq``; ``None``: none selected), as
    :func:`select_by_mask` lays them out, or ``None`` when every real token runs. One
    host sync."""
    seq = real.shape[1]
    # the real tokens with the selected ones cleared; unused slots (at ``seq``) clear
    # the extra column
    free = torch.nn.functional.pad(real, (0, 1))
    if index is not None:
        free.scatter_(1, index, False)
    skip, valid, _ = positions_of(free[:, :seq])
    return (skip, valid) if skip is not None else None


def check_dense_cache(cache: Any, layer_idx: int) -> None:
    """A kv-keeping layer caches every position in the model's own cache layer."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        if isinstance(layers[layer_idx], RoutedCacheLayer):
            raise RuntimeError(
                f"cache layer {layer_idx} was filled by a routed layer that did not "
                "keep skipped tokens' keys/values; start a new cache after changing "
                "skipped_tokens_kv"
            )


def skip_all(
    layer: Any, x: torch.Tensor, real: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No token runs the layer: ``(x + u(x) on real tokens, tokens that took u)``.

    ``real`` ``None``: every token is real. Identity skip path: ``x`` itself.
    """
    skip_map = skip_path_of(layer)
    if skip_map is None:
        return x, None
    update = skip_map(x)
    if real is None:
        return x + update, torch.full((x.shape[0],), x.shape[1])
    return x + update * real.unsqueeze(-1).to(update.dtype), real.sum(1)


def run_routed(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    selection: tuple[torch.Tensor | None, torch.Tensor | None, int],
    real: torch.Tensor,
    kwargs: dict[str, Any],
    cache: Any,
    cache_layer: RoutedCacheLayer | None,
    impl: str,
) -> Any:
    """Run the selected tokens ``selection = (index, valid, k_max)`` through
    ``forward`` (the original layer's, bound) and the rest through the skip path.

    ``cache``: the model's KV cache (kv-keeping layers store every position there);
    ``cache_layer``: the layer's routed cache (others store only the tokens that ran).
    """
    index, valid, k_max = selection
    rec = layer.routing_recorder
    q_len = x.shape[1]
    skip_map = skip_path_of(layer)
    keep_kv = bool(layer.skipped_tokens_kv)
    if keep_kv and cache is not None:
        check_dense_cache(cache, layer.layer_index)
    need_kv = keep_kv and (k_max > 0 or cache is not None)
    slots = (
        skipped_slots(real, index if k_max else None)
        if skip_map is not None or need_kv
        else None
    )
    x_s = gather_tokens(x, slots[0]) if slots is not None else None
    # how many took the skip path: only the recorder reads it
    n_skip = slots[1].sum(1) if slots is not None and rec is not None else None
    pe = kwargs.get("position_embeddings")
    spec = architecture_for_config(layer._adadsf_config) if need_kv else None

    if k_max == 0:
        kv_count = None
        if need_kv:  # later tokens (decoding) will attend to these positions
            k, v = project_kv(layer, spec, x, pe)
            cache.update(k, v, layer.layer_index)
            kv_count = real.sum(1)
        out = x
        if skip_map is not None and slots is not None:
            out = scatter_tokens(x, slots[0], x_s + skip_map(x_s))
        if rec is not None:
            skipped = n_skip if skip_map is not None else None
            rec.record(layer.layer_index, "skipped", batch=x.shape[0],
                       skip_path=skipped, kv=kv_count)  # fmt: skip
        if cache_layer is not None:
            cache_layer.record_step(q_len)
        return out

    inner = gather_for_kept(kwargs, index)
    attention_mask = kwargs.get("attention_mask")
    causal_kernel = False
    if keep_kv:
        keys = values = None
        if slots is not None:
            keys, values = skipped_kv(layer, spec, x_s, pe, slots[0], q_len)
        kv_len = stored_keys(cache, layer.layer_index) + q_len
        causal_kernel = causal_kernel_applies(attention_mask, impl, kv_len, q_len)
        rows = allowed = None
        if not causal_kernel:
            rows = query_rows_mask(attention_mask, index, valid, q_len, kv_len)
            allowed = rows.unsqueeze(1)
        inner[layer.cache_kwarg] = MergedKV(keys, values, index, q_len, cache)
        inner["use_cache"] = cache is not None
    else:
        allowed = selected_attention_mask(
            attention_mask, index, valid, cache_layer, impl
        )
        if cache_layer is None:
            inner[layer.cache_kwarg] = None
            inner["use_cache"] = False
    if rec is not None:
        kept = valid.sum(1)
        kv_count = None
        if keep_kv:
            if causal_kernel:  # plain causal, nothing cached: position p sees p + 1
                pairs = ((index + 1) * valid).sum(1)
            else:
                pairs = (rows & valid.unsqueeze(-1)).sum((1, 2))
            kv_count = n_skip if n_skip is not None else torch.zeros_like(kept)
        else:
            pairs = attended_pairs(attention_mask, index, valid, cache_layer, allowed)
        skipped = n_skip if skip_map is not None else None
        rec.record(layer.layer_index, "gather", kept, pairs, skip_path=skipped,
                   kv=kv_count)  # fmt: skip
    if causal_kernel:
        inner.update(attention_mask=None, is_causal=False,
                     position_bias=KeptQueries(index, q_len))  # fmt: skip
    else:
        inner.update(
            attention_mask_kwargs(
                allowed,
                x.dtype,
                impl,
                layer.grouped_query_attention,
                float_mask=attention_mask is not None
                and attention_mask.dtype != torch.bool,
            )
        )
    x_sel = gather_tokens(x, index)
    y = forward(x_sel, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if cache_layer is not None:
        cache_layer.record_step(q_len, valid, appended=k_max, index=index)
    if torch.is_grad_enabled():
        # the router learns how much running the layer beats the skip path
        base = x_sel if skip_map is None else x_sel + skip_map(x_sel)
        y = gated(y, base, scores.gather(1, index.clamp(max=q_len - 1)))
    more = None
    if skip_map is not None and slots is not None:
        more = (slots[0], x_s + skip_map(x_s))
    # no mask means no padding: the kept and skipped tokens then fill every position
    covers_all = more is not None and attention_mask is None
    out = scatter_tokens(x, index, y, more, covers_all=covers_all)
    return (out, *rest) if rest is not None else out
