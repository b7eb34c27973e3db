"""The routed model: what a loaded checkpoint runs. The router, the routed decoder
layer (prefill and decoding), the tokens it selects, attention for the kept tokens,
its cache, the routing modes and the skip path a skipped token takes.

What builds these (calibration, allocation, router initialisation, skip-path fits,
thresholds) lives in :mod:`adadsf_modifier.fitting`; nothing here imports it."""

from adadsf_modifier.routing.architectures import (
    SUPPORTED_ARCHITECTURES,
    ArchitectureSpec,
    UnsupportedArchitectureError,
    architecture_for_config,
    architecture_of,
    decoder_layers,
    original_class,
    sliding_windows,
)
from adadsf_modifier.routing.modes import (
    ROUTING_MODES,
    get_routing_modes,
    routing_mode,
    routing_modes_of,
    routing_override,
    set_routing_mode,
)
from adadsf_modifier.routing.recorder import LayerRecord, RoutingRecorder
from adadsf_modifier.routing.routed_cache import RoutedCacheLayer
from adadsf_modifier.routing.routed_layer import (
    RoutedLayer,
    refuse_empty_inputs,
    route_layer,
    routed_class_for,
    routed_layers,
    unroute_layer,
)
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.selection import tokens_to_keep
from adadsf_modifier.routing.skip_path import SKIP_PATHS, SkipPath

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureSpec",
    "UnsupportedArchitectureError",
    "architecture_for_config",
    "architecture_of",
    "decoder_layers",
    "original_class",
    "sliding_windows",
    "LayerRecord",
    "RoutingRecorder",
    "RoutedCacheLayer",
    "ROUTING_MODES",
    "get_routing_modes",
    "routing_modes_of",
    "routing_mode",
    "routing_override",
    "set_routing_mode",
    "RoutedLayer",
    "refuse_empty_inputs",
    "route_layer",
    "routed_class_for",
    "unroute_layer",
    "TokenRouter",
    "tokens_to_keep",
    "SKIP_PATHS",
    "SkipPath",
    "routed_layers",
]
