"""What skipped tokens get: the ``skip_path*`` and ``skipped_tokens_kv`` recipe fields
(:class:`SkipPathFields`, which both modifiers inherit), and the steps that act on
them: the checks before calibration, the routed layer's setup, the fit, the finished
model's thresholds.

The mixin declares no ``model_config``: the modifiers keep llm-compressor's
``extra="forbid"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, PlainValidator
from torch import nn

from adadsf_modifier.constraints import PositiveInt
from adadsf_modifier.fitting.skip_fit import (
    RouterRefit,
    SkipPathReport,
    fit_skip_paths,
)
from adadsf_modifier.fitting.thresholds import (
    ThresholdReport,
    calibrate_thresholds,
    check_thresholds,
)
from adadsf_modifier.recipe_checks import check_recipe_keeps_skip_paths_unquantized
from adadsf_modifier.routing.skip_path import SkipPath, install_skip_path

__all__ = [
    "RidgePenalty",
    "SkipPathFields",
    "check_skip_path",
    "configure_routed_layer",
    "fit_configured_skip_paths",
    "thresholds_after",
]


def _ridge_penalty(value: Any) -> float | str:
    if value == "auto":
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a number > 0 or 'auto', got {value!r}")
    return float(value)


#: A relative ridge penalty (> 0), or ``"auto"`` (chosen per layer, held out).
RidgePenalty = Annotated[float | Literal["auto"], PlainValidator(_ridge_penalty)]


class SkipPathFields(BaseModel):
    """What a token that skips a routed layer gets.

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      skip_path: ridge          # identity (default, the paper) | ridge
      skip_path_rank: 64        # null (default): full rank
      skipped_tokens_kv: true   # default false (the paper)
    ```

    :param skip_path: ``identity`` (the paper: a skipped token passes unchanged) or
        ``ridge``: it gets ``x + u(x)``, an affine map of its input fitted in closed
        form (ridge regression of the layer's update ``layer(x) - x`` on ``[x, 1]``) on
        the calibration data, layer by layer on the routed model's own activations,
        after the router warm start; refitted after an alignment that trained the layers
        (``align_trainable: routers_and_layers``). It costs ``2 h^2`` FLOPs (``4 h k``
        at rank ``k``) per skipped token, counted by the FLOPs model
    :param skip_path_rank: rank of the ridge map (``null``: full rank); in
        ``[1, hidden_size - 1]``
    :param skip_path_ridge: ridge penalty, relative to the mean input variance, or
        ``auto`` (default): chosen per layer by two-fold held-out error on the
        calibration rows (layers want different penalties: one fixed penalty for all
        gives clearly worse maps)
    :param skipped_tokens_kv: skipped tokens still give the layer's attention their
        keys/values (input norm + key/value projections), so the tokens that run it
        see the full context; costs those projections per skipped token and the larger
        attention, counted by the FLOPs model. Its KV cache then holds every position
    """

    skip_path: Literal["identity", "ridge"] = "identity"
    skip_path_rank: PositiveInt | None = None
    skip_path_ridge: RidgePenalty = "auto"
    skipped_tokens_kv: bool = False


def check_skip_path(
    fields: SkipPathFields,
    model: nn.Module,
    layer_names: Sequence[str],
    recipe: Sequence[Any] = (),
    router_init: str = "similarity",
) -> None:
    """Refuse, before any calibration, a rank the model cannot take, a router
    initialisation that needs a fitted skip path without one, and a quantization
    modifier of ``recipe`` (the modifiers of the recipe this one runs in) that would
    quantize the skip paths."""
    if router_init == "skip_error" and fields.skip_path != "ridge":
        raise ValueError(
            "router_init 'skip_error' fits each router to the error of its layer's "
            f"fitted skip path: it needs skip_path 'ridge', got {fields.skip_path!r}"
        )
    if fields.skip_path == "identity":
        return
    hidden, rank = int(model.config.hidden_size), fields.skip_path_rank
    if rank is not None and rank >= hidden:
        raise ValueError(
            f"skip_path_rank must be below the hidden size {hidden} (null for full "
            f"rank), got {rank}"
        )
    check_recipe_keeps_skip_paths_unquantized(layer_names, SkipPath(1), recipe)


def configure_routed_layer(fields: SkipPathFields, layer: nn.Module) -> None:
    """Give a freshly routed layer its skip path (zero, i.e. the identity, until
    fitted) and its ``skipped_tokens_kv`` setting."""
    layer.skipped_tokens_kv = bool(fields.skipped_tokens_kv)
    if fields.skip_path != "identity" and layer.retention_ratio < 1.0:
        install_skip_path(layer, layer.router.hidden_size, fields.skip_path_rank)


def fit_configured_skip_paths(
    fields: SkipPathFields,
    model: nn.Module,
    batches: Iterable[Any],
    refit_routers: RouterRefit | None = None,
    fit_thresholds: bool = False,
) -> SkipPathReport | None:
    """Fit the ``ridge`` skip paths on ``batches`` (``refit_routers``: and the routers
    to their skip error; ``fit_thresholds``: and the causal thresholds in the same
    walk, for a model nothing trains after it; see :func:`fit_skip_paths`). ``None``
    for the identity skip path."""
    if fields.skip_path == "identity":
        return None
    return fit_skip_paths(
        model,
        batches,
        rank=fields.skip_path_rank,
        ridge=fields.skip_path_ridge,
        refit_routers=refit_routers,
        fit_thresholds=fit_thresholds,
    )


def thresholds_after(
    model: nn.Module, batches: Iterable[Any], last_walk: SkipPathReport | None
) -> ThresholdReport:
    """The finished model's causal thresholds: those its last skip-path walk
    (``last_walk``, run with ``fit_thresholds``: nothing trains after it) fitted,
    checked; a threshold walk of their own on ``batches`` where it fitted none (no
    walk ran: an identity skip path, a routers-only alignment; or every routed layer
    runs all tokens or none)."""
    fitted = last_walk.thresholds if last_walk is not None else None
    if fitted is not None:
        return check_thresholds(fitted)
    return calibrate_thresholds(model, batches)
