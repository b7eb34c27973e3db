"""Routing modes: which tokens a routed layer runs.

- ``topk``: per sequence, the ``K = max(1, floor(r * real_length))`` highest-scoring
  real tokens. Needs the whole sequence, so it is for training and paper-style
  evaluation; it cannot continue from a KV cache.
- ``causal``: each token runs the layer iff its own router score exceeds the layer's
  calibrated threshold (set so that the expected kept fraction is ``r``). A token's
  decision depends only on itself and the past, so prefill + incremental decoding equals
  one full forward.
- ``quantile``: the causal rule with each layer's threshold fitted on the batch itself
  so that the layer's ratio of the batch's real tokens runs (the first token of each
  row counted as running). For training that sees inference's decisions while the
  router, and so the right threshold, moves; like ``topk`` it needs the whole batch.
- ``rank``: the ``p``-th real token of a row runs iff fewer than about ``r * p`` of
  the row's earlier real tokens score higher at this layer: it is in the top ``r`` of
  its row so far (:func:`~adadsf_modifier.routing.selection.choose_by_rank`; tied
  scores are split so that about ``r`` of a repeated token's occurrences run too),
  unless the count of the row's tokens that ran the layer would leave a band of
  :data:`~adadsf_modifier.routing.selection.RANK_SLACK` tokens around ``r * p``
  (scores rise along a row, and without the band a continuation outran its share).
  No threshold: on text whose scores sit higher or lower than the calibration set's,
  each layer still keeps ``r`` of every row's tokens within the band, where
  ``causal``'s fitted thresholds drift. Causal as well (the row's past scores and
  count per layer are kept with the KV cache), so prefill + incremental decoding
  equals one full forward. Opt-in.
- ``auto`` (default): ``topk`` while training, ``causal`` in eval mode once a threshold
  has been calibrated (top-k before that).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from adadsf_modifier.routing.routed_layer import RoutedLayer, routed_layers

__all__ = [
    "ROUTING_MODES",
    "set_routing_mode",
    "routing_mode",
    "routing_override",
    "get_routing_modes",
    "routing_modes_of",
]

ROUTING_MODES = ("auto", "topk", "causal", "quantile", "rank")


def _routed(model: nn.Module):
    layers = routed_layers(model)
    if not layers:
        raise ValueError("the model has no routed layers (run AdaDSFModifier first)")
    return layers


def _check_known(mode: str) -> None:
    if mode not in ROUTING_MODES:
        raise ValueError(
            f"routing mode must be one of {list(ROUTING_MODES)}, got {mode!r}"
        )


def _check_thresholds(layers: Sequence[RoutedLayer], mode: str) -> None:
    """Causal routing of a layer that keeps some but not all tokens needs its
    calibrated threshold."""
    if mode == "causal":
        missing = [
            m.layer_index
            for m in layers
            if m.causal_threshold is None and 0 < m.retention_ratio < 1
        ]
        if missing:
            raise ValueError(
                f"causal routing needs calibrated thresholds; layers {missing} have "
                "none (run adadsf_modifier.fitting.calibrate_thresholds)"
            )


def set_routing_mode(model: nn.Module, mode: str) -> None:
    """Switch every routed layer of ``model`` to ``mode`` (one of
    :data:`ROUTING_MODES`)."""
    _check_known(mode)
    layers = _routed(model)
    _check_thresholds(layers, mode)
    for layer in layers:
        layer.routing_mode = mode


def routing_modes_of(model: nn.Module) -> str:
    """The mode every routed layer of ``model`` resolves to, or the distinct ones
    joined by commas (``"causal,rank"``): how a record names what it measured."""
    return ",".join(sorted(set(get_routing_modes(model))))


def get_routing_modes(model: nn.Module) -> list[str]:
    """The mode each routed layer would use right now (``auto`` resolved)."""
    return [m.resolved_routing_mode() for m in _routed(model)]


@contextmanager
def routing_override(
    target: nn.Module | Sequence[nn.Module],
    *,
    retention_ratio: float | None = None,
    mode: str | None = None,
) -> Iterator[list[RoutedLayer]]:
    """Within the block, the routed layers of ``target`` keep ``retention_ratio`` of
    their tokens and/or route in ``mode``; each layer's own values come back when the
    block ends, also on error. Yields those layers.

    ``target``: a model or one layer (its routed layers; none is an error, as for
    :func:`set_routing_mode`), or a sequence of decoder layers (its routed ones; the
    dense ones have no routing to change). Calibration passes use it to run layers
    densely (ratio 1), to pass inputs straight through (ratio 0) or to fit under a
    given mode, without touching what allocation and calibration decided.
    """
    if isinstance(target, nn.Module):
        layers = _routed(target)
    else:
        layers = [m for m in target if isinstance(m, RoutedLayer)]
    changes: dict[str, object] = {}
    if retention_ratio is not None:
        if not 0.0 <= retention_ratio <= 1.0:
            raise ValueError(
                f"retention ratio must be in [0, 1], got {retention_ratio}"
            )
        changes["retention_ratio"] = float(retention_ratio)
    if mode is not None:
        _check_known(mode)
        changes["routing_mode"] = mode
    before = [{name: getattr(m, name) for name in changes} for m in layers]
    try:
        for layer in layers:
            for name, value in changes.items():
                setattr(layer, name, value)
        if mode is not None:  # under the ratio the block runs at
            _check_thresholds(layers, mode)
        yield layers
    finally:
        for layer, values in zip(layers, before):
            for name, value in values.items():
                setattr(layer, name, value)


@contextmanager
def routing_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """Temporarily use ``mode`` (restores each layer's previous setting)."""
    with routing_override(model, mode=mode):
        yield
