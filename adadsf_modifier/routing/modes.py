"""Routing modes: which tokens a routed layer runs.

- ``topk``: each row's ``max(1, floor(r * n))`` best-scoring real tokens; needs the
  whole sequence (training, paper-style evaluation), no KV cache.
- ``causal``: a token runs iff its score exceeds the layer's calibrated threshold, so
  prefill + decoding equals one forward.
- ``quantile``: the causal rule with the threshold fitted on the batch itself, so
  training sees inference's decisions while the router moves.
- ``auto`` (default): ``topk`` while training, ``causal`` in eval mode once thresholds
  are calibrated.
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

ROUTING_MODES = ("auto", "topk", "causal", "quantile")


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
    """Causal routing of a layer with ``0 < r < 1`` needs its calibrated threshold."""
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
    """The mode every routed layer resolves to, or the distinct ones joined by
    commas: how a record names what it measured."""
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
    """Within the block, the routed layers of ``target`` (a model, a layer, or a
    sequence of decoder layers) keep ``retention_ratio`` of their tokens and/or route
    in ``mode``; their own values come back after it, also on error. Yields the
    layers."""
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
