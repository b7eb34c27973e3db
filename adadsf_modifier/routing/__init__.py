"""Token routing: the router, the routed decoder layer, routing modes, caches,
thresholds and what skipped tokens get (skip paths, keys/values)."""

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
    route_layer,
    routed_class_for,
    routed_layers,
    unroute_layer,
)
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.selection import threshold_for_ratio, tokens_to_keep
from adadsf_modifier.routing.skip_fields import SkipPathFields
from adadsf_modifier.routing.skip_fit import RouterRefit, SkipPathReport, fit_skip_paths
from adadsf_modifier.routing.skip_path import SKIP_PATHS, SkipPath
from adadsf_modifier.routing.thresholds import (
    ThresholdCalibrationError,
    ThresholdReport,
    calibrate_thresholds,
    check_calibration_rows,
    check_thresholds,
)

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
    "route_layer",
    "routed_class_for",
    "unroute_layer",
    "TokenRouter",
    "tokens_to_keep",
    "SKIP_PATHS",
    "SkipPath",
    "SkipPathFields",
    "RouterRefit",
    "SkipPathReport",
    "fit_skip_paths",
    "ThresholdCalibrationError",
    "ThresholdReport",
    "calibrate_thresholds",
    "check_thresholds",
    "check_calibration_rows",
    "threshold_for_ratio",
    "routed_layers",
]
