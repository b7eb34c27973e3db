"""Swapping a decoder layer's class in place, through compressed-tensors' offloading
wrappers."""

from __future__ import annotations

from compressed_tensors.offload import unwrap_offload_forward
from torch import nn

__all__ = ["swap_class"]


def swap_class(layer: nn.Module, new_class: type) -> None:
    """``layer.__class__ = new_class``, carrying any instance-level ``forward``
    along. compressed-tensors' offloading replaces ``layer.forward`` by a wrapper
    calling the class's forward captured at install time (and ``remove_dispatch``
    leaves a bound copy behind), either of which would bypass or keep routing after a
    swap: the wrapper is re-pointed, a leftover copy removed."""
    old_forward = type(layer).forward
    offloaded = "_original_forward_func" in layer.__dict__
    with unwrap_offload_forward(layer):
        bound = layer.__dict__.get("forward")
        if bound is not None and getattr(bound, "__func__", None) is not old_forward:
            raise RuntimeError(
                f"{type(layer).__name__} has an instance-level forward ({bound!r}) "
                "that routing would bypass; AdaDSF cannot tell which forward to route"
            )
        layer.__class__ = new_class
        if offloaded:
            layer.forward = new_class.forward.__get__(layer)
        elif bound is not None:
            del layer.__dict__["forward"]
