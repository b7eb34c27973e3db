"""Calibrate the per-layer thresholds of causal routing on calibration data.

Causal routing keeps a token at layer ``i`` iff its router score exceeds ``theta_i``
(the first real token of a row runs regardless: the attention sink). ``theta_i`` is set
so that the kept fraction of real calibration tokens, forced tokens included, is
``r_i``: forced tokens are left out of the quantile, and the remaining ones get the
ratio that makes up the difference. Calibration rows too short for that (every token of
a 1-token row is forced) are refused before any forward pass.

Scores at layer ``i`` depend on how the layers before it routed, so the first pass runs
top-k routing (the training-time behaviour) and each further pass re-fits every
threshold under causal routing upstream. Fitting stops when every layer's measured
kept fraction is within ``tolerance`` of its target (or as close as tied scores allow);
that is reached after at most one pass per routed layer (layer ``j``'s inputs stop
moving once the ``j`` layers above it have settled), else
:class:`ThresholdCalibrationError` is raised. Cuts between tied scores go to the
closest reachable count instead of dropping every tied token.

Under ``torchrun`` each rank scores its own partition; after every pass the ranks'
scores are gathered and their counts summed (an exact merge: every rank fits the
thresholds on all ranks' scores), so thresholds, measurements and the decision to run
another pass are identical on every rank and equal to one process over the union of
the data.
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
from adadsf_modifier.layer_capture import LayerCall, capture_layers
from adadsf_modifier.routing.modes import routing_override
from adadsf_modifier.routing.routed_layer import RoutedLayer, routed_layers
from adadsf_modifier.routing.selection import threshold_beside_forced
from adadsf_modifier.utils import run_calibration_batches

__all__ = [
    "ThresholdCalibrationError",
    "ThresholdReport",
    "calibrate_thresholds",
    "check_calibration_rows",
]


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
    passes: int = 0  # calibration forwards run, the measuring one included
    #: |kept - target| allowed beyond what the scores' granularity forces
    tolerance: float = 0.0


def check_calibration_rows(
    ratios: Iterable[float],
    batches: Iterable[Mapping[str, Any]],
    tolerance: float = 0.02,
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


class _ScoreRecorder:
    """Fed each routed layer's inputs (:meth:`record`): its non-forced real-token
    scores and token counts, and (``measure``) its causal kept count and agreement
    with top-k."""

    def __init__(self, layers: list[RoutedLayer], measure: bool):
        self.layers = layers
        self.measure = measure
        self.scores: dict[int, list[torch.Tensor]] = {id(m): [] for m in layers}
        # per layer: [agree, kept, real tokens, forced tokens]
        self.counts: dict[int, list[int]] = {id(m): [0, 0, 0, 0] for m in layers}

    def record(self, call: LayerCall) -> None:
        module, x, mask = call.module, call.hidden_states, call.attention_mask
        real = call.real_tokens()
        forced = module.forced_tokens(real)
        free = real if forced is None else real & ~forced
        scores = module.router(x).float()
        self.scores[id(module)].append(scores[free].cpu())
        counts = self.counts[id(module)]
        counts[2] += int(real.sum())
        counts[3] += 0 if forced is None else int(forced.sum())
        if self.measure and 0.0 < module.retention_ratio < 1.0:
            topk = module.selected_mask(x, mask, mode="topk", scores=scores)
            causal = module.selected_mask(x, mask, mode="causal", scores=scores)
            counts[0] += int(((causal == topk) & real).sum())
            counts[1] += int(causal.sum())

    def all_reduce(self) -> None:
        """Under ``torchrun``: every rank's scores gathered, counts summed."""
        if not distributed.is_distributed():
            return
        for key, scores in self.scores.items():
            local = torch.cat(scores) if scores else torch.zeros(0)
            self.scores[key] = [distributed.all_gather_variable(local)]
            self.counts[key] = distributed.sum_across_ranks(self.counts[key])

    def fit(self, layer: RoutedLayer) -> tuple[float, float]:
        """``(threshold, kept fraction)``: the threshold at which ``layer`` keeps the
        closest fraction to ``r`` of the real tokens seen (ties and the forced tokens
        can make ``r`` itself unreachable), and that fraction."""
        _, _, total, forced = self.counts[id(layer)]
        ratio = float(layer.retention_ratio)
        return threshold_beside_forced(
            torch.cat(self.scores[id(layer)]), total, forced, ratio
        )


def calibrate_thresholds(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    passes: int = 2,
    tolerance: float = 0.02,
) -> ThresholdReport:
    """Set ``causal_threshold`` on every routed layer of ``model``; returns what was
    measured.

    ``passes`` >= 1: fitting passes before the first measurement (pass 1 under top-k
    routing, the rest under causal routing). Each measuring pass also re-fits, and more
    follow (at most one per routed layer) until every layer's kept fraction of real
    calibration tokens is within ``tolerance`` of its retention ratio, or as close as
    its scores allow (a threshold moves whole tokens, and tied scores together; see
    :attr:`ThresholdReport.reachable`). Raises :class:`ThresholdCalibrationError`
    before any forward when the rows are too short to reach a target
    (:func:`check_calibration_rows`), and after the last pass if a layer still misses.
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
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
    base = getattr(model, "base_model", model)
    limit = passes + len(layers)
    for p in range(limit + 1):
        mode = "topk" if p == 0 else "causal"
        recorder = _ScoreRecorder(layers, measure=p >= passes)
        with (
            capture_layers(layers, recorder.record, at="input"),
            routing_override(model, mode=mode),
        ):
            run_calibration_batches(base, batches, desc=f"AdaDSF thresholds ({mode})")
        recorder.all_reduce()
        fits = [recorder.fit(layer) for layer in layers]
        if p >= passes:
            report = _report(layers, recorder, p + 1, tolerance, fits)
            if not _missed(report) or p == limit:
                break
        for layer, (threshold, _) in zip(layers, fits):
            layer.causal_threshold = threshold
    logger.info(
        f"AdaDSF causal thresholds ({report.passes} passes): kept fraction "
        f"[{', '.join(f'{k:.3f}' for k in report.kept_fraction)}] (targets "
        f"[{', '.join(f'{r:.3f}' for r in report.target_ratios)}]); top-k agreement "
        f"[{', '.join(f'{a:.3f}' for a in report.topk_agreement)}]"
    )
    missed = _missed(report)
    if missed:
        raise ThresholdCalibrationError(
            f"causal thresholds miss their targets by more than {report.tolerance:.3f} "
            f"(and more than the scores allow) after {report.passes} passes on layers "
            + ", ".join(
                f"{report.layer_indices[i]} (kept {report.kept_fraction[i]:.3f}, "
                f"target {report.target_ratios[i]:.3f})"
                for i in missed
            )
            + ": the thresholds did not settle on this calibration set"
        )
    return report


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


def _report(layers, recorder: _ScoreRecorder, passes: int, tolerance: float, fits):
    report = ThresholdReport(num_tokens=recorder.counts[id(layers[0])][2])
    report.passes = passes
    report.tolerance = tolerance
    for layer, (_, reachable) in zip(layers, fits):
        report.reachable.append(reachable)
        agree, kept, total, _ = recorder.counts[id(layer)]
        report.layer_indices.append(layer.layer_index)
        report.thresholds.append(float(layer.causal_threshold))
        report.target_ratios.append(float(layer.retention_ratio))
        if 0.0 < layer.retention_ratio < 1.0 and total:
            report.kept_fraction.append(kept / total)
            report.topk_agreement.append(agree / total)
        else:
            report.kept_fraction.append(float(layer.retention_ratio))
            report.topk_agreement.append(1.0)
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
