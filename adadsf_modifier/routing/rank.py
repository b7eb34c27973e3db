"""Rank routing: the ``p``-th real token of a row runs a layer iff it is in the top
``ratio`` of its row so far, the row's count of tokens that ran held in a band around
``ratio * p``. No threshold, so the kept share holds on text unlike the calibration
set's. Decisions compare scores only, and every table is made of host integers, so a
prefill, a chunked prefill and decoding steps decide alike. The row's past scores and
counts live with the layer's KV cache (:class:`RankScoresMixin`): on the routed cache
layer, or, for a layer keeping skipped tokens' K/V, on the model's dense cache layer
(its class swapped, :func:`scored_cache_layer`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

__all__ = [
    "RANK_CHUNK_ELEMENTS",
    "RANK_SLACK",
    "RANK_TIE_STEP",
    "RankScoresMixin",
    "RankState",
    "choose_by_rank",
    "clamped_counts",
    "rank_ahead",
    "rank_band",
    "rank_quota",
    "rank_select",
    "rank_tie_ranks",
    "rank_tie_tolerance",
    "scored_cache_layer",
]

#: Absorbs float error in ``ratio * p``.
_KEEP_EPS = 1e-6

#: Most elements of per-query work a prefill builds at once (:func:`_count_earlier`).
RANK_CHUNK_ELEMENTS = 1 << 24

#: Positions per sorted block in :func:`_count_earlier`.
RANK_BLOCK = 64


def rank_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative width within which two router scores tie. The same hidden state
    scored alone (decoding) and inside a row (prefill) differs in its last bits
    (another matmul kernel), and equal hidden states are common (a repeated token
    that skipped the layers below): a strict comparison would then decide the two
    paths differently. 16-bit models feed the router in their own precision, whose
    rounding flips are ~2^-8."""
    return 2.0**-14 if dtype in (torch.float32, torch.float64) else 2.0**-7


@lru_cache(maxsize=256)
def _quota_table(ratio: float, keep_first: bool, length: int) -> tuple[int, ...]:
    """``quota[p]`` for ``p = 0 .. length`` (see :func:`rank_quota`), in float64 on
    the host, so every device and path reads the same integers."""
    quota, expected = [0], 0.0
    for p in range(1, length + 1):
        if p == 1 and keep_first:
            quota.append(1)
            expected = 1.0
            continue
        rivals = p - 1 if keep_first else p  # the forced first token does not rank
        # nearest integer, a half rounded down: the budget is a ceiling
        c = min(max(math.ceil((ratio * p - expected) * rivals - 0.5), 0), rivals)
        expected += c / rivals
        quota.append(c)
    return tuple(quota)


_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}


def _on_device(host: Callable[..., tuple], args: tuple, device: torch.device):
    """``host(*args)``, an integer table computed on the host, as an int64 tensor on
    ``device``, made once per table and device."""
    key = (host.__name__, args, str(device))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        table = torch.tensor(host(*args), dtype=torch.long, device=device)
        _DEVICE_TABLES[key] = table
    return table


def _table_size(length: int) -> int:
    """The last position the tables cover for rows of ``length``: a power of two (at
    least 64), so a growing row rebuilds them a logarithmic number of times."""
    size = 64
    while size < length:
        size *= 2
    return size


def rank_quota(
    ratio: float, keep_first: bool, length: int, device: torch.device
) -> torch.Tensor:
    """``[L + 1]`` int64, ``L >= length``: ``quota[p]``, how many rivals may be ahead of
    a row's ``p``-th real token for it to run. Its rivals are the real tokens so far,
    less the forced first one (it runs anyway and, as the attention sink, scores unlike
    any other, so as a rival it would shift every later decision).

    With scores in random order a token runs with probability ``quota[p] / n_p``;
    each ``quota[p]`` is the integer that brings the expected kept count of the first
    ``p`` tokens nearest to ``ratio * p`` (the lower when two are as near), so the
    kept fraction tracks the ratio from the first tokens on, where ``ceil(ratio *
    p)`` keeps too many."""
    args = (float(ratio), bool(keep_first), _table_size(length))
    return _on_device(_quota_table, args, device)


#: How far a row's kept count may stray from ``ratio * p``, in tokens: room for the
#: rank to choose, small enough that a short continuation cannot overspend its share.
RANK_SLACK = 4


@lru_cache(maxsize=256)
def _band_table(
    ratio: float, keep_first: bool, length: int, slack: int
) -> tuple[tuple[int, int], ...]:
    """``(low[p], high[p])`` for ``p = 0 .. length`` (see :func:`rank_band`)."""
    band = []
    for p in range(length + 1):
        low = max(0, math.ceil(ratio * p - slack - _KEEP_EPS))
        high = min(p, math.floor(ratio * p + slack + _KEEP_EPS))
        if keep_first and p >= 1:
            low, high = max(low, 1), max(high, 1)
        band.append((low, high))
    return tuple(band)


def rank_band(
    ratio: float, keep_first: bool, length: int, device: torch.device
) -> torch.Tensor:
    """``[L + 1, 2]`` int64, ``L >= length``: the fewest and most of a row's first
    ``p`` real tokens that may have run, ``ratio * p`` less and plus
    :data:`RANK_SLACK` (rounded inwards, within ``0 .. p``). Consecutive bounds move
    by at most one, so a token can always keep its row inside."""
    args = (float(ratio), bool(keep_first), _table_size(length), RANK_SLACK)
    return _on_device(_band_table, args, device)


def clamped_counts(
    steps: torch.Tensor, low: torch.Tensor, high: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """``[batch, Q]``: ``c_q = clamp(c_{q-1} + steps_q, low_q, high_q)`` from ``c_0 =
    start``, every ``q`` at once. The maps ``c -> clamp(c + step, low, high)`` are
    closed under composition, so an inclusive scan of them (``log2 Q`` rounds) gives
    every prefix's map: the counts one token at a time would give, without a loop
    over the tokens."""
    bounds = torch.stack([low, high])  # [2, batch, Q]
    q_len, shift = steps.shape[1], 1
    while shift < q_len:
        later_low, later_high = low[:, shift:], high[:, shift:]
        composed = (bounds[:, :, :-shift] + steps[:, shift:]).clamp(
            later_low, later_high
        )
        bounds = torch.cat([bounds[:, :, :shift], composed], 2)
        steps = torch.cat([steps[:, :shift], steps[:, :-shift] + steps[:, shift:]], 1)
        low, high = bounds.unbind(0)
        shift *= 2
    return (start.unsqueeze(1) + steps).clamp(low, high)


#: ``2^32`` over the golden ratio: ``u_k = (RANK_TIE_STEP * k mod 2^32) / 2^32`` is
#: the Weyl sequence ``frac(0.618... k)``, even over ``[0, 1)`` from its first terms.
RANK_TIE_STEP = 0x9E3779B9

_TIE_BANDS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def rank_tie_ranks(length: int, device: torch.device) -> torch.Tensor:
    """``[L + 1]`` int64: ``ranks[k] = floor(u_k (k + 1))`` with ``u_k`` the Weyl
    sequence of :data:`RANK_TIE_STEP`: how many of its ``k`` tied earlier rivals a
    new token counts as ahead of it (:func:`choose_by_rank`)."""
    return _on_device(_tie_rank_table, (_table_size(length),), device)


@lru_cache(maxsize=32)
def _tie_rank_table(length: int) -> tuple[int, ...]:
    """``ranks[k]`` for ``k = 0 .. length`` (see :func:`rank_tie_ranks`)."""
    return tuple(
        ((k * RANK_TIE_STEP) & 0xFFFFFFFF) * (k + 1) >> 32 for k in range(length + 1)
    )


def _tie_band(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[-tol, +tol]`` in ``dtype`` on ``device``, made once: scaled by ``max(1,
    |score|)`` and added to a score, its tie band's two edges."""
    key = (dtype, str(device))
    band = _TIE_BANDS.get(key)
    if band is None:
        tol = rank_tie_tolerance(dtype)
        band = _TIE_BANDS[key] = torch.tensor([-tol, tol], dtype=dtype, device=device)
    return band


def rank_ahead(
    new: torch.Tensor, past: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [batch, Q, 2], keys [batch, S + Q])``: for each new token, how many
    earlier real tokens of its row score at least its tie band's floor and at least
    its ceiling (the tokens tied with it and ahead of it, and ahead of it), and the
    row's scores so far. ``new``: the new tokens' scores as the row keeps them
    (padding NaN, the forced first token ``-inf``, neither ever counted); ``past``:
    the earlier positions'."""
    batch, q_len = new.shape
    if past is not None:
        past = past.to(new.dtype)
    keys = new if past is None else torch.cat([past, new], dim=1)
    start = keys.shape[1] - q_len
    new = new.unsqueeze(-1)
    # [batch, Q, 2]: the floor and the ceiling; the floor is ``score - tol * ...`` bit
    # for bit (a power of two scales exactly), so untied tokens count as they did
    edges = new + new.abs().clamp(min=1.0) * _tie_band(new.dtype, new.device)
    if q_len == 1:  # a decoding step: the new token against the row's past
        earlier = keys[:, :0] if past is None else past
        return (earlier.unsqueeze(-1) >= edges).sum(1, keepdim=True), keys
    return _count_earlier(keys, edges, start), keys


def _count_earlier(keys: torch.Tensor, edges: torch.Tensor, start: int) -> torch.Tensor:
    """``[batch, Q, 2]``: for the queries at ``start .. start + Q - 1`` of ``keys``,
    how many strictly earlier keys are at least each of their ``edges``: the same
    integers as comparing every pair, in about ``W^2 / RANK_BLOCK`` binary searches
    instead of ``W^2`` comparisons. The keys are cut into sorted blocks; a query
    searches the blocks before its own and compares its own block's earlier keys one
    by one, a chunk of queries (:data:`RANK_CHUNK_ELEMENTS`) at a time."""
    batch, width = keys.shape
    q_len = edges.shape[1]
    size = RANK_BLOCK
    n_blocks = -(-width // size)
    device = keys.device
    blocks = keys.new_full((batch, n_blocks * size), -math.inf)  # NaN, padding: -inf
    blocks[:, :width] = keys.nan_to_num(
        nan=-math.inf, posinf=math.inf, neginf=-math.inf
    )
    blocks = blocks.view(batch, n_blocks, size)
    ordered = blocks.sort(-1).values
    inside = torch.arange(size, device=device)
    # int32 searches and a float copy of the edges per block: 4-byte elements
    step = max(1, RANK_CHUNK_ELEMENTS // max(1, 8 * batch * (n_blocks + size)))
    counts = []
    for q0 in range(0, q_len, step):
        q1 = min(q_len, q0 + step)
        e = edges[:, q0:q1]  # [batch, c, 2]
        pos = torch.arange(start + q0, start + q1, device=device)
        own = torch.div(pos, size, rounding_mode="floor")  # each query's block
        # the query's own block: its strictly earlier keys, one by one
        mine = blocks[:, own]  # [batch, c, size]
        earlier = (own[:, None] * size + inside[None, :]) < pos[:, None]
        above = (mine[..., None] >= e[:, :, None, :]) & earlier[None, :, :, None]
        found = above.sum(2)
        # the blocks wholly before the query's own (at most those before the last
        # query's, known on the host): keys >= edge, by binary search
        searched = (start + q1 - 1) // size
        if searched:
            wanted = e.reshape(batch, 1, -1).expand(batch, searched, e.shape[1] * 2)
            below = torch.searchsorted(
                ordered[:, :searched].contiguous(), wanted.contiguous(), out_int32=True
            ).view(batch, searched, -1, 2)
            before = torch.arange(searched, device=device)[:, None] < own[None, :]
            below.masked_fill_(~before[None, :, :, None], size)  # counts none
            found += (size - below).sum(1)
        counts.append(found)
    counts = torch.cat(counts, dim=1)
    return counts.masked_fill(edges.isnan() | (edges == -math.inf), 0)


class RankState(NamedTuple):
    """Rank routing's past of each row at one layer: ``scores [batch, positions]``
    (padding NaN, the forced first token ``-inf``), ``count [batch]`` real tokens
    among them, ``kept [batch]`` those that ran (``None`` after a crop, until
    recounted)."""

    scores: torch.Tensor
    count: torch.Tensor
    kept: torch.Tensor | None


def choose_by_rank(
    scores: torch.Tensor,
    real: torch.Tensor,
    ratio: float,
    keep_first: bool,
    past: RankState | None = None,
) -> tuple[torch.Tensor, RankState]:
    """Rank routing: ``(selected [batch, Q], state after these tokens)``. The ``p``-th
    real token of a row is a candidate iff ``ahead + ranks[tied] < quota[p]``
    (:func:`rank_ahead`, :func:`rank_tie_ranks`, :func:`rank_quota`); untied, iff it is
    in the top ``ratio`` of its row so far. A candidate runs and any other token skips
    unless that takes the row's kept count out of its band (:func:`rank_band`).

    Why the band: later tokens score higher at most layers (more context), so the rank
    alone lets a decoding continuation keep more than the ratio; a ceiling alone makes
    rows keep less. Inside the band the rank decides.

    Why ties split so: identical hidden states score identically, and ties that went
    to the earlier token kept almost none of a run of repeated tokens. A rank among
    ``k`` tied rivals spread evenly (a Weyl sequence indexed by ``k``, the token's
    place among its twins, not by its position, which would replay one layer's split
    at the next) keeps about the ratio of them, and ``k`` is a count the comparison
    gives anyway."""
    # Decisions take no gradient (the router learns through the kept tokens' gate), and
    # the state a cache keeps must hold no graph; detached, the comparisons also mix
    # freely with the cached constant tables, whatever mode made those.
    scores = scores.detach()
    if past is not None and past.kept is None:  # cropped since the last decision
        past = _replay_rank_kept(past, ratio, keep_first)
    if past is not None and _host_step(scores):
        return _rank_step_on_host(scores, real, ratio, keep_first, past)
    seen = real.long()
    if seen.shape[1] > 1:  # a decoding step's one column is its own sum
        seen = seen.cumsum(1)
    count = seen[:, -1]
    if past is not None:
        seen = seen + past.count.unsqueeze(1)
        count = count + past.count
    new = scores
    if keep_first:  # the forced first token is no rival (:func:`rank_quota`)
        new = new.masked_fill(seen == 1, float("-inf"))
    new = new.masked_fill(~real, float("nan"))  # padding after it included
    counts, keys = rank_ahead(new, None if past is None else past.scores)
    at_floor, ahead = counts.unbind(-1)
    ahead = ahead + rank_tie_ranks(keys.shape[1], scores.device)[at_floor - ahead]
    quota = rank_quota(ratio, keep_first, keys.shape[1], scores.device)[seen]
    candidate = real & (ahead < quota)
    low, high = rank_band(ratio, keep_first, keys.shape[1], scores.device)[seen].unbind(
        -1
    )
    kept_before = torch.zeros_like(count) if past is None else past.kept
    if candidate.shape[1] == 1:  # a decoding step: one clamp of the row's count
        before = kept_before.unsqueeze(1)
        kept = (before + candidate).clamp_(low, high)
        return kept > before, RankState(keys, count, kept[:, 0])
    kept = clamped_counts(candidate.long(), low, high, kept_before)
    selected = kept > torch.cat([kept_before.unsqueeze(1), kept[:, :-1]], 1)
    return selected, RankState(keys, count, kept[:, -1])


def _host_step(scores: torch.Tensor) -> bool:
    """A one-row decoding step on the CPU with float32 scores: decided with host
    integers (:func:`_rank_step_on_host`)."""
    return (
        scores.shape[0] == 1
        and scores.shape[1] == 1
        and scores.device.type == "cpu"
        and scores.dtype == torch.float32
    )


def _rank_step_on_host(
    scores: torch.Tensor,
    real: torch.Tensor,
    ratio: float,
    keep_first: bool,
    past: RankState,
) -> tuple[torch.Tensor, RankState]:
    """:func:`choose_by_rank` for one row's decoding step on the CPU, the same
    decision from the same tables with host integers: the tensor path is ~30
    dispatches on one element per layer and step, this two comparisons over the row's
    past. numpy's float32 rounds the tie band's edges as the tensor path does."""
    count, kept = int(past.count[0]), int(past.kept[0])
    if not bool(real[0, 0]):  # padding: stored NaN, never runs
        nan = torch.full_like(scores, float("nan"))
        keys = torch.cat([past.scores, nan], 1)
        return torch.zeros_like(real), RankState(keys, past.count, past.kept)
    seen = count + 1
    stored = scores
    value = np.float32(scores.item())
    if keep_first and seen == 1:  # the forced first token is no rival
        stored = torch.full_like(scores, float("-inf"))
        value = np.float32(-np.inf)
    tol = np.float32(rank_tie_tolerance(torch.float32))
    with np.errstate(invalid="ignore"):  # -inf + inf: NaN, as in the tensor path
        width = max(abs(value), np.float32(1.0))
        floor, ceiling = value + width * -tol, value + width * tol
        earlier = past.scores[0].numpy()
        at_floor = int(np.count_nonzero(earlier >= floor))
        ahead = int(np.count_nonzero(earlier >= ceiling))
    size = _table_size(past.scores.shape[1] + 1)
    ahead += _tie_rank_table(size)[at_floor - ahead]
    candidate = ahead < _quota_table(float(ratio), bool(keep_first), size)[seen]
    low, high = _band_table(float(ratio), bool(keep_first), size, RANK_SLACK)[seen]
    now = min(high, max(low, kept + int(candidate)))
    state = RankState(
        torch.cat([past.scores, stored], 1),
        torch.tensor([seen], device=scores.device),
        torch.tensor([now], device=scores.device),
    )
    return torch.tensor([[now > kept]], device=scores.device), state


def _replay_rank_kept(state: RankState, ratio: float, keep_first: bool) -> RankState:
    """``state`` with ``kept`` recounted from its scores after a crop: the stored
    scores decide again exactly as they did token by token."""
    _, replayed = choose_by_rank(state.scores, ~state.scores.isnan(), ratio, keep_first)
    return RankState(state.scores, state.count, replayed.kept)


class RankScoresMixin:
    """A cache layer's :class:`RankState` (``None`` until rank routing runs on it),
    kept through ``generate()``'s batch operations."""

    __slots__ = ()  # a dense layer's class is swapped in place: same layout
    rank_state: RankState | None = None

    def rank_length(self) -> int:
        return 0 if self.rank_state is None else int(self.rank_state.scores.shape[1])

    def rank_rows(self, fn) -> None:
        """Apply a batch-dim operation (reorder, repeat, select) to the state."""
        state = self.rank_state
        if state is not None:
            kept = None if state.kept is None else fn(state.kept)
            self.rank_state = RankState(fn(state.scores), fn(state.count), kept)

    def rank_crop(self, tokens_to_remove: int) -> None:
        """Forget the last positions; the next decision recounts how many of the rest
        ran."""
        if self.rank_state is not None and tokens_to_remove:
            scores = self.rank_state.scores[:, : -abs(tokens_to_remove)]
            # nothing left: as if rank routing never ran
            self.rank_state = (
                RankState(scores, (~scores.isnan()).sum(1), None)
                if scores.shape[1]
                else None
            )


def _scored_class(base: type) -> type:
    """``RankScored<Base>``: a dense cache layer class that also keeps rank routing's
    state. ``base`` is its only base (the mixin's methods copied in): CPython swaps
    an object's class in place only between classes of the same layout."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        base.reorder_cache(self, beam_idx)
        self.rank_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        base.batch_repeat_interleave(self, repeats)
        self.rank_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        base.batch_select_indices(self, indices)
        self.rank_rows(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        before = self.get_seq_length()
        base.crop(self, tokens_to_remove)
        self.rank_crop(before - self.get_seq_length())

    def reset(self) -> None:
        base.reset(self)
        self.rank_state = None

    namespace = {
        name: value
        for name, value in vars(RankScoresMixin).items()
        if name in ("rank_state", "rank_length", "rank_rows", "rank_crop")
    }
    namespace.update(
        __slots__=(),
        __module__=__name__,
        reorder_cache=reorder_cache,
        batch_repeat_interleave=batch_repeat_interleave,
        batch_select_indices=batch_select_indices,
        crop=crop,
        reset=reset,
    )
    return type(f"RankScored{base.__name__}", (base,), namespace)


_SCORED_CLASSES: dict[type, type] = {}


def cache_layer(cache: Any, layer_idx: int, who: str) -> Any:
    """Layer ``layer_idx`` of a transformers ``DynamicCache``, created (as the cache
    would) where the cache has not reached it yet; ``who`` names the caller in the
    refusal of any other cache."""
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            f"{who} supports transformers' DynamicCache, got {type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    return layers[layer_idx]


def scored_cache_layer(cache: Any, layer_idx: int) -> RankScoresMixin:
    """The model's own cache layer ``layer_idx``, its class swapped once for one that
    keeps rank routing's state; its keys, values and all transformers reads stay as
    they are."""
    current = cache_layer(cache, layer_idx, "AdaDSF rank routing")
    if hasattr(current, "rank_rows"):  # a RoutedCacheLayer, or swapped before
        return current
    base = type(current)
    if base not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise TypeError(
            "AdaDSF rank routing needs a DynamicLayer or DynamicSlidingWindowLayer at "
            f"cache layer {layer_idx}, found {base.__name__}"
        )
    cls = _SCORED_CLASSES.get(base)
    if cls is None:
        cls = _SCORED_CLASSES[base] = _scored_class(base)
    current.__class__ = cls
    return current


def rank_select(
    store: RankScoresMixin | None,
    past_len: int,
    scores: torch.Tensor,
    real: torch.Tensor,
    ratio: float,
    keep_first: bool,
) -> torch.Tensor:
    """``[batch, Q]`` bool: the new tokens that run under rank routing, against the
    past ``store`` (a cache layer; ``None``: no cache) holds for the ``past_len``
    positions before them; ``store`` then holds these too."""
    if store is None:
        return choose_by_rank(scores, real, ratio, keep_first)[0]
    if store.rank_length() != past_len:
        raise RuntimeError(
            f"AdaDSF rank routing needs the router scores of every earlier position "
            f"at this layer; the cache has {past_len} positions and scores for "
            f"{store.rank_length()} (it was filled in another routing mode): start a "
            "new cache after switching to rank routing"
        )
    selected, store.rank_state = choose_by_rank(
        scores, real, ratio, keep_first, store.rank_state
    )
    return selected
