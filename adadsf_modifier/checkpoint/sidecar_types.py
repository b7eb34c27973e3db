"""Field types of both kinds' sidecar schemas."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer

from adadsf_modifier.routing import ROUTING_MODES
from adadsf_modifier.routing.skip_path import SKIP_PATHS


def _threshold_in(value: Any) -> Any:
    """Infinities are written as text (JSON has none). NaN is refused: every score
    compares False with it, so the layer would silently run only the first token."""
    if isinstance(value, str):
        if value in ("inf", "-inf"):
            return float(value)
        if value.strip().lower().lstrip("+-") != "nan":
            raise ValueError("must be a number, 'inf', '-inf' or null")
        value = math.nan
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("must not be NaN (use null for no threshold)")
    return value


def _threshold_out(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


Threshold = Annotated[
    float | None,
    BeforeValidator(_threshold_in),
    PlainSerializer(_threshold_out, when_used="json"),
]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0)]
RoutingMode = Literal[ROUTING_MODES]  # type: ignore[valid-type]
SkipPathKind = Literal[SKIP_PATHS]  # type: ignore[valid-type]
