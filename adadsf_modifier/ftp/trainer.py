"""Train FTP's shared router MLP with the LLM frozen (``docs/ftp.md``).

Losses: distillation to the dense model, sparsity (each layer's straight-through kept
fraction against its ratio), and guide (imitate the static router, weighted down to 0
over the first steps). ``FTPTrainConfig.routing`` picks which tokens run: FTP's
``threshold`` (the gate ``s > 0``; thresholds are refitted afterwards, so the router
trains on decisions inference never makes) or inference's ``quantile`` (each layer
runs its ratio of every batch while the router learns which).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.ftp.router import ftp_layers
from adadsf_modifier.ftp.static import static_keep_mask
from adadsf_modifier.routing import RoutedLayer, routed_layers, routing_override
from adadsf_modifier.utils import model_device, real_token_mask, tensors_to_device

TrainRouting = Literal["threshold", "quantile"]  # the module docstring
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


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """Mean over real tokens of ``KL(softmax(teacher) || softmax(student))``."""
    log_s = F.log_softmax(student_logits.float(), dim=-1)
    log_t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return kl[real].mean()


def sparsity_loss(collected: list[tuple]) -> torch.Tensor:
    """Mean over layers of ``(kept fraction - ratio)^2``; ``collected``: the layer
    routers' ``(scores, probe scores, real, ratio)``."""
    terms = []
    for scores, _, real, ratio in collected:
        free = real & (real.cumsum(dim=1) > 1)  # the first token always runs
        if ratio >= 1.0 or not bool(free.any()):
            continue
        p = torch.sigmoid(scores)
        gate = (scores > 0).float() + p - p.detach()  # straight-through
        terms.append((gate[free].mean() - ratio) ** 2)
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


def guide_loss(collected: list[tuple], keep_last: int) -> torch.Tensor:
    """Mean over layers of the BCE of the gate logits against the static keep mask."""
    terms = []
    for scores, probe, real, ratio in collected:
        if ratio >= 1.0 or not bool(real.any()):
            continue
        target = static_keep_mask(probe, real, ratio, keep_last).float()
        terms.append(F.binary_cross_entropy_with_logits(scores[real], target[real]))
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


@contextmanager
def dense_forward(model: nn.Module) -> Iterator[None]:
    """Every routed layer runs every token (the dense model, without a copy)."""
    with routing_override(routed_layers(model), retention_ratio=1.0):
        yield


@contextmanager
def _training_state(
    model: nn.Module, layers: list[RoutedLayer], mlp: nn.Module, routing: str
):
    """Only the router MLP trains, the tokens that run chosen by ``routing``; all
    restored afterwards."""
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
            ids = inputs["input_ids"]
            real = real_token_mask(inputs.get("attention_mask"), *ids.shape, ids.device)
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
            g_w = 0.0  # decays linearly to 0 over guide_steps
            if config.guide_steps > 0:
                g_w = config.guide_weight * max(0.0, 1.0 - step / config.guide_steps)
            g = guide_loss(collected, config.keep_last).to(d.device) if g_w else d * 0
            loss = config.distill_weight * d + config.sparsity_weight * s + g_w * g
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            report.tokens += int(real.sum())
            for name, value in zip(
                ("total", "distill", "sparsity", "guide"), (loss, d, s, g)
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
