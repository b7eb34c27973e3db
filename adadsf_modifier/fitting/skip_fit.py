"""Fit every routed layer's skip path in closed form, layer by layer, on calibration
data.

:func:`fit_skip_paths` walks the decoder stack once, each layer's inputs being those
the *routed* model gives it (layers below already fitted and routed), so each fit sees
the activations it will meet at inference. Per routed layer it regresses the dense
update ``layer(x) - x`` on ``[x, 1]`` over the real tokens the router skips (all real
tokens where too few skip), then runs the routed layer for the next one's inputs.

``refit_routers`` (``router_init: skip_error``) refits each router, right after its
map, to predict the map's relative error per token (:func:`~adadsf_modifier.fitting.\
warm_start.skip_error_target`), then refits the map on the tokens the new router skips:
the router learns which tokens the map cannot stand in for. ``fit_thresholds`` also
fits each causal threshold once its router is final, and the map on the tokens it
skips, saving the separate threshold walk; only valid when nothing trains afterwards.

Under ``torchrun`` the statistics are summed over ranks and routers refit on the
gathered sample, so every rank ends with the same maps and routers. Memory: one
batch-set of hidden states and one layer's ``(h + 1)^2`` float64 statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from loguru import logger
from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.fitting.layer_walk import (
    LayerStep,
    real_tokens_of,
    router_scores,
    walk_layers,
)
from adadsf_modifier.fitting.ridge import (
    RidgeFit,
    RidgeStats,
    fit_ridge_on_folds,
    ridge_folds,
)
from adadsf_modifier.fitting.thresholds import (
    THRESHOLD_TOLERANCE,
    ThresholdReport,
    fit_layer_threshold,
)
from adadsf_modifier.fitting.warm_start import skip_error_target, warm_start_router
from adadsf_modifier.routing.architectures import decoder_layers
from adadsf_modifier.routing.modes import routing_override
from adadsf_modifier.routing.routed_layer import RoutedLayer, routed_layers
from adadsf_modifier.routing.skip_path import SkipPath, install_skip_path
from adadsf_modifier.utils import model_device

__all__ = [
    "RouterRefit",
    "SkipPathReport",
    "fit_skip_paths",
    "install_skip_paths",
    "kept_tokens_run_densely",
]


@dataclass
class SkipPathReport:
    """Per fitted layer (in layer order): index, tokens fit on, the fraction of their
    update the map explains (``r2``; the identity skip path has 0) and the relative
    ridge penalty used (``ridge``)."""

    layer_indices: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    r2: list[float] = field(default_factory=list)
    ridge: list[float] = field(default_factory=list)
    #: with ``refit_routers``: each refit router's held-out rank correlation with the
    #: skip error it was fit to
    router_rank_corr: list[float] = field(default_factory=list)
    #: with ``fit_thresholds``: the causal thresholds fitted in the same walk
    thresholds: ThresholdReport | None = None


@dataclass(frozen=True)
class RouterRefit:
    """How :func:`fit_skip_paths` refits each router to its layer's skip error: on a
    sample of ``tokens`` calibration tokens, ``steps`` full-batch Adam steps (as the
    similarity warm start), seeded by ``seed``."""

    tokens: int = 2048
    steps: int = 100
    seed: int = 0


def install_skip_paths(model: nn.Module, rank: int | None) -> list[RoutedLayer]:
    """Give every routed layer below ratio 1 a zero :class:`SkipPath` (identity until
    fitted) unless it has one of that rank; returns those layers."""
    out = []
    for layer in (m for m in model.modules() if isinstance(m, RoutedLayer)):
        if layer.retention_ratio >= 1.0:
            continue
        current = layer._modules.get("skip_path")
        if not isinstance(current, SkipPath) or current.rank != rank:
            install_skip_path(layer, model.config.hidden_size, rank)
        out.append(layer)
    return out


@torch.no_grad()
def fit_skip_paths(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    rank: int | None = None,
    ridge: float | Literal["auto"] = "auto",
    refit_routers: RouterRefit | None = None,
    fit_thresholds: bool = False,
) -> SkipPathReport:
    """Fit (installing where missing) the skip path of every routed layer below ratio 1.

    :param rank: ``None`` full rank, else the rank of each map
    :param ridge: relative ridge penalty, or ``"auto"``: chosen per layer on two folds
        (:func:`~adadsf_modifier.fitting.ridge.choose_ridge`)
    :param refit_routers, fit_thresholds: see the module docstring;
        ``report.thresholds`` stays ``None`` when no routed layer is partial
    """
    targets = install_skip_paths(model, rank)
    report = SkipPathReport()
    if not targets:
        return report
    batches = list(batches)
    _, named = decoder_layers(model)
    last = max(i for i, (_, m) in enumerate(named) if m in targets)
    routed = routed_layers(model)
    if fit_thresholds and any(0.0 < m.retention_ratio < 1.0 for m in routed):
        report.thresholds = ThresholdReport(passes=1, tolerance=THRESHOLD_TOLERANCE)
        last = max(i for i, (_, m) in enumerate(named) if m in routed)
    device = model_device(model)
    walk = walk_layers(model, batches, last, desc="AdaDSF skip paths")
    for step in walk:
        if step.layer not in targets:
            if report.thresholds is not None and step.layer in routed:
                fit_layer_threshold(step, report.thresholds)
            continue
        # the walk needs no outputs of the last layer
        from_dense = step.index < last and kept_tokens_run_densely(step.layer)
        ys, skipped = _fit_layer(
            step, rank, ridge, device, report, refit_routers, from_dense,
            report.thresholds,
        )  # fmt: skip
        if from_dense:
            step.outputs = _routed_from_dense(step, ys, skipped)
    logger.info(
        f"AdaDSF skip paths (rank {rank or 'full'}, ridge {ridge}): R^2 "
        f"[{', '.join(f'{r:.2f}' for r in report.r2)}]"
        f", ridge [{', '.join(f'{r:g}' for r in report.ridge)}]"
        + (
            f", routers refit to the skip error (held-out rank correlation "
            f"[{', '.join(f'{c:.2f}' for c in report.router_rank_corr)}])"
            if refit_routers is not None
            else ""
        )
    )
    return report


def kept_tokens_run_densely(layer: nn.Module) -> bool:
    """Whether ``layer``'s routed output on a token it runs is its dense output (so
    when skipped tokens keep their keys/values): the walk then builds the next inputs
    from the dense run it needs anyway, instead of running the layer again."""
    return isinstance(layer, RoutedLayer) and bool(layer.skipped_tokens_kv)


def _fit_layer(
    step: LayerStep,
    rank: int | None,
    ridge: float | str,
    device: torch.device,
    report: SkipPathReport,
    refit: RouterRefit | None = None,
    want_skipped: bool = False,
    thresholds: ThresholdReport | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Fit the step's layer's skip path on its inputs (and with ``refit``, its
    router, then the map again; with ``thresholds``, the layer's causal threshold
    once its router is final, into that report); returns the dense layer's outputs
    and, per batch, the real tokens its final router skips (``None`` unless the fit
    needed them or ``want_skipped``)."""
    layer, xs, calls = step.layer, step.inputs, step.calls
    with routing_override([layer], retention_ratio=1.0):  # every token, no skip path
        dense_out = step.run()
    refits = refit is not None and layer.retention_ratio > 0.0
    if thresholds is not None and not refits:  # the router is final already
        fit_layer_threshold(step, thresholds)
    use_skipped = layer.retention_ratio > 0.0
    skipped = None
    if use_skipped or want_skipped:
        skipped = _skipped_tokens(layer, xs, calls)
    fit, on_all = _fit_map(
        layer, xs, calls, dense_out, rank, ridge, skipped if use_skipped else None,
        device,
    )  # fmt: skip
    if refits:
        x_s, err = _skip_error_sample(layer, xs, calls, dense_out, refit)
        target = skip_error_target(err)
        result = warm_start_router(
            layer.router, x_s, target, layer.layer_index, refit.steps, seed=refit.seed
        )
        distributed.broadcast_module(layer.router)  # the source rank's fit everywhere
        report.router_rank_corr.append(result.heldout_rank_corr)
        if thresholds is not None:
            fit_layer_threshold(step, thresholds)
        # the map again, on the tokens the new router skips, with the penalty chosen
        # above: choosing it is most of a fit's cost, and the two sets of skipped
        # tokens are of the same layer and mostly the same tokens
        skipped = _skipped_tokens(layer, xs, calls)
        fit, _ = _fit_map(
            layer, xs, calls, dense_out, rank, fit.ridge,
            skipped if use_skipped else None, device, fit if on_all else None,
        )  # fmt: skip
    report.layer_indices.append(layer.layer_index)
    report.tokens.append(fit.tokens)
    report.r2.append(fit.r2 if math.isfinite(fit.r2) else float("nan"))
    report.ridge.append(fit.ridge)
    return dense_out, skipped


def _skipped_tokens(
    layer: RoutedLayer, xs: list[torch.Tensor], calls: list[tuple]
) -> list[torch.Tensor]:
    """Per batch, ``[batch, seq]``: the real tokens ``layer``'s router skips (in the
    layer's current routing mode; scored inside a layer call: see
    :func:`~adadsf_modifier.fitting.layer_walk.router_scores`)."""
    out = []
    for x, call in zip(xs, calls):
        mask, real = real_tokens_of(x, call)
        scores = router_scores(layer, x, call)
        out.append(real & ~layer.selected_mask(x, mask, scores=scores))
    return out


def _routed_from_dense(
    step: LayerStep, dense_out: list[torch.Tensor], skipped: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The routed layer's outputs, made from its dense ones (for a layer whose kept
    tokens run densely, :func:`kept_tokens_run_densely`): ``x + u(x)`` on the skipped
    tokens, the dense output elsewhere (padding leaves both layers unchanged)."""
    skip_map = step.layer.skip_path
    return [
        torch.where(s.unsqueeze(-1), x + skip_map(x), y)
        for x, y, s in zip(step.inputs, dense_out, skipped)
    ]


def _fit_map(
    layer: RoutedLayer,
    xs: list[torch.Tensor],
    calls: list[tuple],
    ys: list[torch.Tensor],
    rank: int | None,
    ridge: float | str,
    skipped: list[torch.Tensor] | None,
    device: torch.device,
    fitted_on_all: RidgeFit | None = None,
) -> tuple[RidgeFit, bool]:
    """Fit and load ``layer``'s map from inputs ``xs`` and dense outputs ``ys``, on
    the real tokens its router skips (``skipped``, per batch) or, ``None``, on all
    of them; returns the fit and whether it is on all real tokens.

    ``fitted_on_all``: the map already loaded was fitted on all real tokens of these
    inputs and outputs, with the penalty ``ridge``. A fit that falls on all real
    tokens again would be that same fit, so it is returned as it is: the refit after
    a router refit costs nothing where too few tokens skip (a wide model on a small
    calibration set)."""
    hidden = xs[0].shape[-1]
    if skipped is not None:
        # summed over the ranks: every rank makes the same choice
        count = sum(int(s.sum()) for s in skipped)
        (n_skipped,) = distributed.sum_across_ranks([count])
        if n_skipped < hidden:
            logger.warning(
                f"AdaDSF skip path of layer {layer.layer_index}: its router skipped "
                f"{n_skipped} calibration tokens, fewer than the hidden size "
                f"{hidden}; fitting on all real tokens instead"
            )
            skipped = None
    if skipped is None and fitted_on_all is not None:
        return fitted_on_all, True
    fit = fit_ridge_on_folds(_fold_stats(xs, calls, ys, device, skipped), rank, ridge)
    load_fit(layer.skip_path, fit)
    return fit, skipped is None


def _fold_stats(
    xs: list[torch.Tensor],
    calls: list[tuple],
    ys: list[torch.Tensor],
    device: torch.device,
    skipped: list[torch.Tensor] | None = None,
) -> tuple[RidgeStats, RidgeStats]:
    """The two folds' regression statistics of the update ``y - x`` on ``x`` over the
    real tokens (with ``skipped``: those of them, per batch), summed over the ranks."""
    hidden = xs[0].shape[-1]
    folds = (RidgeStats(hidden, device), RidgeStats(hidden, device))
    rows_seen = 0
    for i, (x, call, y) in enumerate(zip(xs, calls, ys)):
        _, real = real_tokens_of(x, call)
        keep = real if skipped is None else skipped[i]
        for fold, part in enumerate(ridge_folds(real, rows_seen)):
            folds[fold].add(x[part & keep], (y - x)[part & keep])
        rows_seen += x.shape[0]
    for one in folds:
        one.all_reduce()
    return folds


def _skip_error_sample(
    layer: RoutedLayer,
    xs: list[torch.Tensor],
    calls: list[tuple],
    ys: list[torch.Tensor],
    refit: RouterRefit,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [N, h], relative skip error [N])`` of a seeded sample of the real
    tokens that are free to skip (not forced to run), gathered over the ranks."""
    x_parts, err_parts = [], []
    for x, call, y in zip(xs, calls, ys):
        _, real = real_tokens_of(x, call)
        forced = layer.forced_tokens(real)
        free = real if forced is None else real & ~forced
        xf = x[free]
        skipped = (xf + layer.skip_path(xf)).float()
        err = (y[free].float() - skipped).norm(dim=-1)
        err_parts.append(err / xf.float().norm(dim=-1).clamp(min=1e-6))
        x_parts.append(xf)
    x_all, err_all = torch.cat(x_parts), torch.cat(err_parts)
    share = -(-refit.tokens // distributed.world_size())  # each rank's part
    g = torch.Generator().manual_seed(
        refit.seed + layer.layer_index + 7919 * distributed.rank()
    )
    pick = torch.randperm(x_all.shape[0], generator=g)[:share].to(x_all.device)
    x_s = distributed.all_gather_variable(x_all[pick])
    err_s = distributed.all_gather_variable(err_all[pick])
    if x_s.shape[0] == 0:
        raise ValueError(
            f"no calibration token is free to skip decoder layer {layer.layer_index}: "
            "the router cannot be refit to the skip error"
        )
    return x_s, err_s


@torch.no_grad()
def load_fit(skip: SkipPath, fit: RidgeFit) -> None:
    """Copy a :class:`RidgeFit` of the same shape into the layer's skip path."""
    if fit.rank != skip.rank or fit.bias.shape[0] != skip.hidden_size:
        raise ValueError(
            f"a rank-{fit.rank} fit of width {fit.bias.shape[0]} does not fit a "
            f"rank-{skip.rank} skip path of width {skip.hidden_size}"
        )
    skip.bias.copy_(fit.bias)
    if skip.rank is None:
        skip.weight.copy_(fit.weight)
    else:
        skip.down.copy_(fit.down)
        skip.up.copy_(fit.up)
