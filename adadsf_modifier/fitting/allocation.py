"""Per-layer token retention ratios under a global budget: pure functions from the
per-layer similarities of the dense calibration to ratios, one per strategy.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, model_validator

from adadsf_modifier.constraints import InputError, UnitInterval, constrained

__all__ = [
    "Allocation",
    "BudgetFields",
    "ALLOCATIONS",
    "similarity_ratios",
    "rescale_to_budget",
    "clip_to_budget",
    "uniform_ratios",
    "reversed_ratios",
    "random_ratios",
    "layer_drop_ratios",
    "explicit_ratios",
    "allocate",
    "check_allocation",
    "lowest_ratio_at_most",
]

#: Names accepted by the modifier's ``allocation`` field (besides an explicit list of
# floats).
ALLOCATIONS = ("similarity", "uniform", "reversed", "random", "layer_drop")

#: The modifier's ``allocation`` field: a strategy name or one ratio per routed layer.
Allocation = Annotated[
    str | list[UnitInterval],
    constrained(
        lambda v: v in ALLOCATIONS if isinstance(v, str) else len(v) > 0,
        f"one of {list(ALLOCATIONS)} or a non-empty list of per-layer ratios in (0, 1]",
    ),
]


class BudgetFields(BaseModel):
    """The token budget both routing modifiers take (a pydantic mixin): ``retention``,
    the mean fraction of real tokens that run each routed layer, and ``min_retention``,
    the lowest ratio any routed layer may get (default ``min(0.1, retention)``)."""

    retention: UnitInterval = 0.8
    min_retention: UnitInterval | None = None

    @model_validator(mode="after")
    def _check_min_retention(self):
        if self.min_retention is not None and self.min_retention > self.retention:
            raise ValueError(
                f"min_retention must be in (0, retention={self.retention}], got "
                f"{self.min_retention}"
            )
        return self

    @property
    def resolved_min_retention(self) -> float:
        low = self.min_retention
        return low if low is not None else min(0.1, self.retention)


def _sigmoid(x: float) -> float:
    # numerically safe for large |x| (beta * (mean - w) can reach +-beta)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _check_budget(retention: float, min_retention: float) -> None:
    if not 0.0 < retention <= 1.0:
        raise ValueError(f"retention must be in (0, 1], got {retention}")
    if not 0.0 < min_retention <= retention:
        raise ValueError(
            f"min_retention must be in (0, retention={retention}], got {min_retention}"
        )


def similarity_ratios(
    similarities: Sequence[float], retention: float, temperature: float, beta: float
) -> list[float]:
    """The paper's formula, before any clipping (ratios may exceed 1).

    ``w = softmax((s - max s) / tau)``, ``z = beta * (mean w - w)``,
    ``r' = 0.05 + 0.9 * sigmoid(z)``, ``r = t * L / sum(r') * r'``. A layer that changes
    its input little (high similarity, large ``w``) gets a small ``z`` and therefore few
    tokens.
    """
    if len(similarities) == 0:
        raise ValueError("similarities is empty: no decoder layer was calibrated")
    if temperature <= 0:
        raise ValueError(f"temperature (tau) must be > 0, got {temperature}")
    if not beta >= 0:  # also refuses NaN
        raise ValueError(
            f"beta must be >= 0 (a negative beta gives more tokens to the layers that "
            f"change least, inverting the method; 0 gives uniform ratios), got {beta}"
        )
    s_max = max(similarities)
    logits = [(s - s_max) / temperature for s in similarities]
    exps = [math.exp(v) for v in logits]  # all <= 1 after subtracting the max
    total = sum(exps)
    w = [e / total for e in exps]
    w_mean = sum(w) / len(w)
    raw = [0.05 + 0.9 * _sigmoid(beta * (w_mean - wi)) for wi in w]
    return rescale_to_budget(raw, retention)


def rescale_to_budget(raw: Sequence[float], retention: float) -> list[float]:
    """Multiply ``raw`` by one factor so that its mean equals ``retention``."""
    scale = retention * len(raw) / sum(raw)
    return [scale * r for r in raw]


def clip_to_budget(
    ratios: Sequence[float], retention: float, min_retention: float, tol: float = 1e-12
) -> list[float]:
    """Clip ratios to ``[min_retention, 1]`` and redistribute so the mean stays
    ``retention``.

    Keeps the paper's multiplicative form: bisection finds the one factor ``c`` with
    ``mean(clip(c * r, min_retention, 1)) == retention`` (that mean is monotone in
    ``c``), so the layers' ranking is preserved and a clipped layer's excess flows to
    the others in proportion to their ratio.
    """
    _check_budget(retention, min_retention)
    if any(r <= 0 for r in ratios):
        raise ValueError("ratios to clip must be positive")

    def mean_at(c: float) -> float:
        return sum(min(1.0, max(min_retention, c * r)) for r in ratios) / len(ratios)

    lo, hi = 0.0, 1.0
    while mean_at(hi) < retention:
        hi *= 2.0
        if (
            hi > 1e12
        ):  # cannot happen for positive ratios; guard against an endless loop
            raise RuntimeError("could not reach the retention budget")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mean_at(mid) < retention:
            lo = mid
        else:
            hi = mid
        if hi - lo < tol:
            break
    out = [min(1.0, max(min_retention, hi * r)) for r in ratios]
    # Remove the last bisection residue from the unclipped layers so the mean is exact.
    free = [i for i, v in enumerate(out) if min_retention < v < 1.0]
    residue = retention * len(out) - sum(out)
    if free and abs(residue) > 0:
        share = residue / len(free)
        for i in free:
            out[i] = min(1.0, max(min_retention, out[i] + share))
    return out


def uniform_ratios(num_layers: int, retention: float) -> list[float]:
    """Mixture-of-Depths: every routed layer keeps the same fraction."""
    return [float(retention)] * num_layers


def reversed_ratios(
    ratios: Sequence[float], similarities: Sequence[float]
) -> list[float]:
    """Same multiset of ratios as ``ratios``, assigned in the opposite similarity order.

    The layer with the highest similarity gets the largest ratio. It answers "does the
    ranking matter?" with the budget and the spread of ratios held fixed.
    """
    order = sorted(
        range(len(similarities)), key=lambda i: similarities[i]
    )  # low -> high s
    ranked = sorted(ratios, reverse=True)  # similarity allocation: low s -> large ratio
    out = [0.0] * len(ratios)
    for rank, layer in enumerate(order):
        out[layer] = ranked[len(ranked) - 1 - rank]
    return out


def random_ratios(ratios: Sequence[float], seed: int) -> list[float]:
    """A seeded random permutation of ``ratios``: same budget and spread, random
    assignment."""
    out = list(ratios)
    _random.Random(seed).shuffle(out)
    return out


def _layers_kept(retention: float, num_layers: int) -> int:
    """How many whole layers ``layer_drop`` keeps: ``floor(retention * L)``."""
    keep = int(math.floor(retention * num_layers + 1e-9))
    if keep < 1:
        raise InputError(
            f"allocation: layer_drop at retention {retention} on {num_layers} routed "
            f"layer(s) would keep no layer (floor({retention} * {num_layers}) = 0); "
            f"the smallest retention it can meet is 1/{num_layers} = "
            f"{1 / num_layers:.4g}"
        )
    return keep


def layer_drop_ratios(similarities: Sequence[float], retention: float) -> list[float]:
    """ShortGPT: remove whole layers with the lowest Block Influence ``1 - s_i``.

    Keeps at most ``retention * L`` layers (ratio 1) and removes the rest (ratio 0), so
    the budget is met (the mean can be below ``retention`` when ``retention * L`` is not
    an integer).
    """
    n = len(similarities)
    keep = _layers_kept(retention, n)
    influence_order = sorted(
        range(n), key=lambda i: 1.0 - similarities[i]
    )  # lowest BI first
    dropped = set(influence_order[: n - keep])
    return [0.0 if i in dropped else 1.0 for i in range(n)]


def explicit_ratios(values: Sequence[float], num_layers: int) -> list[float]:
    """A user-given ratio per routed layer, validated but used as given."""
    if len(values) != num_layers:
        raise InputError(
            f"allocation: an explicit list needs one ratio per routed decoder layer "
            f"({num_layers}), got {len(values)}"
        )
    for i, v in enumerate(values):
        if not 0.0 < float(v) <= 1.0:
            raise InputError(
                f"allocation: ratio {v} for routed layer {i} is outside (0, 1]"
            )
    return [float(v) for v in values]


def check_allocation(
    allocation: str | Sequence[float], retention: float, num_layers: int
) -> None:
    """Fail before any calibration if ``allocation`` cannot be met on ``num_layers``
    routed layers (an explicit list of the wrong length, or ``layer_drop`` with a
    budget below one whole layer)."""
    if not isinstance(allocation, str):
        explicit_ratios(allocation, num_layers)
    elif allocation == "layer_drop":
        _layers_kept(retention, num_layers)


def lowest_ratio_at_most(
    allocation: str | Sequence[float], retention: float
) -> float | None:
    """A value the lowest routed ratio of ``allocation`` is known not to exceed before
    any calibration, or ``None`` when it routes whole layers only (``layer_drop``:
    ratios 0 and 1, nothing for a threshold to reach).

    An explicit list's lowest ratio; otherwise the budget itself, since every other
    allocation's ratios have ``retention`` as their mean, so the lowest of them is no
    higher. Calibration rows too short for this value (see
    ``routing.check_calibration_rows``) are too short for the allocated ratios too:
    they can be refused before the dense calibration measures the similarities.
    """
    if not isinstance(allocation, str):
        return min(float(v) for v in allocation)
    if allocation == "layer_drop":
        return None
    return float(retention)


def allocate(
    allocation: str | Sequence[float],
    similarities: Sequence[float],
    retention: float,
    temperature: float,
    beta: float,
    min_retention: float,
    seed: int = 0,
) -> list[float]:
    """Dispatch on the modifier's ``allocation`` field; returns one ratio per
    similarity."""
    n = len(similarities)
    if not isinstance(allocation, str):
        return explicit_ratios(allocation, n)
    if allocation not in ALLOCATIONS:
        raise ValueError(
            f"allocation must be one of {list(ALLOCATIONS)} or a list of ratios, "
            f"got {allocation!r}"
        )
    _check_budget(retention, min_retention)
    if n == 0:
        raise ValueError("no routed decoder layers to allocate tokens to")
    if allocation == "uniform":
        return uniform_ratios(n, retention)
    if allocation == "layer_drop":
        return layer_drop_ratios(similarities, retention)
    ratios = clip_to_budget(
        similarity_ratios(similarities, retention, temperature, beta),
        retention,
        min_retention,
    )
    if allocation == "similarity":
        return ratios
    if allocation == "reversed":
        return reversed_ratios(ratios, similarities)
    return random_ratios(ratios, seed)
