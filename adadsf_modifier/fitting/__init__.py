"""What builds a routed model, in pipeline order: :mod:`.calibration` (per-layer
similarity), :mod:`.allocation` (per-layer ratios), :mod:`.warm_start` (router
initialisation), :mod:`.skip_fit` (skip paths, :mod:`.ridge`, in one
:mod:`.layer_walk`), then after the alignment :mod:`.thresholds` (causal routing's
thresholds). :mod:`.skip_fields` holds the recipe fields of the last stages.
"""

from adadsf_modifier.fitting.skip_fields import SkipPathFields
from adadsf_modifier.fitting.skip_fit import RouterRefit, SkipPathReport, fit_skip_paths
from adadsf_modifier.fitting.thresholds import (
    ThresholdCalibrationError,
    ThresholdReport,
    calibrate_thresholds,
    check_calibration_rows,
    check_thresholds,
)

__all__ = [
    "SkipPathFields",
    "RouterRefit",
    "SkipPathReport",
    "fit_skip_paths",
    "ThresholdCalibrationError",
    "ThresholdReport",
    "calibrate_thresholds",
    "check_calibration_rows",
    "check_thresholds",
]
