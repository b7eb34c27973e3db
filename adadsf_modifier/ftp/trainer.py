"""Train FTP's shared router MLP with the LLM frozen.

Which tokens run while training (``FTPTrainConfig.routing``):

- ``threshold`` (FTP's rule): *causal* mode with every threshold at 0, so the gate is
  the hard rule ``s > 0`` and the sparsity loss pulls each layer's hard kept fraction to
  its scheduled ratio. Inference does not use that gate: the final thresholds are
  re-fitted afterwards by :func:`adadsf_modifier.fitting.calibrate_thresholds`, which
  makes the ratios exact. The sparsity loss does not hold the hard gate at the ratios
  (on SmolLM2 it drifts away from them while training), so under this rule the router
  is trained on decisions inference never makes.
- ``quantile`` (inference's rule, as AdaDSF's ``align_routing: quantile``): each layer's
  threshold is fitted on the batch itself, so every layer runs its ratio of the tokens
  while the router learns which; the sparsity loss then only centres the gate at 0.

Either way the routed layer's straight-through gate (``RoutedLayer``'s ``gated``)
passes the distillation gradient to the kept tokens' scores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.ftp.losses import (
    distillation_loss,
    guide_loss,
    guide_weight_at,
    sparsity_loss,
)
from adadsf_modifier.ftp.router import FTPLayerRouter
from adadsf_modifier.routing import RoutedLayer, routed_layers, routing_override
from adadsf_modifier.utils import model_device, tensors_to_device

__all__ = [
    "TRAIN_ROUTINGS",
    "TrainRouting",
    "FTPTrainConfig",
    "FTPTrainReport",
    "train_router",
    "dense_forward",
]

TrainRouting = Literal["threshold", "quantile"]
"""Which tokens run while the router trains (the module docstring)."""
TRAIN_ROUTINGS: tuple[str, ...] = get_args(TrainRouting)


@dataclass
class FTPTrainConfig:
    steps: int = 50
    lr: float = 1e-3
    distill_weight: float = 1.0
    sparsity_weight: float = 1.0
    guide_weight: float = 1.0
    guide_steps: int = 10
    keep_last: int = 4
    routing: TrainRouting = "threshold"

    def __post_init__(self) -> None:
        if self.routing not in TRAIN_ROUTINGS:
            raise ValueError(
                f"FTP train routing must be one of {TRAIN_ROUTINGS}, got "
                f"{self.routing!r}"
            )


@dataclass
class FTPTrainReport:
    """Per-step losses (total, distillation, sparsity, guide), wall time, and the
    real (unpadded) tokens the router trained on, summed over steps."""

    total: list[float] = field(default_factory=list)
    distill: list[float] = field(default_factory=list)
    sparsity: list[float] = field(default_factory=list)
    guide: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0


def ftp_layers(model: nn.Module) -> list[RoutedLayer]:
    return [m for m in routed_layers(model) if isinstance(m.router, FTPLayerRouter)]


@contextmanager
def dense_forward(model: nn.Module) -> Iterator[None]:
    """Every routed layer runs every token (the dense model, without a copy)."""
    with routing_override(routed_layers(model), retention_ratio=1.0):
        yield


@contextmanager
def _training_state(
    model: nn.Module, layers: list[RoutedLayer], mlp: nn.Module, routing: str
):
    """Only the router MLP trains; the tokens that run chosen by ``routing`` (hard
    gates at threshold 0, or each layer's ratio of the batch); everything restored."""
    grads = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.routing_mode, m.causal_threshold) for m in layers]
    was_training = model.training
    try:
        for p, _ in grads:
            p.requires_grad_(False)
        for p in mlp.parameters():
            p.requires_grad_(True)
        for m in layers:
            if routing == "quantile":
                m.routing_mode = "quantile"
            else:
                m.routing_mode, m.causal_threshold = "causal", 0.0
        model.eval()  # no dropout: the dense target and the routed pass must agree
        yield
    finally:
        for p, g in grads:
            p.requires_grad_(g)
        for m, mode, thr in modes:
            m.routing_mode, m.causal_threshold = mode, thr
        for r in (m.router for m in layers):
            r.collect = None
        model.train(was_training)


def train_router(
    model: nn.Module, batches: Sequence[dict], config: FTPTrainConfig
) -> FTPTrainReport:
    """``config.steps`` Adam steps on the shared router MLP, cycling over
    ``batches``."""
    layers = ftp_layers(model)
    if not layers:
        raise ValueError("the model has no FTP-routed layers")
    if not batches:
        raise ValueError("FTP router training needs at least one batch")
    routers = [m.router for m in layers]
    mlp = routers[0].shared_mlp
    report = FTPTrainReport()
    if config.steps == 0:
        return report
    optimizer = torch.optim.Adam(mlp.parameters(), lr=config.lr)
    device = model_device(model)
    start = time.perf_counter()
    with _training_state(model, layers, mlp, config.routing):
        for step in tqdm(range(config.steps), desc="FTP router training", leave=False):
            batch = batches[step % len(batches)]
            inputs = tensors_to_device(
                {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch},
                device,
            )
            mask = inputs.get("attention_mask")
            real = (
                torch.ones_like(inputs["input_ids"], dtype=torch.bool)
                if mask is None
                else mask.bool()
            )
            with torch.no_grad(), dense_forward(model):
                teacher = model(**inputs, use_cache=False).logits
            for r in routers:
                r.collect = []
            student = model(**inputs, use_cache=False).logits
            collected = [c for r in routers for c in r.collect]
            for r in routers:
                r.collect = None
            d = distillation_loss(student, teacher, real)
            s = sparsity_loss(collected).to(d.device)
            g_w = guide_weight_at(step, config.guide_weight, config.guide_steps)
            g = guide_loss(collected, config.keep_last).to(d.device) if g_w else d * 0
            loss = config.distill_weight * d + config.sparsity_weight * s + g_w * g
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            report.tokens += int(real.sum())
            for name, value in (
                ("total", loss),
                ("distill", d),
                ("sparsity", s),
                ("guide", g),
            ):
                getattr(report, name).append(float(value.detach()))
    report.seconds = time.perf_counter() - start
    logger.info(
        f"FTP router training ({config.routing} routing): {config.steps} steps in "
        f"{report.seconds:.1f}s, loss "
        f"{report.total[0]:.4f} -> {report.total[-1]:.4f} (distill "
        f"{report.distill[-1]:.4f}, sparsity {report.sparsity[-1]:.4f})"
    )
    return report
