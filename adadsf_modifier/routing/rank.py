"""Rank routing: the ``p``-th real token of a row runs a layer iff it is in the top
``ratio`` of its row so far, the row's count of tokens that ran held in a band around
``ratio * p``. No threshold, so the kept share holds on text unlike the calibration
set's. The decisions compare scores only, so a prefill, a chunked prefill and decoding
steps decide alike; the row's past scores and counts live with the layer's KV cache
(:class:`RankScoresMixin`), on the routed cache layer or, for a layer keeping skipped
tokens' K/V, on the model's dense cache layer (its class swapped,
:func:`scored_cache_layer`).
"""

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

#: Most elements of per-query work (searches and comparisons, a tie band's two edges)
#: :func:`rank_ahead` builds at once; longer prefills count a chunk of queries at a
#: time.
RANK_CHUNK_ELEMENTS = 1 << 24

#: Positions per block when a prefill counts each token's earlier rivals
#: (:func:`_count_earlier`): the keys of whole earlier blocks are counted by binary
#: search, those of the token's own block one by one.
RANK_BLOCK = 64


def rank_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative width within which two router scores are tied under rank routing.

    The same hidden state scored alone (a decoding step) and inside a row (a prefill)
    differs in its last bits: the router's matmul takes another kernel for one token
    (measured up to 2.2e-7 on float32 scores of spread 0.2). Equal hidden states are
    common (a repeated token that skipped the layers below), so a strict comparison
    would rank such a pair one way in the full forward (equal) and either way when
    decoding. Within the tolerance a pair is tied, and a new token's ties are split by
    how many it has (:func:`choose_by_rank`), which keeps that decision the same on
    both paths. 16-bit models feed the router's first matmul in their own precision,
    whose one-ulp rounding flips are ~2^-8.
    """
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
    """``host(*args)``, one of rank routing's integer tables computed on the host, as
    an int64 tensor on ``device``, made once per table and device: every path and
    device reads the same integers."""
    key = (host.__name__, args, str(device))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        table = torch.tensor(host(*args), dtype=torch.long, device=device)
        _DEVICE_TABLES[key] = table
    return table


def _table_size(length: int) -> int:
    """The last position rank routing's tables cover for rows of ``length``: a power of
    two (at least 64), so a growing row rebuilds them a logarithmic number of times."""
    size = 64
    while size < length:
        size *= 2
    return size


def rank_quota(
    ratio: float, keep_first: bool, length: int, device: torch.device
) -> torch.Tensor:
    """``[L + 1]`` int64, ``L >= length``: ``quota[p]``, how many of its rivals may be
    ahead of a row's ``p``-th real token for it to run (it runs iff fewer are). Its
    rivals are the ``p`` real tokens so far, less the first one when ``keep_first``:
    that token runs anyway (quota 1 at ``p = 1``) and, being the attention sink, scores
    unlike any other (measured on SmolLM2: below every later token at most layers,
    above all at two), so as a rival it would shift every later decision by one.

    If scores arrive in random order, the token's rank among its ``n_p`` rivals is
    uniform, so it runs with probability ``quota[p] / n_p`` and the expected count kept
    among the first ``p`` tokens is ``E_p = sum quota[q] / n_q``. Each ``quota[p]`` is
    the integer in ``[0, n_p]`` that brings ``E_p`` nearest to ``ratio * p`` (the lower
    of two as near): the kept fraction tracks the ratio from the first tokens on
    (within ``1 / (2 n_p)`` tokens once reachable), where a plain ``ceil(ratio * p)``
    keeps ~``ln(N) / (2 N)`` too many over ``N`` tokens, and the forced first token is
    paid back by the tokens right after it (at ``ratio`` 0.5 the second never runs). A
    fixed table of ``(ratio, p)``, so prefill and decoding read the same quota.
    """
    args = (float(ratio), bool(keep_first), _table_size(length))
    return _on_device(_quota_table, args, device)


#: How far a row's count of tokens that ran a layer may stray from ``ratio * p`` under
#: rank routing (:func:`rank_band`), in tokens: room for the rank to choose which
#: tokens run, small enough that a short decoding continuation cannot spend much more
#: or less than its share.
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
    """``[L + 1, 2]`` int64, ``L >= length``: the fewest and the most of a row's first
    ``p`` real tokens that may have run a layer under rank routing, ``ratio * p``
    less and plus :data:`RANK_SLACK` (rounded inwards, within ``0 .. p``; the forced
    first token always runs). Consecutive bounds move by at most one, so a token can
    always keep its row inside. Integers from the host, as :func:`rank_quota`'s, so
    every path reads the same table."""
    args = (float(ratio), bool(keep_first), _table_size(length), RANK_SLACK)
    return _on_device(_band_table, args, device)


def clamped_counts(
    steps: torch.Tensor, low: torch.Tensor, high: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """``[batch, Q]``: ``c_q = clamp(c_{q-1} + steps_q, low_q, high_q)`` from ``c_0 =
    start [batch]``, every ``q`` at once. Each position's map ``c -> min(high,
    max(low, c + step))`` is one of a family closed under composition (``g . f`` is
    ``(clamp(low_f + step_g, low_g, high_g), clamp(high_f + step_g, low_g, high_g),
    step_f + step_g)``), so an inclusive scan of the maps (``log2 Q`` rounds of a few
    element-wise ops) gives every prefix's map, applied to ``start`` at the end: the
    counts one token at a time would give, without a loop over the tokens."""
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


#: ``2^32`` over the golden ratio (Knuth's multiplicative hash): ``u_k = RANK_TIE_STEP
#: * k mod 2^32``, over ``2^32``, is the Weyl sequence ``frac(0.618... * k)``, which
#: spreads evenly over ``[0, 1)`` from its first terms on (:func:`rank_tie_ranks`).
RANK_TIE_STEP = 0x9E3779B9

_TIE_BANDS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def rank_tie_ranks(length: int, device: torch.device) -> torch.Tensor:
    """``[L + 1]`` int64, ``L >= length``: ``ranks[k] = floor(u_k * (k + 1))``, with
    ``u_k = frac(RANK_TIE_STEP * k / 2^32)`` (:data:`RANK_TIE_STEP`): how many of its
    ``k`` tied earlier rivals a new token counts as ahead of it
    (:func:`choose_by_rank`), a rank among the ``k + 1`` twins spread evenly as ``k``
    grows (``ranks[0]`` is 0: no tie, no change). In integers on the host, so every
    path and device reads the same table."""
    return _on_device(_tie_rank_table, (_table_size(length),), device)


@lru_cache(maxsize=32)
def _tie_rank_table(length: int) -> tuple[int, ...]:
    """``ranks[k]`` for ``k = 0 .. length`` (see :func:`rank_tie_ranks`)."""
    return tuple(
        ((k * RANK_TIE_STEP) & 0xFFFFFFFF) * (k + 1) >> 32 for k in range(length + 1)
    )


def _tie_band(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[-tol, +tol]`` (:func:`rank_tie_tolerance`) in ``dtype`` on ``device``, made
    once: scaled by ``max(1, |score|)`` and added to a score, a tie band's two edges."""
    key = (dtype, str(device))
    band = _TIE_BANDS.get(key)
    if band is None:
        tol = rank_tie_tolerance(dtype)
        band = _TIE_BANDS[key] = torch.tensor([-tol, tol], dtype=dtype, device=device)
    return band


def rank_ahead(
    new: torch.Tensor, past: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [batch, Q, 2], keys [batch, S + Q])``: for each new token ``t``, how
    many earlier real tokens of its row score at least the floor of its tie band
    (``score_t - tol * max(1, |score_t|)``, :func:`rank_tie_tolerance`) and how many
    at least its ceiling (``score_t + tol * max(1, |score_t|)``); and the row's scores
    so far. The second count is the tokens ahead of ``t``, the difference the ones tied
    with it (:func:`choose_by_rank` splits those).

    ``new [batch, Q]``: the new tokens' router scores as the row keeps them (padding
    NaN, a token that is no rival ``-inf``); ``past [batch, S]``: the same of the row's
    earlier positions at this layer. NaN compares false and ``-inf`` is never at least
    a finite edge, so neither is ever counted, and a padding query counts none.
    Comparisons only, so a prefill and a decoding step given the same scores count the
    same; both edges in one comparison (a decoding step's ops are those of one edge); a
    long prefill compares :data:`RANK_CHUNK_ELEMENTS` at a time.
    """
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
    """``[batch, Q, 2]``: for the queries at positions ``start .. start + Q - 1`` of
    rows ``keys [batch, W]``, how many strictly earlier keys are at least each of their
    ``edges [batch, Q, 2]``, in about ``W^2 / RANK_BLOCK`` binary searches of
    ``log2 RANK_BLOCK`` steps plus ``W * RANK_BLOCK`` comparisons, rather than ``W^2``
    comparisons: the keys are cut into blocks of :data:`RANK_BLOCK` positions and each
    block sorted once; a query counts the blocks wholly before its own by a binary
    search in each, and its own block's earlier keys one by one. The same integers as
    comparing every pair (NaN keys are never counted, as no comparison with them holds;
    a query whose edge is NaN or ``-inf``, padding or the forced first token, has no
    earlier real key and counts none). A long prefill takes :data:`RANK_CHUNK_ELEMENTS`
    elements of queries at a time."""
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
    """What rank routing keeps of a row's past at one layer, with its KV cache.

    ``scores [batch, positions]``: the router scores of the row's positions so far
    (padding NaN, the forced first token ``-inf``: neither is any token's rival, and a
    crop can still count the real ones); ``count [batch]``: the real tokens among them;
    ``kept [batch]``: how many of those ran the layer (``None`` after a crop, until
    :func:`_replay_rank_kept` recounts it).
    """

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
    """Rank routing: ``(selected [batch, Q], state)``. The ``p``-th real token of a
    row is a candidate iff ``ahead + ranks[tied] < quota[p]`` (:func:`rank_quota`,
    about ``ratio * p``): ``ahead`` and ``tied`` count the earlier real tokens of the
    row (the forced first one aside) that score above the new token's tie band and
    within it (:func:`rank_ahead`), and ``ranks[k]`` (:func:`rank_tie_ranks`) is how
    many of ``k`` tied rivals it counts as ahead, ``floor(u_k (k + 1))`` for a fraction
    ``u_k`` of ``[0, 1)``. Untied (``tied = 0``) that is ``ahead < quota[p]``: the
    token is in the top ``ratio`` of its row so far. A candidate runs, and any other
    token skips, unless that would take the count of the row's tokens that ran out of
    its band (:func:`rank_band`: ``ratio * p`` within :data:`RANK_SLACK` tokens, for
    every prefix ``p``): at the band's top a candidate skips, at its bottom a token
    runs. No threshold, so a shift of every score (text unlike the calibration set)
    leaves the kept share where it was.

    Why the band: the rank alone holds the share only if scores arrive in random order
    along the row. They do not: later tokens score higher at most layers (more
    context), so a new token outranks most early ones, and a decoding continuation
    keeps more than the ratio. A ceiling alone holds that, but cuts off only the
    count's upward wanderings, so rows then keep less than the ratio. Inside the band
    the
    rank alone decides. A prefill takes the counts from :func:`clamped_counts`, a
    decoding step from the row's kept count; both give the decisions of one token at
    a time.

    Why ties are split so: identical hidden states score identically (a repeated token,
    a degenerate stream), and ties that went to the earlier token put every new twin
    behind all its earlier ones, so a run of identical tokens kept almost none after the
    first few and the budget did not hold. Counting a tie as half a rival (mid-rank)
    keeps all or none of a long run (all of it at 0.81, none at 0.2). With ``u_k``
    spread evenly (a Weyl sequence) the new token's rank among itself and its ``k``
    earlier twins is spread evenly over ``0 .. k``, as a random tie-break would make it,
    so among tied scores the kept share tends to the ratio (within 0.005 over 400
    identical scores at every ratio from 0.1 to 0.95). ``u`` is indexed by ``k``, the
    token's place among its twins, not by its position: a fraction of the position, the
    same at every layer, would replay one layer's split at the next (the twins that
    skipped a layer all drew high fractions and lose most ties at the next one; a tiny
    model's repeated-token stream kept 0.63 at ratio 0.8 there), and a fixed order of
    positions would need a key per past token in the cache. ``k`` is a count the
    comparison gives anyway, so a decoding step adds a subtraction, a lookup and an
    addition, padding moves no decision, and prefill, chunked prefill and decoding
    decide alike.

    ``past``: the row's :class:`RankState` before these tokens (``None``: none);
    ``state``: the same after them, for the cache to keep.
    """
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
    """A decoding step of one row on the CPU, float32 scores: :func:`choose_by_rank`
    decides it with host integers (:func:`_rank_step_on_host`)."""
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
    """:func:`choose_by_rank` for one row's decoding step on the CPU, the same decision
    from the same tables with the integers on the host: every op of the tensor path
    is a dispatch of a few microseconds on one element, ~30 of them a routed layer a
    step, where this takes two comparisons over the row's past and a few tensors for
    the cache. The tie band's edges are float32 arithmetic as the tensor path's
    (numpy float32 rounds alike), compared with the same float32 scores."""
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
    """``state`` with ``kept`` recounted from its scores (after a crop): the stored
    scores decide again exactly as they did token by token (:func:`choose_by_rank`
    compares scores only), the forced first token (``-inf``) running again."""
    _, replayed = choose_by_rank(state.scores, ~state.scores.isnan(), ratio, keep_first)
    return RankState(state.scores, state.count, replayed.kept)


class RankScoresMixin:
    """Rank routing's :class:`~adadsf_modifier.routing.selection.RankState` of every
    position a cache layer has seen: the router scores, how many were real, how many
    ran. ``None`` until rank routing first runs on the cache.
    """

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
        """Forget the last positions; how many of those left ran is recounted by the
        next rank decision (:func:`~adadsf_modifier.routing.selection.choose_by_rank`),
        which knows the layer's ratio."""
        if self.rank_state is not None and tokens_to_remove:
            scores = self.rank_state.scores[:, : -abs(tokens_to_remove)]
            # nothing left: as if rank routing never ran
            self.rank_state = (
                RankState(scores, (~scores.isnan()).sum(1), None)
                if scores.shape[1]
                else None
            )


def _scored_class(base: type) -> type:
    """``RankScored<Base>``: ``base`` (a dense cache layer class) also keeping rank
    routing's scores through ``generate()``'s batch operations. Built with ``base`` as
    its only base (the mixin's methods copied in): CPython swaps an object's class in
    place only between classes of the same base chain."""

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


def scored_cache_layer(cache: Any, layer_idx: int) -> RankScoresMixin:
    """The model's own (dense) cache layer ``layer_idx`` of ``cache``, able to keep
    rank routing's scores: its class is swapped once for a subclass that carries them,
    so its keys, values and everything transformers reads stay as they are."""
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            "AdaDSF rank routing supports transformers' DynamicCache, got "
            f"{type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    current = layers[layer_idx]
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
    """``[batch, Q]`` bool: the new tokens that run under rank routing
    (:func:`~adadsf_modifier.routing.selection.choose_by_rank`), against the scores
    ``store`` (a cache layer; ``None``: no cache) holds for the ``past_len`` positions
    before them, which it then holds for these too."""
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
