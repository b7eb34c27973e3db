"""Reusable pydantic field types whose errors name the allowed range.

Declared once and used by the modifier's fields, so a bad YAML value fails at
construction with ``<field>: must be in (0, 1], got 1.2`` rather than deep inside
calibration; :func:`first_error` words a failed validation as that one line. A leaf
module: it imports nothing of the package.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Annotated, Any

from loguru import logger
from pydantic import AfterValidator, BeforeValidator, ValidationError, ValidationInfo

__all__ = [
    "FiniteFloat",
    "InputError",
    "NonNegativeInt",
    "NonNegativeFloat",
    "PositiveFloat",
    "PositiveInt",
    "UnitInterval",
    "constrained",
    "first_error",
    "one_of",
    "drop_retired_fields",
    "refuse_booleans_as_numbers",
]

#: Recipe fields that once configured experiments no shipped recipe or published
#: result used: each with the one value that still describes what the plug-in does
#: (``...``: any value, the field had no effect) and that behaviour in words.
RETIRED_FIELDS: dict[str, tuple[object, str]] = {
    "threshold_passes": (..., "it had no effect (thresholds are fitted in one walk)"),
    "route_target": ("layer", "a router decides the whole decoder layer"),
    "importance": ("similarity", "allocation ranks layers by their dense similarity"),
    "importance_tokens": (..., "allocation ranks layers by their dense similarity"),
    "importance_fit_tokens": (..., "allocation ranks layers by their dense similarity"),
    "skip_path_tokens": ("skipped", "a skip path is fitted on the tokens it serves"),
    "align_lr_schedule": ("constant", "the alignment trains at a constant rate"),
    "align_warmup_steps": (0, "the alignment trains at its full rate from step 1"),
    "align_anneal_steps": (0, "each routed layer trains at its allocated ratio"),
    "align_routers_first_steps": (0, "every trainable parameter trains from step 1"),
    "align_grad_clip": (1.0, "the alignment clips gradients to norm 1"),
    "align_weight_decay": (0.0, "the alignment uses no weight decay"),
    "routing_mode": (
        "causal",
        "each token runs a layer iff its score passes the layer's calibrated "
        "threshold; `adadsf calibrate` refits them on your text",
    ),
}


def drop_retired_fields(data: Any, owner: str) -> Any:
    """``data`` (a modifier's recipe fields) without its retired fields
    (:data:`RETIRED_FIELDS`): one set to the value that describes what the plug-in
    does now is dropped with a warning, so an older recipe still loads; one set to
    anything else asked for behaviour that is gone, and is refused
    (:class:`InputError`, naming it)."""
    if not isinstance(data, dict) or not data.keys() & RETIRED_FIELDS.keys():
        return data
    kept = dict(data)
    for name in data.keys() & RETIRED_FIELDS.keys():
        value, now = RETIRED_FIELDS[name]
        given = kept.pop(name)
        if value is not ... and (given != value or isinstance(given, bool)):
            raise InputError(
                f"{owner}: `{name}: {given}` is no longer supported ({now}): remove "
                "it from the recipe"
            )
        logger.warning(
            f"{owner}: `{name}` is no longer a recipe field ({now}); "
            "remove it from the recipe"
        )
    return kept


def _takes_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(a) for a in typing.get_args(annotation))


def _holds_bool(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)


def refuse_booleans_as_numbers(model: type, data: Any, owner: str) -> Any:
    """Refuse ``true`` / ``false`` given for a field that is not a boolean.

    Pydantic reads ``True`` as 1 for a number (``retention: true`` would route every
    layer at ratio 1 without a word); strict numbers would refuse the integer ``1``
    a YAML author writes for a float. So a boolean, alone or inside a list, is refused
    for every field whose type does not name ``bool``."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    for name, value in data.items():
        if name in fields and _holds_bool(value):
            if not _takes_bool(fields[name].annotation):
                raise InputError(
                    f"{owner}: `{name}: {value}` holds a boolean where a number or "
                    "name is expected"
                )
    return data


class InputError(ValueError):
    """An input the user gave that cannot work (a recipe field, the model, the data, a
    checkpoint): what to change is in the message, so the command line reports it in
    one line (exit 2) instead of a traceback. A ``ValueError``, as before."""


def constrained(ok: Callable[[float], bool], requirement: str) -> AfterValidator:
    """An ``AfterValidator`` raising ``"must be <requirement>, got <value>"``."""

    def check(value):
        if not ok(value):
            raise ValueError(f"must be {requirement}, got {value!r}")
        return value

    return AfterValidator(check)


def one_of(choices: tuple[str, ...]) -> BeforeValidator:
    """A ``BeforeValidator`` for a ``Literal`` field that names the field and the
    allowed values (pydantic's own message lists them as a Python type)."""

    def check(value: object, info: ValidationInfo) -> object:
        if value not in choices:
            raise ValueError(
                f"{info.field_name} must be one of {list(choices)}, got {value!r}"
            )
        return value

    return BeforeValidator(check)


def first_error(err: ValidationError) -> str:
    """The first error of ``err`` on one line, ``<field>: <message>`` (the message
    alone for a model-level rule), without pydantic's ``Value error,`` prefix."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = str(first.get("msg", err)).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def _finite(v: float) -> bool:
    return math.isfinite(v)


#: A ratio or budget: a fraction of tokens in (0, 1].
UnitInterval = Annotated[
    float, constrained(lambda v: _finite(v) and 0.0 < v <= 1.0, "in (0, 1]")
]
#: A strictly positive finite number (temperatures, learning rates).
PositiveFloat = Annotated[float, constrained(lambda v: _finite(v) and v > 0.0, "> 0")]
#: A finite number >= 0 (weights, steepness).
NonNegativeFloat = Annotated[
    float, constrained(lambda v: _finite(v) and v >= 0.0, "a finite number >= 0")
]
#: Any finite number.
FiniteFloat = Annotated[float, constrained(_finite, "a finite number")]
#: Sizes and counts.
PositiveInt = Annotated[int, constrained(lambda v: v >= 1, "a positive integer")]
#: Counts where 0 means "none" (e.g. training steps).
NonNegativeInt = Annotated[int, constrained(lambda v: v >= 0, "an integer >= 0")]
