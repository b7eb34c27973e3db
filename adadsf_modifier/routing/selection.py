"""Tensor helpers that turn the chosen tokens (:mod:`~adadsf_modifier.routing.
token_choice`) into a compacted batch and back.

All of them work on the whole batch at once (no Python loop over rows): a routed layer
gathers the selected tokens of every row into a dense ``[batch, K_max, hidden]`` tensor,
runs the original layer on it with a matching attention mask, and scatters the results
back.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from adadsf_modifier.utils import allowed_by_mask

__all__ = [
    "is_causal_padding_mask",
    "flat_positions",
    "gather_tokens",
    "gather_position_embeddings",
    "compact_attention_mask",
    "selected_attention_mask",
    "attended_pairs",
    "attention_mask_kwargs",
    "to_attention_dtype",
    "scatter_tokens",
]


_MASK_VERDICTS: dict[int, tuple[weakref.ref, bool]] = {}


def is_causal_padding_mask(attention_mask: torch.Tensor | None) -> bool:
    """Whether a layer's mask (no cached past) is nothing but causal + padding of keys.

    ``None`` (SDPA's causal fast path) is. A 4D mask qualifies when, for every real
    query, the allowed keys are exactly the real keys at or before it (no sliding
    window, no packed sequences, no custom pattern). Every decoder layer of a forward
    receives the same mask object, so the verdict is computed once per mask and
    remembered while it lives.
    """
    if attention_mask is None:
        return True
    if (
        attention_mask.dim() != 4
        or attention_mask.shape[-1] != attention_mask.shape[-2]
    ):
        return False
    key = id(attention_mask)
    hit = _MASK_VERDICTS.get(key)
    if hit is not None and hit[0]() is attention_mask:
        return hit[1]
    full = attention_mask[:, 0]
    allowed = allowed_by_mask(full)
    n = allowed.shape[-1]
    real = torch.diagonal(allowed, dim1=-2, dim2=-1)  # [batch or 1, n]
    expected = (
        torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
        & real[:, None, :]
    )
    verdict = not bool(((allowed ^ expected) & real[:, :, None]).any())
    for k in [k for k, (ref, _) in _MASK_VERDICTS.items() if ref() is None]:
        del _MASK_VERDICTS[k]
    _MASK_VERDICTS[key] = (weakref.ref(attention_mask), verdict)
    return verdict


def flat_positions(index: torch.Tensor, row_len: int) -> torch.Tensor:
    """``[batch * K]`` positions of ``index [batch, K]`` in a tensor whose batch and
    sequence dims are flattened into one of ``batch * row_len`` rows: what a row-wise
    ``index_select`` / ``index_copy_`` over ``[batch, seq, ...]`` reads or writes.
    ``index`` is int64, as the selection makes it (one row returns it as it is)."""
    if index.shape[0] == 1:  # no offsets: a view (a prefill or decode of one prompt)
        return index.reshape(-1)
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    return (index + offsets * row_len).reshape(-1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, k]]`` along dim 1; out-of-range (unused) slots read the last
    token. ``x`` may have batch 1 for any ``index`` batch (broadcast, e.g. rotary
    tables).

    One ``index_select`` over the flattened ``[batch * seq]`` rows: a row copy, ~15x
    faster on CPU than ``gather`` with an index expanded over the hidden size (which
    costs an index read per element; measured in bfloat16, ``lab/NOTEBOOK.md``
    §4).
    """
    batch, k = index.shape
    seq = x.shape[1]
    idx = index.clamp(max=seq - 1)
    rest = x.shape[2:]
    if x.shape[0] == 1:
        if batch == 1:  # one prompt: the rows along dim 1, in one call
            return x.index_select(1, idx.view(-1))
        return x[0].index_select(0, idx.reshape(-1)).view(batch, k, *rest)
    rows = x.reshape(batch * seq, *rest).index_select(0, flat_positions(idx, seq))
    return rows.view(batch, k, *rest)


def gather_position_embeddings(
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotary ``(cos, sin)`` of the selected tokens, so each keeps its original
    position."""
    if position_embeddings is None:
        return None
    cos, sin = position_embeddings
    return gather_tokens(cos, index), gather_tokens(sin, index)


def compact_attention_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    past_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean ``[batch, 1, K, past_slots + K]`` mask of the selected queries.

    Among the new tokens it is read off the layer's own 4D mask at the selected (query,
    key) positions, so causality, padding and any sliding window carry over; ``None``
    means plain causal. Cached slots are visible where ``past_valid`` says so: ``[batch,
    past_slots]`` (the same for every query) or ``[batch, K, past_slots]`` (per query,
    under a sliding window). Unused slots are masked as keys, and each slot may attend
    to itself so no row is fully masked (SDPA would return NaN; those rows are
    discarded anyway).
    """
    batch, k = index.shape
    device = index.device
    if attention_mask is None:
        allowed = (
            torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(batch, k, k)
        )
    else:
        full = attention_mask[:, 0]
        kv_len = full.shape[-1]
        offset = kv_len - full.shape[-2]  # keys of the current tokens start here
        idx = index.clamp(max=full.shape[-2] - 1)
        if full.shape[0] == 1 and batch > 1:
            full = full.expand(batch, *full.shape[1:])
        rows = torch.arange(batch, device=device).view(batch, 1, 1)
        picked = full[rows, idx.unsqueeze(2), offset + idx.unsqueeze(1)]
        allowed = allowed_by_mask(picked)
    allowed = (allowed & valid.unsqueeze(1)) | torch.eye(
        k, dtype=torch.bool, device=device
    )
    if past_valid is not None and past_valid.shape[-1] > 0:
        if past_valid.dim() == 2:
            past_valid = past_valid.unsqueeze(1)
        past = past_valid.expand(batch, k, past_valid.shape[-1])
        allowed = torch.cat([past, allowed], dim=-1)
    return allowed.unsqueeze(1)


def selected_attention_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    cache_layer: Any,
    impl: str,
) -> torch.Tensor | None:
    """The mask the selected tokens attend with: ``None`` when the attention kernel's
    own behaviour is exact, else :func:`compact_attention_mask`.

    Without a cached past, SDPA's causal kernel is exact whenever the layer's own mask
    is plain causal + padding: the selected tokens of a row sit in position order,
    padding is never selected, and unused slots trail every used one (so no used slot
    sees them). That keeps the fast causal kernel (it skips the upper triangle) for
    rows that keep different numbers of tokens. One query whose cached past is all
    visible may see everything. ``cache_layer``: the layer's
    :class:`~adadsf_modifier.routing.cache.RoutedCacheLayer` or ``None``.
    """
    batch, k = index.shape
    num_past = cache_layer.num_slots if cache_layer is not None else 0
    if num_past == 0 and impl != "eager" and is_causal_padding_mask(attention_mask):
        return None
    if (
        k == 1
        and attention_mask is None
        and (cache_layer is None or cache_layer.past_fully_visible(1))
    ):
        return None
    return compact_attention_mask(
        attention_mask, index, valid, _past(cache_layer, index)
    )


def attended_pairs(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    cache_layer: Any,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[batch]`` (query, key) pairs the selected tokens attend to, cached keys
    included.

    ``allowed``: what :func:`selected_attention_mask` returned (rebuilt explicitly when
    it is ``None``, i.e. when the kernel's own causal mask ran).
    """
    if allowed is None:
        allowed = compact_attention_mask(
            attention_mask, index, valid, _past(cache_layer, index)
        )
    return (allowed[:, 0] & valid.unsqueeze(-1)).sum((1, 2))


def _past(cache_layer: Any, index: torch.Tensor) -> torch.Tensor | None:
    if cache_layer is None or cache_layer.num_slots == 0:
        return None
    return cache_layer.visible_slots(index.shape[0], index.device, index)


def attention_mask_kwargs(
    allowed: torch.Tensor | None,
    dtype: torch.dtype,
    impl: str,
    grouped_query: bool,
    float_mask: bool = False,
) -> dict[str, Any]:
    """The decoder-layer keyword(s) that apply the boolean mask ``allowed`` (``None``:
    no mask).

    transformers' SDPA path gives up grouped-query attention whenever an
    ``attention_mask`` is passed and copies every cached key and value ``num_heads /
    num_kv_heads`` times (``repeat_kv``), which on SmolLM2 costs more than the layers a
    token skips. Its ``position_bias`` argument (an additive mask applied inside the
    same SDPA call, made for T5-style biases) keeps ``enable_gqa``, so grouped-query
    layers (``grouped_query``) get the mask that way; others get the usual boolean
    (SDPA) or additive (eager, or ``float_mask``: the model passed an additive one)
    mask.
    """
    if allowed is None:
        return {"attention_mask": None}
    if impl == "sdpa" and grouped_query:
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


def to_attention_dtype(
    mask: torch.Tensor, dtype: torch.dtype, as_bool: bool
) -> torch.Tensor:
    """Boolean mask for SDPA, additive float mask for eager attention."""
    if as_bool:
        return mask
    return torch.where(
        mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min
    )


def scatter_tokens(
    x: torch.Tensor,
    index: torch.Tensor,
    values: torch.Tensor,
    more: tuple[torch.Tensor, torch.Tensor] | None = None,
    covers_all: bool = False,
) -> torch.Tensor:
    """``x`` with ``values`` written at ``index`` (unused slots land in a dropped extra
    slot), then ``more = (index, values)`` if given (e.g. the skip path's outputs).

    Tokens that were not selected come back bit-identical to ``x``. One buffer and a
    row-wise ``index_copy_`` per write (cheaper on CPU than ``scatter`` with an index
    expanded over the hidden size, like :func:`gather_tokens`); ``covers_all``: the
    writes reach every position, so ``x`` is not copied into the buffer first.
    """
    batch, seq_len, hidden = x.shape
    if covers_all:
        padded = x.new_empty(batch, seq_len + 1, hidden)
    else:
        padded = torch.cat([x, x.new_zeros(batch, 1, hidden)], dim=1)
    flat = padded.view(-1, hidden)
    for idx, val in [(index, values)] + ([more] if more is not None else []):
        rows = flat_positions(idx, seq_len + 1)
        flat.index_copy_(0, rows, val.reshape(-1, hidden).to(x.dtype))
    return padded[:, :seq_len]
