"""Which tokens run a routed layer: the keep-count rule, per-row top-k, score
thresholds (fitted on calibration data or on the batch itself) and the choice each
routing mode makes (:mod:`~adadsf_modifier.routing.modes`).

Every function works on the whole batch at once and returns positions in the
convention the gather/scatter helpers of :mod:`~adadsf_modifier.routing.selection`
take: ``index [batch, k_max]`` ascending, unused slots holding ``seq_len``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "batch_threshold",
    "choose_tokens",
    "cut_for_ratio",
    "keep_counts",
    "positions_of",
    "select_by_mask",
    "select_topk",
    "threshold_beside_forced",
    "threshold_for_ratio",
    "tokens_to_keep",
    "tokens_to_keep_per_row",
]


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


def positions_of(
    selected: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """``(index, valid, k_max)`` of the ``selected [batch, seq]`` tokens, laid out as
    :func:`select_by_mask` does (``index`` None, ``k_max`` 0 when none is selected),
    with one host sync. One row (a prompt) takes ``nonzero``: its width is the row's
    own count, so no slot is unused and no padded sort is needed."""
    if selected.shape[0] == 1:
        index = selected[0].nonzero().view(1, -1)
        if index.shape[1] == 0:
            return None, None, 0
        return index, torch.ones_like(index, dtype=torch.bool), index.shape[1]
    k_max = int(selected.sum(dim=1).max()) if selected.shape[0] else 0
    if k_max == 0:
        return None, None, 0
    index, valid = select_by_mask(selected, k_max)
    return index, valid, k_max


def batch_threshold(
    scores: torch.Tensor,
    real: torch.Tensor,
    first: torch.Tensor | None,
    ratio: float,
) -> float:
    """The causal rule's threshold fitted on this batch: ``ratio`` of its real tokens
    score above it, the forced first tokens (``first``) counted as running, as
    :func:`~adadsf_modifier.routing.calibrate_thresholds` fits it on calibration
    data."""
    free = real if first is None else real & ~first
    total = int(real.sum())
    threshold, _ = threshold_beside_forced(
        scores.detach()[free], total, total - int(free.sum()), ratio
    )
    return threshold


def choose_tokens(
    mode: str,
    scores: torch.Tensor,
    real: torch.Tensor,
    first: torch.Tensor | None,
    ratio: float,
    threshold: float | None = None,
    owner: Callable[[], str] = lambda: "this layer",
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """``(index, valid, k_max)`` of the tokens that run a layer keeping ``ratio`` of
    its real tokens, under routing ``mode`` (:mod:`~adadsf_modifier.routing.modes`):
    ``topk`` (each row's ``K`` best scores), ``causal`` (scores above the calibrated
    ``threshold``) or ``quantile`` (scores above the threshold fitted on this batch).
    ``first`` (``[batch, seq]`` bool or None): tokens that run whatever their score
    (in top-k they count toward ``K``). ``index`` is None when nothing runs.
    ``owner`` names the layer in an error, called only then: a layer's index read on
    every call would make ``torch.compile`` specialise on it and compile the routing
    once per layer, past its recompile limit (eager after the eighth layer)."""
    if ratio <= 0.0:
        return None, None, 0
    if mode == "topk":
        if first is not None:
            scores = scores.masked_fill(first, float("inf"))
        keep = tokens_to_keep_per_row(real, ratio)
        k_max = int(keep.max())
        if k_max == 0:
            return None, None, 0
        index, valid = select_topk(scores, real, keep, k_max)
        return index, valid, k_max
    if mode == "quantile":
        threshold = batch_threshold(scores, real, first, ratio)
    elif mode != "causal":
        raise ValueError(f"unknown routing mode {mode!r}")
    elif threshold is None:
        raise RuntimeError(
            f"{owner()} has no causal threshold; calibrate thresholds first "
            "(adadsf_modifier.routing.calibrate_thresholds)"
        )
    selected = real & (scores > threshold)
    if first is not None:
        selected = selected | first
    return positions_of(selected)
