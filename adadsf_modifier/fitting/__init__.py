"""What builds a routed model, in pipeline order (the modifiers run these stages).

1. :mod:`~adadsf_modifier.fitting.calibration`: each layer's input/output cosine
   similarity on dense calibration text (:mod:`~adadsf_modifier.fitting.layer_capture`
   records the layers' inputs).
2. :mod:`~adadsf_modifier.fitting.allocation`: per-layer retention ratios under the
   global budget.
3. :mod:`~adadsf_modifier.fitting.warm_start`: each router initialised to rank tokens
   the way the layer's own update (or its skip error) does.
4. :mod:`~adadsf_modifier.fitting.skip_fit`: the skip paths, fitted in closed form
   (:mod:`~adadsf_modifier.fitting.ridge`), in one walk of the decoder stack
   (:mod:`~adadsf_modifier.fitting.layer_walk`).
5. Alignment (:mod:`adadsf_modifier.alignment`), then
   :mod:`~adadsf_modifier.fitting.thresholds`: the per-layer score thresholds that
   causal routing uses at inference.

:mod:`~adadsf_modifier.fitting.skip_fields` holds the recipe fields of stages 4-5.
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
