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
- ``auto`` (default): ``topk`` while training, ``causal`` in eval mode once a threshold
  has been calibrated (top-k before that).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from adadsf_modifier.routing.routed_layer import routed_layers

__all__ = ["ROUTING_MODES", "set_routing_mode", "routing_mode", "get_routing_modes"]

ROUTING_MODES = ("auto", "topk", "causal", "quantile")


def _routed(model: nn.Module):
    layers = routed_layers(model)
    if not layers:
        raise ValueError("the model has no routed layers (run AdaDSFModifier first)")
    return layers


def set_routing_mode(model: nn.Module, mode: str) -> None:
    """Switch every routed layer of ``model`` to ``mode`` (one of
    :data:`ROUTING_MODES`)."""
    if mode not in ROUTING_MODES:
        raise ValueError(
            f"routing mode must be one of {list(ROUTING_MODES)}, got {mode!r}"
        )
    layers = _routed(model)
    if mode == "causal":
        missing = [
            m.layer_index
            for m in layers
            if m.causal_threshold is None and 0 < m.retention_ratio < 1
        ]
        if missing:
            raise ValueError(
                f"causal routing needs calibrated thresholds; layers {missing} have "
                "none (run adadsf_modifier.routing.calibrate_thresholds)"
            )
    for layer in layers:
        layer.routing_mode = mode


def get_routing_modes(model: nn.Module) -> list[str]:
    """The mode each routed layer would use right now (``auto`` resolved)."""
    return [m.resolved_routing_mode() for m in _routed(model)]


@contextmanager
def routing_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """Temporarily use ``mode`` (restores each layer's previous setting)."""
    layers = _routed(model)
    before = [m.routing_mode for m in layers]
    set_routing_mode(model, mode)
    try:
        yield
    finally:
        for layer, m in zip(layers, before):
            layer.routing_mode = m
