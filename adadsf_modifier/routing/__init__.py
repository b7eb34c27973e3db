"""Token routing: the router, the routed decoder layer, routing modes, caches and
thresholds."""

from adadsf_modifier.routing.architectures import (
    SUPPORTED_ARCHITECTURES,
    ArchitectureSpec,
    UnsupportedArchitectureError,
    architecture_of,
    decoder_layers,
)
from adadsf_modifier.routing.cache import RoutedCacheLayer
from adadsf_modifier.routing.modes import (
    ROUTING_MODES,
    get_routing_modes,
    routing_mode,
    set_routing_mode,
)
from adadsf_modifier.routing.routed_layer import (
    RoutedLayer,
    route_layer,
    routed_class_for,
    unroute_layer,
)
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.thresholds import (
    ThresholdReport,
    calibrate_thresholds,
    threshold_for_ratio,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureSpec",
    "UnsupportedArchitectureError",
    "architecture_of",
    "decoder_layers",
    "RoutedCacheLayer",
    "ROUTING_MODES",
    "get_routing_modes",
    "routing_mode",
    "set_routing_mode",
    "RoutedLayer",
    "route_layer",
    "routed_class_for",
    "unroute_layer",
    "TokenRouter",
    "ThresholdReport",
    "calibrate_thresholds",
    "threshold_for_ratio",
    "routed_layers",
]


def routed_layers(model) -> list[RoutedLayer]:
    """All routed decoder layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]
