"""Warm-start the routers from the dense model's own per-token similarity.

A fresh router ranks tokens at random. The dense calibration pass already measures how
much each layer changes each token (``1 - cos(x_in, x_out)``); regressing each router
onto it (standardised ``log(1 - cos)``, a cheap full-batch fit on a token sample, no
backward through the model) makes it keep the tokens whose skipping costs most, and
alignment fine-tunes from there. Under ``torchrun`` each layer's samples are gathered,
one rank fits it (layers dealt round-robin) and broadcasts the router.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier import distributed
from adadsf_modifier.routing.routed_layer import routed_layers
from adadsf_modifier.routing.router import TokenRouter

__all__ = [
    "MIN_HELDOUT_SAMPLE",
    "WarmStartResult",
    "importance_target",
    "skip_error_target",
    "warm_start_router",
    "warm_start_routers",
    "rank_correlation",
]


#: Sampled tokens from which a quarter is held out for the reported rank correlation.
MIN_HELDOUT_SAMPLE = 8


@dataclass
class WarmStartResult:
    layer_index: int
    tokens: int
    loss_first: float
    loss_last: float
    train_rank_corr: (
        float  # Spearman correlation of router score vs importance (fit tokens)
    )
    heldout_rank_corr: float  # same on the held-out quarter of the sample


def importance_target(similarity: torch.Tensor) -> torch.Tensor:
    """Standardised ``log(1 - cos)``: larger = the layer changes this token more.

    A single token has no spread to standardise by: its target is 0.
    """
    return _standardised_log(1.0 - similarity.double())


def skip_error_target(error: torch.Tensor) -> torch.Tensor:
    """Standardised ``log(error)`` of each token's relative skip error
    ``|layer(x) - (x + u(x))| / |x|``: larger = skipping this token costs more."""
    return _standardised_log(error.double())


def _standardised_log(v: torch.Tensor) -> torch.Tensor:
    t = torch.log(v.clamp(min=1e-6))
    if t.numel() < 2:
        return torch.zeros_like(t, dtype=torch.float32)
    return ((t - t.mean()) / t.std().clamp(min=1e-6)).float()


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho (no tie correction; scores are continuous)."""
    if a.numel() < 2:
        return float("nan")
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-12))


def warm_start_router(
    router: TokenRouter,
    inputs: torch.Tensor,
    importance: torch.Tensor,
    layer_index: int,
    steps: int = 100,
    lr: float = 1e-2,
    seed: int = 0,
) -> WarmStartResult:
    """Fit ``router`` (in place) so its score predicts the ``importance`` of each
    sampled token (a standardised target, larger = keep: :func:`importance_target`,
    :func:`skip_error_target`).

    Trains a float32 copy (bf16 Adam updates would be lost to rounding) and copies it
    back in the router's own dtype. A quarter of the sample is held out to report rank
    correlation honestly; with fewer than :data:`MIN_HELDOUT_SAMPLE` tokens (a small
    ``router_init_tokens``, or a tiny calibration set) every token is fit and the
    held-out correlation is NaN. Any sample of at least one token works.
    """
    n = inputs.shape[0]
    if n != importance.shape[0]:
        raise ValueError(
            f"layer {layer_index}: {n} sampled inputs but {importance.shape[0]} "
            "importance targets"
        )
    if n < 1:
        raise ValueError(f"layer {layer_index}: no sampled tokens to fit the router on")
    g = torch.Generator().manual_seed(seed + layer_index)
    perm = torch.randperm(n, generator=g)
    n_hold = max(2, n // 4) if n >= MIN_HELDOUT_SAMPLE else 0
    hold, fit = perm[:n_hold], perm[n_hold:]
    target = importance.float()
    device = next(router.parameters()).device
    work = copy.deepcopy(router).float().to(device)
    h = work.normalise(inputs.to(device))  # fixed inputs: normalised once
    y = target.to(device)
    h_fit, y_fit = h[fit], y[fit]
    opt = torch.optim.Adam(work.parameters(), lr=lr)
    first = last = float("nan")
    with torch.enable_grad():
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(work.score(h_fit), y_fit)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step == 0:
                first = float(loss.detach())
            last = float(loss.detach())
    with torch.no_grad():
        scores = work.score(h)
        router.load_state_dict(
            {
                k: v.to(p.dtype)
                for (k, v), p in zip(
                    work.state_dict().items(), router.state_dict().values()
                )
            }
        )
    return WarmStartResult(
        layer_index=layer_index,
        tokens=int(inputs.shape[0]),
        loss_first=first,
        loss_last=last,
        train_rank_corr=rank_correlation(scores[fit].cpu(), y[fit].cpu()),
        heldout_rank_corr=rank_correlation(scores[hold].cpu(), y[hold].cpu()),
    )


#: ``sample(layer_index, hidden_size) -> (inputs [N, hidden], similarity [N])``: this
#: rank's sampled calibration tokens at a decoder layer (``N`` may be 0).
TokenSample = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def warm_start_routers(
    model: nn.Module, sample: TokenSample, steps: int = 100, seed: int = 0
) -> list[WarmStartResult]:
    """Warm-start the router of every routed layer with ``0 < r < 1`` (in place).

    Under ``torchrun`` the ranks' samples are gathered (so the fit sees tokens of
    every partition), the ``k``-th layer is fit on rank ``k % world_size`` and its
    router and result are broadcast from there: routers and reports are identical on
    every rank. In one process this is :func:`warm_start_router` on each layer.
    """
    world, me = distributed.world_size(), distributed.rank()
    layers = [m for m in routed_layers(model) if 0.0 < m.retention_ratio < 1.0]
    mine: dict[int, WarmStartResult] = {}
    bar = tqdm(
        layers,
        desc="AdaDSF router warm start",
        leave=False,
        disable=not distributed.is_source_process(),
    )
    for k, layer in enumerate(bar):
        x, cos = sample(layer.layer_index, layer.router.fc1.in_features)
        x, cos = (
            distributed.all_gather_variable(x),
            distributed.all_gather_variable(cos),
        )
        if x.shape[0] == 0:  # the same on every rank: all raise together
            raise ValueError(
                f"no tokens were sampled at decoder layer {layer.layer_index}"
            )
        if k % world == me:
            mine[k] = warm_start_router(
                layer.router,
                x,
                importance_target(cos),
                layer.layer_index,
                steps=steps,
                seed=seed,
            )
    if world == 1:
        return [mine[k] for k in range(len(layers))]
    for k, layer in enumerate(layers):
        distributed.broadcast_module(layer.router, src=k % world)
    gathered: dict[int, WarmStartResult] = {}
    for part in distributed.all_gather_object(mine):
        gathered.update(part)
    return [gathered[k] for k in range(len(layers))]
