"""Calibrate the per-layer thresholds of causal routing on calibration data.

Causal routing keeps a token at layer ``i`` iff its router score exceeds ``theta_i``. We
pick ``theta_i`` as the ``(1 - r_i)`` quantile of the scores real calibration tokens
produce at that layer, so the expected kept fraction is ``r_i``. Scores at layer ``i``
depend on how the layers before it routed, so the first pass runs top-k routing (the
training-time behaviour) and each further pass re-estimates every threshold under causal
routing upstream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn

from adadsf_modifier.routing.modes import routing_mode
from adadsf_modifier.routing.routed_layer import RoutedLayer
from adadsf_modifier.utils import real_token_mask, run_calibration_batches

__all__ = ["ThresholdReport", "calibrate_thresholds", "threshold_for_ratio"]


@dataclass
class ThresholdReport:
    """Per routed layer (in layer order): thresholds, kept fraction and top-k
    agreement."""

    layer_indices: list[int] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    target_ratios: list[float] = field(default_factory=list)
    kept_fraction: list[float] = field(default_factory=list)
    topk_agreement: list[float] = field(default_factory=list)
    num_tokens: int = 0


def threshold_for_ratio(scores: torch.Tensor, ratio: float) -> float:
    """A threshold with ``mean(scores > t) ~= ratio`` (midway between neighbouring
    scores)."""
    if ratio >= 1.0:
        return float("-inf")
    if ratio <= 0.0 or scores.numel() == 0:
        return float("inf")
    s = scores.flatten().double().sort(descending=True).values
    n_keep = int(round(ratio * s.numel()))
    if n_keep <= 0:
        return float(s[0]) + 1.0
    if n_keep >= s.numel():
        return float(s[-1]) - 1.0
    return float(0.5 * (s[n_keep - 1] + s[n_keep]))


class _ScoreRecorder:
    def __init__(self, layers: list[RoutedLayer], measure: bool):
        self.layers = layers
        self.measure = measure  # agreement with top-k: only the final pass reports it
        self.scores: dict[int, list[torch.Tensor]] = {id(l): [] for l in layers}
        self.agree: dict[int, list[int]] = {
            id(l): [0, 0, 0] for l in layers
        }  # agree, kept, total
        self.handles = [
            l.register_forward_pre_hook(self._hook, with_kwargs=True) for l in layers
        ]

    def _hook(self, module: RoutedLayer, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        batch, seq_len = x.shape[:2]
        real = real_token_mask(kwargs.get("attention_mask"), batch, seq_len, x.device)
        scores = module.router(x).float()
        self.scores[id(module)].append(scores[real].cpu())
        thr = module.causal_threshold
        if not self.measure:
            return
        stats = self.agree[id(module)]
        stats[2] += int(real.sum())
        if thr is not None and 0.0 < module.retention_ratio < 1.0:
            mask = kwargs.get("attention_mask")
            topk = module.selected_mask(x, mask, mode="topk", scores=scores)
            causal = module.selected_mask(x, mask, mode="causal", scores=scores)
            stats[0] += int(((causal == topk) & real).sum())
            stats[1] += int(causal.sum())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def calibrate_thresholds(
    model: nn.Module, batches: Iterable[Mapping[str, Any]], passes: int = 2
) -> ThresholdReport:
    """Set ``causal_threshold`` on every routed layer of ``model``; returns what was
    measured.

    ``passes`` >= 1: pass 1 under top-k routing, then ``passes - 1`` refinements under
    causal routing. A final measuring pass reports the kept fraction and how often the
    causal decision agrees with top-k membership on the same inputs.
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    layers = [m for m in model.modules() if isinstance(m, RoutedLayer)]
    if not layers:
        raise ValueError("the model has no routed layers")
    batches = list(batches)
    if not batches:
        raise ValueError("threshold calibration needs at least one calibration batch")
    base = getattr(model, "base_model", model)
    for p in range(passes + 1):
        mode = "topk" if p == 0 else "causal"
        recorder = _ScoreRecorder(layers, measure=p == passes)
        try:
            with routing_mode(model, mode):
                run_calibration_batches(
                    base, batches, desc=f"AdaDSF thresholds ({mode})"
                )
        finally:
            recorder.remove()
        if p == passes:
            break
        for layer in layers:
            scores = torch.cat(recorder.scores[id(layer)])
            layer.causal_threshold = threshold_for_ratio(scores, layer.retention_ratio)

    report = ThresholdReport(num_tokens=recorder.agree[id(layers[0])][2])
    for layer in layers:
        agree, kept, total = recorder.agree[id(layer)]
        report.layer_indices.append(layer.layer_index)
        report.thresholds.append(float(layer.causal_threshold))
        report.target_ratios.append(float(layer.retention_ratio))
        if 0.0 < layer.retention_ratio < 1.0 and total:
            report.kept_fraction.append(kept / total)
            report.topk_agreement.append(agree / total)
        else:
            report.kept_fraction.append(float(layer.retention_ratio))
            report.topk_agreement.append(1.0)
    logger.info(
        "AdaDSF causal thresholds: kept fraction "
        f"[{', '.join(f'{k:.3f}' for k in report.kept_fraction)}] (targets "
        f"[{', '.join(f'{r:.3f}' for r in report.target_ratios)}]); top-k agreement "
        f"[{', '.join(f'{a:.3f}' for a in report.topk_agreement)}]"
    )
    return report
