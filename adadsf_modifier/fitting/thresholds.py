"""Calibrate the per-layer thresholds of causal routing on calibration data.

Causal routing keeps a token at layer ``i`` iff its router score exceeds ``theta_i``
(a row's first real token always runs: the attention sink). ``theta_i`` makes the kept
fraction of real calibration tokens, forced ones included, equal ``r_i``: forced tokens
are left out of the quantile and the rest get the ratio that makes up the difference.
Rows too short for that are refused before any forward pass.

Scores at layer ``i`` depend on how the layers below route, so thresholds are fitted
bottom up in one walk (:mod:`~adadsf_modifier.fitting.layer_walk`) on the inputs the
layers below give under their final thresholds: each kept fraction is then what the
finished model measures on the same data, with no repeated pass. Cuts between tied
scores go to the closest reachable count; a miss beyond ``tolerance`` raises
:class:`ThresholdCalibrationError`. Under ``torchrun`` the ranks' scores are gathered
per layer (an exact merge), so every rank gets the thresholds of the union of the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.constraints import InputError
from adadsf_modifier.fitting.layer_walk import (
    LayerStep,
    real_tokens_of,
    router_scores,
    walk_layers,
)
from adadsf_modifier.routing.architectures import decoder_layers
from adadsf_modifier.routing.modes import routing_override
from adadsf_modifier.routing.routed_layer import RoutedLayer, routed_layers
from adadsf_modifier.routing.selection import threshold_beside_forced

__all__ = [
    "THRESHOLD_TOLERANCE",
    "ThresholdCalibrationError",
    "ThresholdReport",
    "calibrate_thresholds",
    "check_calibration_rows",
    "check_thresholds",
    "fit_layer_threshold",
]


#: How far a layer's kept fraction on the calibration data may miss its ratio beyond
#: what its tied scores force (a threshold moves whole tokens).
THRESHOLD_TOLERANCE = 0.02


class ThresholdCalibrationError(InputError):
    """Causal thresholds cannot reproduce the layers' retention ratios on this data."""


@dataclass
class ThresholdReport:
    """Per routed layer (in layer order): thresholds, kept fraction and top-k
    agreement."""

    layer_indices: list[int] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    target_ratios: list[float] = field(default_factory=list)
    kept_fraction: list[float] = field(default_factory=list)
    topk_agreement: list[float] = field(default_factory=list)
    #: the kept fraction closest to the target that a threshold could reach on the
    #: last pass's scores (one token is the granularity, tied scores coarsen it)
    reachable: list[float] = field(default_factory=list)
    num_tokens: int = 0
    passes: int = 0  # walks of the decoder stack run (one; none for whole layers)
    #: |kept - target| allowed beyond what the scores' granularity forces
    tolerance: float = 0.0


def check_calibration_rows(
    ratios: Iterable[float],
    batches: Iterable[Mapping[str, Any]],
    tolerance: float = THRESHOLD_TOLERANCE,
    keep_first_token: bool = True,
) -> None:
    """Refuse calibration data whose forced tokens alone exceed a routed layer's target.

    The first real token of every row runs every layer (``keep_first_token``), so
    ``R`` rows of ``N`` real tokens keep at least ``R / N`` of them whatever the
    thresholds. Reads only the batches' ``attention_mask`` (or ``input_ids`` shape): no
    forward pass. Raises :class:`ThresholdCalibrationError` naming the minimum mean row
    length, ``1 / r``, for the smallest ratio ``r`` in ``(0, 1)``. Under ``torchrun``
    the rows and tokens of every rank count (and every rank raises).
    """
    if not keep_first_token:
        return
    targets = [float(r) for r in ratios if 0.0 < float(r) < 1.0]
    if not targets:
        return
    rows = tokens = 0
    for batch in batches:
        mask = batch.get("attention_mask")
        if mask is None:
            ids = torch.as_tensor(batch["input_ids"])
            ids = ids if ids.dim() == 2 else ids.view(1, -1)
            rows, tokens = rows + ids.shape[0], tokens + ids.numel()
        else:
            real = torch.as_tensor(mask).bool()
            real = real if real.dim() == 2 else real.view(1, -1)
            lengths = real.sum(1)
            rows, tokens = rows + int((lengths > 0).sum()), tokens + int(lengths.sum())
    rows, tokens = distributed.sum_across_ranks([rows, tokens])
    if tokens == 0:
        raise ThresholdCalibrationError(
            "threshold calibration saw no real tokens: the calibration set is empty or "
            "all padding"
        )
    floor, lowest = rows / tokens, min(targets)
    if floor > lowest + tolerance:
        raise ThresholdCalibrationError(
            f"causal thresholds cannot reach a retention ratio of {lowest:.3f}: the "
            f"first real token of each row always runs, so these {rows} calibration "
            f"rows of {tokens} real tokens ({tokens / rows:.1f} per row) keep at least "
            f"{floor:.3f} of them at every layer. Use calibration rows of at least "
            f"{math.ceil(1 / lowest)} real tokens on average (1 / {lowest:.3f})"
        )


@torch.no_grad()
def calibrate_thresholds(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    tolerance: float = THRESHOLD_TOLERANCE,
) -> ThresholdReport:
    """Set ``causal_threshold`` on every routed layer of ``model`` in one bottom-up
    walk of the decoder stack (see the module docstring); returns what was measured.

    Raises :class:`ThresholdCalibrationError` before any forward when the rows are too
    short to reach a target (:func:`check_calibration_rows`), and after the walk if a
    layer's kept fraction misses its retention ratio by more than ``tolerance`` and by
    more than its scores allow (a threshold moves whole tokens, and tied scores
    together; see :attr:`ThresholdReport.reachable`).
    """
    layers = routed_layers(model)
    if not layers:
        raise ValueError("the model has no routed layers")
    batches = list(batches)
    if not batches:
        raise ValueError("threshold calibration needs at least one calibration batch")
    check_calibration_rows(
        [m.retention_ratio for m in layers if m.keep_first_token], batches, tolerance
    )
    if all(not 0.0 < m.retention_ratio < 1.0 for m in layers):
        return _whole_layers_only(layers, tolerance)
    _, named = decoder_layers(model)
    routed = {id(m) for m in layers}
    last = max(i for i, (_, m) in enumerate(named) if id(m) in routed)
    report = ThresholdReport(passes=1, tolerance=tolerance)
    for step in walk_layers(model, batches, last, desc="AdaDSF thresholds"):
        if id(step.layer) not in routed:
            continue
        fit_layer_threshold(step, report)
        if step.index < last:
            with routing_override([step.layer], mode="causal"):
                step.outputs = step.run()
    return check_thresholds(report)


def check_thresholds(report: ThresholdReport) -> ThresholdReport:
    """Log a finished walk's thresholds (``report``, filled by
    :func:`fit_layer_threshold` for every routed layer) and return it; raises
    :class:`ThresholdCalibrationError` if a layer's kept fraction misses its target by
    more than the report's tolerance and more than its scores allow."""
    logger.info(
        f"AdaDSF causal thresholds (one layer walk): kept fraction "
        f"[{', '.join(f'{k:.3f}' for k in report.kept_fraction)}] (targets "
        f"[{', '.join(f'{r:.3f}' for r in report.target_ratios)}]); top-k agreement "
        f"[{', '.join(f'{a:.3f}' for a in report.topk_agreement)}]"
    )
    missed = _missed(report)
    if missed:
        raise ThresholdCalibrationError(
            f"causal thresholds miss their targets by more than {report.tolerance:.3f} "
            "(and more than the scores allow) on layers "
            + ", ".join(
                f"{report.layer_indices[i]} (kept {report.kept_fraction[i]:.3f}, "
                f"target {report.target_ratios[i]:.3f})"
                for i in missed
            )
            + ": too many tied router scores on this calibration set"
        )
    return report


def fit_layer_threshold(step: LayerStep, report: ThresholdReport) -> None:
    """Fit the step's layer's threshold on its inputs (every rank's), set it, and add
    the layer's kept fraction and agreement with top-k under it to ``report``.

    The inputs must be final: those a forward of the finished model gives the layer
    (a walk in which every layer below runs under its fitted threshold), and the
    router must not change afterwards."""
    layer = step.layer
    ratio = float(layer.retention_ratio)
    scored, free_scores = [], []
    total = forced_count = 0
    for x, call in zip(step.inputs, step.calls):
        mask, real = real_tokens_of(x, call)
        forced = layer.forced_tokens(real)
        free = real if forced is None else real & ~forced
        scores = router_scores(layer, x, call).float()
        scored.append((x, mask, real, scores))
        free_scores.append(scores[free].cpu())
        total += int(real.sum())
        forced_count += 0 if forced is None else int(forced.sum())
    total, forced_count = distributed.sum_across_ranks([total, forced_count])
    threshold, reachable = threshold_beside_forced(
        distributed.all_gather_variable(torch.cat(free_scores)),
        total,
        forced_count,
        ratio,
    )
    layer.causal_threshold = threshold
    kept_fraction, agreement = ratio, 1.0
    if 0.0 < ratio < 1.0 and total:
        agree = kept = 0
        for x, mask, real, scores in scored:
            topk = layer.selected_mask(x, mask, mode="topk", scores=scores)
            causal = layer.selected_mask(x, mask, mode="causal", scores=scores)
            agree += int(((causal == topk) & real).sum())
            kept += int(causal.sum())
        agree, kept = distributed.sum_across_ranks([agree, kept])
        kept_fraction, agreement = kept / total, agree / total
    if not report.layer_indices:
        report.num_tokens = total
    report.layer_indices.append(layer.layer_index)
    report.thresholds.append(float(threshold))
    report.target_ratios.append(ratio)
    report.kept_fraction.append(kept_fraction)
    report.topk_agreement.append(agreement)
    report.reachable.append(reachable)


def _whole_layers_only(layers: list[RoutedLayer], tolerance: float) -> ThresholdReport:
    """Every routed layer runs all tokens or none (``layer_drop``): no threshold has
    anything to choose, so no calibration pass is run (the passes would fit exactly
    these values: ``-inf`` keeps every token, ``inf`` none)."""
    report = ThresholdReport(tolerance=tolerance)
    for layer in layers:
        ratio = float(layer.retention_ratio)
        layer.causal_threshold = float("-inf") if ratio >= 1.0 else float("inf")
        report.layer_indices.append(layer.layer_index)
        report.thresholds.append(layer.causal_threshold)
        report.target_ratios.append(ratio)
        report.kept_fraction.append(ratio)
        report.reachable.append(ratio)
        report.topk_agreement.append(1.0)
    logger.info("AdaDSF causal thresholds: whole layers only, no calibration pass")
    return report


def _missed(report: ThresholdReport) -> list[int]:
    """Layers whose kept fraction misses the target by more than ``tolerance`` and by
    more than the closest reachable fraction does."""
    return [
        i
        for i, (kept, target, best) in enumerate(
            zip(report.kept_fraction, report.target_ratios, report.reachable)
        )
        if abs(kept - target) > max(report.tolerance, abs(best - target)) + 1e-9
    ]
