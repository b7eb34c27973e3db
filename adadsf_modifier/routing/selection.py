"""Which tokens run a routed layer, and the compacted batch they run in.

Positions follow one convention throughout: ``index [batch, k_max]`` ascending, unused
slots holding ``seq_len`` (one past the end, so they sort last and scatter into a
discarded slot). The selected tokens of every row are gathered into a dense ``[batch,
k_max, hidden]`` tensor (:func:`gather_tokens`) and scattered back
(:func:`scatter_tokens`), the whole batch at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from adadsf_modifier.utils import first_real_tokens, real_token_mask

__all__ = [
    "DecodeChoice",
    "Selection",
    "batch_threshold",
    "choose_decode_rows",
    "choose_tokens",
    "cut_for_ratio",
    "flat_positions",
    "gather_position_embeddings",
    "gather_tokens",
    "keep_counts",
    "scatter_tokens",
    "select_by_mask",
    "select_topk",
    "skipped_slots",
    "threshold_beside_forced",
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
    """The rows of a decoding step that run a layer: ``selected [batch]`` (``None``
    at batch 1), ``rows`` / ``skip_rows`` (both ``None`` unless some rows run and
    some skip), ``n`` rows running, ``real [batch]`` the rows whose token is not
    padding (``None``: all)."""

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
    """The :class:`Selection` of the tokens that run a layer keeping ``ratio`` of its
    real tokens under ``mode``: ``topk`` (each row's ``K`` best), ``causal`` (scores
    above ``threshold``) or ``quantile`` (above a threshold fitted on this batch).
    ``first``: tokens that run whatever their score
    (in top-k they count toward ``K``). ``owner()`` names the layer in an error."""
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
    """The :class:`DecodeChoice` of a causal decoding step: the rows whose token
    scores above ``threshold`` run. ``first``: the step opens the layer's cache, so
    every real row runs; ``keep_first_token``: a row whose past was all padding runs
    its first real token."""
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
    """The :class:`DecodeChoice` of the decided rows ``selected [batch]`` (padding
    rows False), with the step's one host sync."""
    batch = selected.shape[0]
    if batch == 1:
        return DecodeChoice(None, None, None, int(selected[0]), real)
    n = int(selected.sum())  # the one host sync of this layer
    if n in (0, batch):
        return DecodeChoice(selected, None, None, n, real)
    order = torch.argsort((~selected).to(torch.int8), stable=True)
    return DecodeChoice(selected, order[:n], order[n:], n, real)


#: Absorbs float error in ``ratio * n`` (0.29 * 100 = 28.999999999999996 must keep 29).
_KEEP_EPS = 1e-6


def keep_counts(real_lengths: torch.Tensor, ratio: float) -> torch.Tensor:
    """The keep-count rule ``K = max(1, floor(ratio * n))`` per real length ``n`` (0
    for no real token or ratio 0), in float64: top-k routing and the FLOPs model's
    planned counts both call it."""
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
    """Each row's top ``keep[b]`` real tokens by score as ``(index, valid)`` in
    position order. Equal scores are common (a repeated token that skipped the layers
    below scores the same), so a stable sort breaks ties toward the earlier token: a
    prompt then selects the same tokens alone and inside a padded batch, which
    ``topk``'s memory-order ties would not."""
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
    """Positions of each row's ``selected`` tokens, ascending, in ``k_max`` slots."""
    batch, seq_len = selected.shape
    pos = torch.arange(seq_len, device=selected.device).expand(batch, seq_len)
    key = torch.where(selected, pos, torch.full_like(pos, seq_len))
    index = key.sort(dim=1).values[:, :k_max]
    return index, index < seq_len


def positions_of(selected: torch.Tensor) -> Selection:
    """The :class:`Selection` of the ``selected [batch, seq]`` tokens, with one host
    sync. One row takes ``nonzero``: its width is its own count, so no slot is
    unused."""
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
    """The quantile rule: the threshold above which ``ratio`` of this batch's real
    tokens score, the forced first tokens counted as running (as thresholds are
    fitted on calibration data)."""
    free = real if first is None else real & ~first
    total = int(real.sum())
    threshold, _ = threshold_beside_forced(
        scores.detach()[free], total, total - int(free.sum()), ratio
    )
    return threshold


def cut_for_ratio(scores: torch.Tensor, ratio: float) -> tuple[float, int]:
    """``(threshold, scores kept by it)``: a threshold with ``mean(scores > t) ~=
    ratio``, midway between neighbouring distinct scores; with ties, at the gap whose
    kept count is nearest ``ratio * n``."""
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
    free to skip at which ``ratio`` of all ``total`` real tokens run, ``forced`` of
    them running anyway; the fraction is what it really keeps (ties and forced tokens
    can make ``ratio`` unreachable)."""
    if total == forced:  # every token is forced: nothing left to choose
        return (float("inf") if ratio < 1.0 else float("-inf")), 1.0
    free_ratio = (ratio * total - forced) / (total - forced)
    threshold, kept = cut_for_ratio(free_scores, min(max(free_ratio, 0.0), 1.0))
    return threshold, (kept + forced) / total


def flat_positions(index: torch.Tensor, row_len: int) -> torch.Tensor:
    """``[batch * K]`` row positions of ``index [batch, K]`` in the ``[batch *
    row_len]`` flattening of a ``[batch, row_len, ...]`` tensor."""
    if index.shape[0] == 1:  # no offsets: a view (a prefill or decode of one prompt)
        return index.reshape(-1)
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    return (index + offsets * row_len).reshape(-1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, k]]`` along dim 1 (unused slots read the last token; ``x`` of
    batch 1 broadcasts), as one row-wise ``index_select``: cheaper on CPU than
    ``gather`` with an index expanded over the hidden size."""
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
    """Rotary ``(cos, sin)`` at the selected tokens' own positions."""
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
    """``x`` with ``values`` written at ``index``, then ``more = (index, values)`` if
    given; unselected tokens come back bit-identical. ``covers_all``: the writes
    reach every position, so ``x`` is not copied first."""
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


def skipped_slots(
    real: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(index, valid)`` of the real tokens not at the positions ``index`` (``None``:
    none selected), laid out as :func:`select_by_mask` does, or ``None`` when every
    real token runs. One host sync."""
    seq = real.shape[1]
    # unused slots of ``index`` (at ``seq``) clear the extra column
    free = torch.nn.functional.pad(real, (0, 1))
    if index is not None:
        free.scatter_(1, index, False)
    skip, valid, _ = positions_of(free[:, :seq])
    return (skip, valid) if skip is not None else None
