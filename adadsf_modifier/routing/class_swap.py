"""Swapping a decoder layer's class in place, offloading wrappers included.

:mod:`adadsf_modifier.routing.routed_layer` routes and unroutes a layer by swapping
its class; this module holds the swap itself, which has to see through
compressed-tensors' offloading wrappers.
"""

from __future__ import annotations

from compressed_tensors.offload import unwrap_offload_forward
from torch import nn

__all__ = ["swap_class"]


def swap_class(layer: nn.Module, new_class: type) -> None:
    """``layer.__class__ = new_class``, carrying any instance-level ``forward`` along.

    compressed-tensors' offloading (which llm-compressor's pipelines put on every
    module) replaces ``layer.forward`` by a wrapper that calls the class's forward
    *captured when it was installed*, and ``remove_dispatch`` leaves a bound copy of
    that function behind. Either would silently bypass (or keep) routing after a class
    swap. ``unwrap_offload_forward`` exposes the wrapped forward as a bound method
    and re-wraps whatever forward the layer has on exit, so re-binding it to the new
    class re-points the wrapper; a leftover bound copy is simply removed.
    """
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
