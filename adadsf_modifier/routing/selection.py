"""Tensor helpers that turn router scores into a compacted batch of selected tokens and
back.

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
    "keep_counts",
    "tokens_to_keep",
    "tokens_to_keep_per_row",
    "select_topk",
    "select_by_mask",
    "gather_tokens",
    "gather_position_embeddings",
    "compact_attention_mask",
    "selected_attention_mask",
    "attended_pairs",
    "attention_mask_kwargs",
    "to_attention_dtype",
    "scatter_tokens",
    "cut_for_ratio",
    "threshold_beside_forced",
    "threshold_for_ratio",
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


def threshold_for_ratio(scores: torch.Tensor, ratio: float) -> float:
    """A threshold with ``mean(scores > t) ~= ratio``, midway between neighbouring
    distinct scores.

    Equal scores fall on the same side of any threshold, so with ties the cut goes to
    the gap between distinct values whose kept count is closest to ``ratio * n``.
    """
    return cut_for_ratio(scores, ratio)[0]


def cut_for_ratio(scores: torch.Tensor, ratio: float) -> tuple[float, int]:
    """``(threshold, scores kept by it)`` for :func:`threshold_for_ratio`."""
    n = scores.numel()
    if ratio >= 1.0:
        return float("-inf"), n
    if ratio <= 0.0 or n == 0:
        return float("inf"), 0
    s = scores.flatten().double().sort(descending=True).values
    n_keep = int(round(ratio * n))
    gaps = (s[:-1] > s[1:]).nonzero().flatten() + 1  # keeping c tokens is possible
    cuts = torch.cat([gaps.new_tensor([0]), gaps, gaps.new_tensor([n])])
    best = int(cuts[(cuts - n_keep).abs().argmin()])
    if best == 0:
        return float(s[0]) + 1.0, 0
    if best == n:
        return float(s[-1]) - 1.0, n
    hi, lo = float(s[best - 1]), float(s[best])
    mid = 0.5 * (hi + lo)
    # scores are compared in their own dtype: a midpoint that rounds onto ``hi`` there
    # would drop the tokens at ``hi``, so fall back to ``lo`` (kept: exactly ``> lo``)
    as_scored = float(torch.tensor(mid, dtype=scores.dtype))
    return (mid if lo <= as_scored < hi else lo), best


def threshold_beside_forced(
    free_scores: torch.Tensor, total: int, forced: int, ratio: float
) -> tuple[float, float]:
    """``(threshold, kept fraction)``: the threshold over the scores of the tokens
    that are free to skip (``free_scores``) at which ``ratio`` of all ``total`` real
    tokens run, ``forced`` of them (the attention sinks) running whatever their score;
    the fraction is what that threshold actually keeps (ties and the forced tokens can
    make ``ratio`` itself unreachable)."""
    if total == forced:  # every token is forced: nothing left to choose
        return (float("inf") if ratio < 1.0 else float("-inf")), 1.0
    free_ratio = (ratio * total - forced) / (total - forced)
    threshold, kept = cut_for_ratio(free_scores, min(max(free_ratio, 0.0), 1.0))
    return threshold, (kept + forced) / total


#: Absorbs float error in ``ratio * n`` (0.29 * 100 = 28.999999999999996 must keep 29).
_KEEP_EPS = 1e-6


def keep_counts(real_lengths: torch.Tensor, ratio: float) -> torch.Tensor:
    """The keep-count rule: ``K = max(1, floor(ratio * n))`` for each real length ``n``.

    The one place the rule lives (top-k routing, :func:`tokens_to_keep` and the FLOPs
    model's planned counts all call it). A sequence with no real token keeps none, and
    a ratio of 0 (a removed layer) keeps none. Computed in float64.
    """
    n = real_lengths
    if ratio <= 0:
        return torch.zeros_like(n)
    k = torch.floor(n.to(torch.float64) * ratio + _KEEP_EPS).to(n.dtype)
    return torch.where(n > 0, k.clamp(min=1), torch.zeros_like(n))


def tokens_to_keep(ratio: float, real_length: int) -> int:
    """:func:`keep_counts` for one sequence of ``real_length`` real tokens."""
    return int(keep_counts(torch.tensor([int(real_length)]), float(ratio))[0])


def tokens_to_keep_per_row(real: torch.Tensor, ratio: float) -> torch.Tensor:
    """:func:`keep_counts` of each row of a ``[batch, seq]`` real-token mask."""
    return keep_counts(real.sum(dim=1), ratio)


def select_topk(
    scores: torch.Tensor, real: torch.Tensor, keep: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``keep[b]`` real tokens of each row by score, returned in position order.

    Returns ``index [batch, k_max]`` (positions ascending; unused slots hold
    ``seq_len``, one past the end, so they sort last and scatter into a discarded slot)
    and ``valid [batch, k_max]``. Padding gets ``-inf`` and is never chosen while a real
    token remains (``keep <= n_real``).

    Equal scores are common (a repeated token that skipped the earlier layers has the
    same hidden state, hence the same score, at every occurrence), so ties are broken
    explicitly: the earlier token wins. A stable sort does that, and because padding
    never reorders the real tokens of a row, a prompt selects the same tokens alone and
    inside a padded batch (``topk`` breaks ties by memory layout instead).
    """
    batch, seq_len = scores.shape
    masked = scores.masked_fill(~real, float("-inf"))
    order = masked.sort(dim=1, descending=True, stable=True).indices
    top = order[:, :k_max]  # rank order, best first
    slot = torch.arange(k_max, device=scores.device).expand(batch, k_max)
    valid_rank = slot < keep.unsqueeze(1)
    top = torch.where(valid_rank, top, torch.full_like(top, seq_len))
    index = top.sort(dim=1).values
    valid = index < seq_len
    return index, valid


def select_by_mask(
    selected: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the ``selected`` tokens of each row, ascending, padded to ``k_max``
    slots.

    Same output convention as :func:`select_topk` (unused slots hold ``seq_len``).
    """
    batch, seq_len = selected.shape
    pos = torch.arange(seq_len, device=selected.device).expand(batch, seq_len)
    key = torch.where(selected, pos, torch.full_like(pos, seq_len))
    index = key.sort(dim=1).values[:, :k_max]
    return index, index < seq_len


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, k]]`` along dim 1; out-of-range (unused) slots read the last
    token."""
    idx = index.clamp(max=x.shape[1] - 1)
    shape = list(idx.shape) + list(x.shape[2:])
    idx = idx.reshape(*idx.shape, *([1] * (x.dim() - 2))).expand(shape)
    return x.expand(index.shape[0], *x.shape[1:]).gather(1, idx)


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
    x: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``x`` with ``values`` written at ``index`` (unused slots land in a dropped extra
    slot).

    Tokens that were not selected come back bit-identical to ``x``.
    """
    batch, seq_len, hidden = x.shape
    padded = torch.cat([x, x.new_zeros(batch, 1, hidden)], dim=1)
    idx = index.unsqueeze(-1).expand(-1, -1, hidden)
    return padded.scatter(1, idx, values)[:, :seq_len]
