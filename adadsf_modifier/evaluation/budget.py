"""Does a routed model keep the share of tokens it was built to keep, on this text?

Causal thresholds are fitted on the calibration text; on text unlike it the routed
layers run more (or fewer) tokens than their ratios plan, and the compute budget
drifts. ``adadsf eval`` and ``bench`` report the kept share (from the FLOPs count they
take anyway) beside its target and warn past :data:`DRIFT_WARNING`.
"""

from __future__ import annotations

from loguru import logger
from torch import nn

from adadsf_modifier.flops import FlopsReport
from adadsf_modifier.routing import routed_layers

__all__ = ["DRIFT_WARNING", "KeptShare"]

# calibration rows themselves vary by about a point between held-out samples
DRIFT_WARNING = 0.03


class KeptShare:
    """Over FLOPs reports of ``model`` (a prefill's rows, or a decoding's steps): the
    share of real tokens that ran its routed layers (:attr:`fraction`, ``None`` without
    routed layers), and that share at the layers' retention ratios (:attr:`target`)."""

    def __init__(self, model: nn.Module) -> None:
        self.ratios = {
            m.layer_index: float(m.retention_ratio) for m in routed_layers(model)
        }
        self.kept = 0
        self.offered = 0
        self.planned = 0.0

    def add(self, report: FlopsReport) -> None:
        tokens = sum(report.seq_lens)
        for layer, ratio in self.ratios.items():
            self.kept += sum(report.kept[layer])
            self.offered += tokens
            self.planned += ratio * tokens

    @property
    def fraction(self) -> float | None:
        return self.kept / self.offered if self.offered else None

    @property
    def target(self) -> float | None:
        return self.planned / self.offered if self.offered else None

    def warn(self, where: str) -> bool:
        """Warn when the kept share parts from its target; returns whether it did."""
        kept, target = self.fraction, self.target
        if kept is None or target is None or abs(kept - target) <= DRIFT_WARNING:
            return False
        more = "more" if kept > target else "fewer"
        logger.warning(
            f"{where}: the routed layers ran {kept:.3f} of their tokens, {more} than "
            f"the {target:.3f} their retention ratios plan: on this text the routing "
            "does not hold its budget, so its compute (and speed) is not the budget's. "
            "Causal thresholds are fitted on the calibration text: `adadsf calibrate "
            "--routed CKPT --text YOUR_TEXT --output-dir OUT` refits them on text like "
            "yours"
        )
        return True
