"""Token routing: the router, the routed decoder layer, and the selection tensor ops."""

from adadsf_modifier.routing.architectures import (
    SUPPORTED_ARCHITECTURES,
    ArchitectureSpec,
    UnsupportedArchitectureError,
    architecture_of,
    decoder_layers,
)
from adadsf_modifier.routing.routed_layer import (
    RoutedLayer,
    route_layer,
    routed_class_for,
    unroute_layer,
)
from adadsf_modifier.routing.router import TokenRouter

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureSpec",
    "UnsupportedArchitectureError",
    "architecture_of",
    "decoder_layers",
    "RoutedLayer",
    "route_layer",
    "routed_class_for",
    "unroute_layer",
    "TokenRouter",
    "routed_layers",
]


def routed_layers(model) -> list[RoutedLayer]:
    """All routed decoder layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]
