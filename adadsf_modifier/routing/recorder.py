"""What routed layers did in a forward, written by the layers themselves: the path
each call took, the tokens of each row that ran, the (query, key) pairs attended and
the work done for skipped tokens. The FLOPs model reads these records rather than
re-deriving the layers' decisions, so what is counted is what ran; without a recorder
a layer computes none of the counts (nor their host syncs)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerRecord", "RoutingRecorder", "PATHS"]

#: The paths a routed layer takes through one call.
#: ``removed``: ratio 0, the input passes through and the router is not evaluated;
#: ``full``: ratio 1, the unchanged layer runs every token (its own attention);
#: ``skipped``: the router ran and no token was selected;
#: ``gather``: the selected tokens (or rows, when decoding) were gathered into a
#: compacted batch and scattered back;
#: ``in_place``: decoding one token per row, every row ran the layer in place.
PATHS = ("removed", "full", "skipped", "gather", "in_place")


@dataclass(frozen=True)
class LayerRecord:
    """One call of one routed layer: ``kept [batch]`` tokens that ran and ``attended
    [batch]`` (query, key) pairs, cached keys included (``None`` for ``full``, zero
    for ``removed`` / ``skipped``)."""

    path: str
    kept: torch.Tensor | None
    attended: torch.Tensor | None
    #: whether the layer evaluated its router in this call (its cost is counted)
    router_ran: bool = True
    #: ``[batch]`` tokens of each row that went through the layer's fitted skip path
    #: (``None``: none, e.g. the identity skip path)
    skip_path: torch.Tensor | None = None
    #: ``[batch]`` skipped tokens of each row whose keys/values the layer computed
    #: (``skipped_tokens_kv``; ``None``: none)
    kv_only: torch.Tensor | None = None


class RoutingRecorder:
    """Collects :class:`LayerRecord` s per layer index (see :meth:`attached`)."""

    def __init__(self) -> None:
        self.records: dict[int, list[LayerRecord]] = {}

    def record(
        self,
        layer_index: int,
        path: str,
        kept: torch.Tensor | None = None,
        attended: torch.Tensor | None = None,
        batch: int = 0,
        router_ran: bool | None = None,
        skip_path: torch.Tensor | None = None,
        kv: torch.Tensor | None = None,
    ) -> None:
        """Called by a routed layer; ``removed`` / ``skipped`` may give ``batch`` for
        zero counts."""
        if path not in PATHS:
            raise ValueError(f"unknown routing path {path!r}; expected one of {PATHS}")
        if path in ("removed", "skipped") and kept is None:
            kept = attended = torch.zeros(batch, dtype=torch.long)
        if kept is not None:
            kept, attended = kept.long().cpu(), attended.long().cpu()
        if router_ran is None:
            router_ran = path != "removed"
        if skip_path is not None:
            skip_path = skip_path.long().cpu()
        if kv is not None:
            kv = kv.long().cpu()
        self.records.setdefault(int(layer_index), []).append(
            LayerRecord(path, kept, attended, router_ran, skip_path, kv)
        )

    @contextmanager
    def attached(self, layers: Iterable[nn.Module]) -> Iterator[RoutingRecorder]:
        """Attach to ``layers`` (routed decoder layers) for the block."""
        layers = list(layers)
        for layer in layers:
            layer.routing_recorder = self
        try:
            yield self
        finally:
            for layer in layers:
                layer.__dict__.pop("routing_recorder", None)
