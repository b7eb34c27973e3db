"""Pydantic field types whose errors name the allowed range, so a bad recipe value
fails at construction (``<field>: must be in (0, 1], got 1.2``), not deep inside
calibration. A leaf module: it imports nothing of the package."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Annotated, Any

from loguru import logger
from pydantic import AfterValidator, BeforeValidator, ValidationError, ValidationInfo

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
    """``data`` without its retired fields: one set to the value that describes what
    the plug-in does now is dropped with a warning (an older recipe still loads); any
    other value asked for behaviour that is gone, and is refused."""
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
    """Refuse ``true`` / ``false`` (alone or in a list) for a field whose type does
    not name ``bool``: pydantic reads ``True`` as 1 (``retention: true`` would route
    every layer at ratio 1 silently), and strict numbers would refuse the integer
    ``1`` a YAML author writes for a float."""
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
    checkpoint): the message says what to change, so the command line reports it in
    one line (exit 2) instead of a traceback."""


def constrained(ok: Callable[[float], bool], requirement: str) -> AfterValidator:
    """An ``AfterValidator`` raising ``"must be <requirement>, got <value>"``."""

    def check(value):
        if not ok(value):
            raise ValueError(f"must be {requirement}, got {value!r}")
        return value

    return AfterValidator(check)


def one_of(choices: tuple[str, ...]) -> BeforeValidator:
    """A ``BeforeValidator`` for a ``Literal`` field naming the field and the allowed
    values (pydantic's own message lists them as a Python type)."""

    def check(value: object, info: ValidationInfo) -> object:
        if value not in choices:
            raise ValueError(
                f"{info.field_name} must be one of {list(choices)}, got {value!r}"
            )
        return value

    return BeforeValidator(check)


def first_error(err: ValidationError) -> str:
    """The first error of ``err`` as one line, ``<field>: <message>``."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = str(first.get("msg", err)).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


UnitInterval = Annotated[
    float, constrained(lambda v: math.isfinite(v) and 0.0 < v <= 1.0, "in (0, 1]")
]
PositiveFloat = Annotated[
    float, constrained(lambda v: math.isfinite(v) and v > 0.0, "> 0")
]
NonNegativeFloat = Annotated[
    float, constrained(lambda v: math.isfinite(v) and v >= 0.0, "a finite number >= 0")
]
PositiveInt = Annotated[int, constrained(lambda v: v >= 1, "a positive integer")]
NonNegativeInt = Annotated[int, constrained(lambda v: v >= 0, "an integer >= 0")]
