"""Does a routed model keep the share of tokens it was built to keep, on this text?

Causal routing decides each token against thresholds fitted on the calibration set, so
on text unlike it the routed layers can run more (or fewer) tokens than their retention
ratios, and the compute budget the user asked for drifts. ``adadsf eval`` and ``adadsf
bench`` measure the kept share anyway (the FLOPs count observes every routed layer), so
they report it beside the target and warn when the two part by more than
:data:`DRIFT_WARNING`.

The kept share is the mean over routed layers of the fraction of real tokens that ran
the layer, and the target is the mean of those layers' retention ratios (what the
``retention`` budget allocates): for layers of one shape, the routed FLOPs move in
proportion to it.
"""

from __future__ import annotations

from loguru import logger
from torch import nn

from adadsf_modifier.flops import FlopsReport
from adadsf_modifier.routing import routed_layers

__all__ = ["DRIFT_WARNING", "KeptShare"]

#: How far the kept share may part from the target before a warning (a few points:
#: calibration rows themselves vary by about a point between held-out samples).
DRIFT_WARNING = 0.03


class KeptShare:
    """Over FLOPs reports of ``model`` (a prefill's rows, or every step of a
    decoding): the tokens that ran its routed layers against the real tokens that
    reached them (:attr:`fraction`), and the same share at the layers' retention
    ratios (:attr:`target`)."""

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
        """``None`` without routed layers."""
        return self.kept / self.offered if self.offered else None

    @property
    def target(self) -> float | None:
        return self.planned / self.offered if self.offered else None

    def warn(self, where: str) -> bool:
        """Log a warning when the kept share parts from its target by more than
        :data:`DRIFT_WARNING`; returns whether it did."""
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
            "yours, and routing mode 'rank' (set_routing_mode(model, 'rank')) ranks "
            "each token against its own row's earlier scores instead"
        )
        return True
