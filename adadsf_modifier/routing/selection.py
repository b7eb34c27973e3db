"""Which tokens run a routed layer, and the compacted batch they run in.

The choice: the keep-count rule, per-row top-k, score thresholds (fitted on calibration
data or on the batch itself) and the choice each routing mode makes
(:mod:`~adadsf_modifier.routing.modes`), returned as a :class:`Selection`; for a
decoding step (one new token per row, causal mode) the rows that run, a
:class:`DecodeChoice`. Positions follow one convention throughout: ``index [batch,
k_max]`` ascending, unused slots holding ``seq_len`` (one past the end, so they sort
last and scatter into a discarded slot).

The compacted batch: a routed layer gathers the selected tokens of every row into a
dense ``[batch, K_max, hidden]`` tensor (:func:`gather_tokens`), runs the original
layer on it and scatters the results back (:func:`scatter_tokens`). Everything works on
the whole batch at once (no Python loop over rows); the attention masks of the
compacted batch are :mod:`~adadsf_modifier.routing.kept_attention`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from adadsf_modifier.utils import first_real_tokens, real_token_mask

__all__ = [
    "DecodeChoice",
    "Selection",
    "batch_threshold",
    "RANK_CHUNK_ELEMENTS",
    "choose_by_rank",
    "choose_decode_rows",
    "choose_tokens",
    "decode_choice_of",
    "cut_for_ratio",
    "flat_positions",
    "gather_position_embeddings",
    "gather_tokens",
    "keep_counts",
    "positions_of",
    "rank_ahead",
    "RANK_SLACK",
    "RankState",
    "rank_band",
    "clamped_counts",
    "RANK_TIE_STEP",
    "rank_quota",
    "rank_tie_ranks",
    "rank_tie_tolerance",
    "scatter_tokens",
    "select_by_mask",
    "select_topk",
    "threshold_beside_forced",
    "threshold_for_ratio",
    "tokens_to_keep",
    "tokens_to_keep_per_row",
]


class Selection(NamedTuple):
    """The tokens that run a layer: ``index [batch, k_max]`` (positions ascending,
    unused slots holding ``seq_len``) and ``valid [batch, k_max]`` (the used slots);
    both ``None``, and ``k_max`` 0, when no token runs."""

    index: torch.Tensor | None
    valid: torch.Tensor | None
    k_max: int


class DecodeChoice(NamedTuple):
    """The rows of a decoding step (one new token per row) that run a layer.

    ``selected [batch]`` bool (``None`` at batch size 1); ``n``: how many rows run;
    ``rows`` / ``skip_rows`` (ascending): the rows that run and those that skip, both
    ``None`` unless some rows run and some skip; ``real [batch]``: the rows whose new
    token is not padding (``None``: all).
    """

    selected: torch.Tensor | None
    rows: torch.Tensor | None
    skip_rows: torch.Tensor | None
    n: int
    real: torch.Tensor | None


def choose_tokens(
    mode: str,
    scores: torch.Tensor,
    real: torch.Tensor,
    first: torch.Tensor | None,
    ratio: float,
    threshold: float | None = None,
    owner: Callable[[], str] = lambda: "this layer",
) -> Selection:
    """The :class:`Selection` ``(index, valid, k_max)`` of the tokens that run a layer
    keeping ``ratio`` of its real tokens, under routing ``mode``
    (:mod:`~adadsf_modifier.routing.modes`): ``topk`` (each row's ``K`` best scores),
    ``causal`` (scores above the calibrated ``threshold``), ``quantile`` (scores
    above the threshold fitted on this batch) or ``rank`` (each token in the top
    ``ratio`` of its row so far, :func:`choose_by_rank`; here with no cached past).
    ``first`` (``[batch, seq]`` bool or None): tokens that run whatever their score
    (in top-k they count toward ``K``).
    ``index`` is None when nothing runs. ``owner`` names the layer in an error, called
    only then: a layer's index read on every call would make ``torch.compile``
    specialise on it and compile the routing once per layer, past its recompile limit
    (eager after the eighth layer)."""
    if ratio <= 0.0:
        return Selection(None, None, 0)
    if mode == "topk":
        if first is not None:
            scores = scores.masked_fill(first, float("inf"))
        keep = tokens_to_keep_per_row(real, ratio)
        k_max = int(keep.max())
        if k_max == 0:
            return Selection(None, None, 0)
        index, valid = select_topk(scores, real, keep, k_max)
        return Selection(index, valid, k_max)
    if mode == "rank":  # ``first`` is set iff the first real token is kept
        return positions_of(choose_by_rank(scores, real, ratio, first is not None)[0])
    if mode == "quantile":
        threshold = batch_threshold(scores, real, first, ratio)
    elif mode != "causal":
        raise ValueError(f"unknown routing mode {mode!r}")
    elif threshold is None:
        raise RuntimeError(
            f"{owner()} has no causal threshold; calibrate thresholds first "
            "(adadsf_modifier.fitting.calibrate_thresholds)"
        )
    selected = real & (scores > threshold)
    if first is not None:
        selected = selected | first
    return positions_of(selected)


def choose_decode_rows(
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    first: bool,
    threshold: float,
    keep_first_token: bool,
) -> DecodeChoice:
    """The :class:`DecodeChoice` ``(selected, rows, skip_rows, n, real)`` of a
    decoding step: the rows whose token ``x [batch, 1, hidden]`` scores above the
    causal ``threshold`` run (``n`` of them, with one host sync). ``first``: the step
    opens the layer's cache, so every real row runs; ``keep_first_token``: a row whose
    past was all padding runs its first real token."""
    batch = x.shape[0]
    real = late = None
    if attention_mask is not None:
        real_q = real_token_mask(attention_mask, batch, 1, x.device)
        real = real_q[:, 0]
        if not first and keep_first_token:
            # a row whose past was all padding gets its first real token now
            late = first_real_tokens(attention_mask, real_q)[:, 0]
    if batch == 1 and late is None:  # one sync, no index ops
        run = (first or float(scores) > threshold) and (real is None or bool(real))
        return DecodeChoice(None, None, None, int(run), real)
    selected = scores[:, 0] > threshold
    if first:
        selected = torch.ones_like(selected)
    elif late is not None:
        selected = selected | late
    if real is not None:
        selected = selected & real
    return decode_choice_of(selected, real)


def decode_choice_of(selected: torch.Tensor, real: torch.Tensor | None) -> DecodeChoice:
    """The :class:`DecodeChoice` of a decoding step whose rows that run are decided
    (``selected [batch]`` bool, padding rows False; ``real [batch]`` or None), with one
    host sync: the rows to gather and to skip. Shared by the causal threshold
    (:func:`choose_decode_rows`) and rank routing."""
    batch = selected.shape[0]
    if batch == 1:
        return DecodeChoice(None, None, None, int(selected[0]), real)
    n = int(selected.sum())  # the one host sync of this layer
    if n in (0, batch):
        return DecodeChoice(selected, None, None, n, real)
    order = torch.argsort((~selected).to(torch.int8), stable=True)
    return DecodeChoice(selected, order[:n], order[n:], n, real)


# -- rank routing ----------------------------------------------------------------------

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


def positions_of(selected: torch.Tensor) -> Selection:
    """The :class:`Selection` ``(index, valid, k_max)`` of the ``selected [batch,
    seq]`` tokens, laid out as :func:`select_by_mask` does (``index`` None, ``k_max`` 0
    when none is selected), with one host sync. One row (a prompt) takes ``nonzero``:
    its width is the row's own count, so no slot is unused and no padded sort is
    needed."""
    if selected.shape[0] == 1:
        index = selected[0].nonzero().view(1, -1)
        if index.shape[1] == 0:
            return Selection(None, None, 0)
        return Selection(
            index, torch.ones_like(index, dtype=torch.bool), index.shape[1]
        )
    k_max = int(selected.sum(dim=1).max()) if selected.shape[0] else 0
    if k_max == 0:
        return Selection(None, None, 0)
    index, valid = select_by_mask(selected, k_max)
    return Selection(index, valid, k_max)


def batch_threshold(
    scores: torch.Tensor,
    real: torch.Tensor,
    first: torch.Tensor | None,
    ratio: float,
) -> float:
    """The causal rule's threshold fitted on this batch: ``ratio`` of its real tokens
    score above it, the forced first tokens (``first``) counted as running, as
    :func:`~adadsf_modifier.fitting.calibrate_thresholds` fits it on calibration
    data."""
    free = real if first is None else real & ~first
    total = int(real.sum())
    threshold, _ = threshold_beside_forced(
        scores.detach()[free], total, total - int(free.sum()), ratio
    )
    return threshold


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

    One ``index_select`` over the flattened ``[batch * seq]`` rows: a row copy, where
    ``gather`` with an index expanded over the hidden size costs an index read per
    element.
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
