"""Which layers matter: the per-layer signal every allocation strategy ranks layers by.

The paper ranks layers by their input/output cosine similarity (a layer that changes its
input little can skip more tokens; ShortGPT removes the layers with the lowest Block
Influence ``1 - cos``). That is a proxy: how much a layer changes its input is not how
much skipping it changes the output. ``importance: loss`` measures the effect itself:
the rise of the next-token loss on calibration text when the layer is skipped entirely
(its output replaced by its input), one layer at a time, everything else dense.

``importance: skip_path_loss`` (with ``skip_path: ridge``) measures what the ridge
variant actually pays for a skipped layer: the loss rise when the layer's output is
replaced by its skip path ``x + u(x)``, ``u`` a ridge map of the layer's update fitted
on the dense model's activations over the next ``importance_fit_tokens`` calibration
tokens (disjoint from the measured ones, so the map is scored on tokens it was not fit
on). A layer whose update a linear map explains well is cheap to skip even if it
changes its input a lot, and the cosine cannot see that (SmolLM2-135M: the middle
layers change their input least, yet their maps explain the least of their update).

The modifier feeds the result to the same strategies as a similarity-like score in
``[0, 1]`` (1 = the cheapest layer to skip, 0 = the costliest), the loss rises ``d_i``
min-max scaled (:func:`similarity_like`). So ``allocation: layer_drop`` removes the
layers whose removal costs the least loss, and ``similarity`` gives them fewer tokens.
Cost: one dense forward plus one per targeted layer over ``importance_tokens`` real
calibration tokens (SmolLM2-135M, 2,048 tokens: about 30 forwards of 2k tokens);
``skip_path_loss`` adds one forward over ``importance_fit_tokens`` and one
``(h + 1)^2`` regression per layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, Literal

import torch
from loguru import logger
from pydantic import BaseModel, model_validator
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier import distributed
from adadsf_modifier.constraints import PositiveInt
from adadsf_modifier.layer_capture import (
    LayerCall,
    OnLayerCall,
    StopForward,
    capture_layers,
)
from adadsf_modifier.routing.ridge import (
    RidgeFit,
    RidgeStats,
    fit_ridge_on_folds,
    ridge_folds,
)
from adadsf_modifier.routing.skip_path import SkipPath
from adadsf_modifier.utils import (
    MODEL_INPUT_KEYS,
    model_device,
    next_token_nll,
    real_token_mask,
    tensors_to_device,
)

__all__ = [
    "ImportanceFields",
    "loss_importance",
    "similarity_like",
    "skip_path_loss_importance",
]


class ImportanceFields(BaseModel):
    """The signal allocation ranks layers by (a pydantic mixin of the modifier).

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      allocation: layer_drop
      importance: loss        # similarity (default, the paper) | loss | skip_path_loss
    ```

    :param importance: ``similarity``: the input/output cosine of dense calibration
        (the paper; ShortGPT's Block Influence for ``layer_drop``); ``loss``: the
        measured rise of the calibration next-token loss when the layer alone is
        skipped (see :mod:`adadsf_modifier.importance`); ``skip_path_loss`` (with
        ``skip_path: ridge``): the rise when it is replaced by a ridge map of its
        update, rank ``skip_path_rank``, penalty ``skip_path_ridge``
    :param importance_tokens: real calibration tokens (per process) that ``loss``
        and ``skip_path_loss`` measure on
    :param importance_fit_tokens: real calibration tokens (per process), after the
        measured ones, that ``skip_path_loss`` fits each layer's map on
    """

    importance: Literal["similarity", "loss", "skip_path_loss"] = "similarity"
    importance_tokens: PositiveInt = 2048
    importance_fit_tokens: PositiveInt = 16384

    @model_validator(mode="after")
    def _check_skip_path_loss(self):
        skip_path = getattr(self, "skip_path", "identity")
        if self.importance == "skip_path_loss" and skip_path != "ridge":
            raise ValueError(
                "importance 'skip_path_loss' measures the loss of replacing each layer "
                "by its fitted skip path: it needs skip_path 'ridge', got "
                f"{skip_path!r} (importance 'loss' measures skipping to the identity)"
            )
        return self


def _token_batches(
    batches: Iterable[Mapping[str, Any]], max_tokens: int
) -> list[dict[str, Any]]:
    """The first batches that together hold at least ``max_tokens`` real tokens
    (iterating ``batches`` no further than that)."""
    out, seen = [], 0
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}
        ids = torch.as_tensor(inputs["input_ids"])
        ids = ids if ids.dim() == 2 else ids.view(1, -1)
        inputs["input_ids"] = ids
        if "attention_mask" in inputs:
            mask = torch.as_tensor(inputs["attention_mask"])
            inputs["attention_mask"] = mask if mask.dim() == 2 else mask.view(1, -1)
        out.append(inputs)
        mask = inputs.get("attention_mask")
        seen += int(mask.sum()) if mask is not None else ids.numel()
        if seen >= max_tokens:
            break
    return out


def _replaced_by(skip: SkipPath | None = None) -> OnLayerCall:
    """Output callback: the layer's output replaced by its input (the layer skipped),
    or with ``skip`` by its skip path ``x + u(x)``."""

    def replace(call: LayerCall) -> Any:
        x = call.hidden_states
        return call.with_output_states(x if skip is None else x + skip(x))

    return replace


def _rises(
    model: nn.Module,
    data: list[dict[str, Any]],
    replacements: Sequence[OnLayerCall],
    layers: Sequence[nn.Module],
    name: str,
) -> tuple[float, int, list[float]]:
    """``(dense NLL, tokens, rises)``: the mean next-token NLL of ``model`` on
    ``data`` and its rise with each of ``replacements`` (an output callback replacing
    a layer's output) on its layer of ``layers``, one layer at a time; sums and counts
    added over the ranks under ``torchrun`` (the same result on every rank)."""
    base = distributed.sum_across_ranks(list(next_token_nll(model, data)))
    if base[1] == 0:
        raise ValueError(f"importance: {name} saw no real calibration tokens")
    dense = base[0] / base[1]
    rises = []
    pairs = list(zip(layers, replacements))
    for layer, replace in tqdm(pairs, desc=f"AdaDSF importance ({name})", leave=False):
        with capture_layers([layer], replace):
            nll, n = distributed.sum_across_ranks(list(next_token_nll(model, data)))
        rises.append(nll / n - dense)
    return dense, base[1], rises


@torch.no_grad()
def loss_importance(
    model: nn.Module,
    layers: Sequence[nn.Module],
    batches: Iterable[Mapping[str, Any]],
    max_tokens: int = 2048,
) -> list[float]:
    """Rise of the mean next-token NLL (nats) when each of ``layers`` alone is
    skipped, measured on the first ``max_tokens`` real tokens of ``batches``. Under
    ``torchrun`` the sums and counts of every rank are added (the same result on
    every rank)."""
    data = _token_batches(batches, max_tokens)
    if not data:
        raise ValueError("importance: loss needs at least one calibration batch")
    was_training = model.training
    model.eval()
    try:
        skipped = [_replaced_by()] * len(layers)
        dense, tokens, rises = _rises(model, data, skipped, layers, "loss")
    finally:
        model.train(was_training)
    logger.info(
        f"AdaDSF importance: dense NLL {dense:.4f} on {tokens} tokens; rise when "
        f"skipped [{', '.join(f'{d:.3f}' for d in rises)}]"
    )
    return rises


def similarity_like(rises: Sequence[float]) -> list[float]:
    """Loss rises as a similarity-like score in ``[0, 1]``:
    ``(max(d) - d) / (max(d) - min(d))``, so the cheapest layer to skip (the lowest,
    possibly negative, rise) scores 1 and the costliest 0; order is kept. Equal rises
    all score 1; a non-finite rise (skipping broke the model) scores 0."""
    d = [float(x) if math.isfinite(x) else math.inf for x in rises]
    finite = [x for x in d if math.isfinite(x)]
    if not finite:
        return [0.0] * len(d)
    lo, hi = min(finite), max(finite)
    if any(math.isinf(x) for x in d):
        hi = max(hi, lo + 1e-12)
    if hi == lo:
        return [1.0 if math.isfinite(x) else 0.0 for x in d]
    return [(hi - x) / (hi - lo) if math.isfinite(x) else 0.0 for x in d]


#: Bytes of regression statistics held at once while fitting the maps: layers are
#: fitted in groups that fit in it, one forward over the fit tokens per group (all of
#: SmolLM2-135M's 29 in one: 11 MB a layer; a 4096-wide model: 3 per forward).
_STATS_BYTES = 2 << 30


@torch.no_grad()
def _fit_maps(
    model: nn.Module,
    layers: Sequence[nn.Module],
    data: list[dict[str, Any]],
    rank: int | None,
    ridge: float | str,
) -> list[RidgeFit]:
    """Per layer, the ridge map of its update ``layer(x) - x`` on its input ``x`` over
    the real tokens of ``data``, on the dense model's activations (statistics summed
    over the ranks; ``ridge`` ``auto``: chosen per layer by two-fold held-out error)."""
    hidden = int(model.config.hidden_size)
    per_layer = 2 * 2 * (hidden + 1) ** 2 * 8  # two folds of sxx and sxy, float64
    group = max(1, _STATS_BYTES // per_layer)
    fits: list[RidgeFit] = []
    for start in range(0, len(layers), group):
        folds = _fold_stats(model, layers[start : start + group], data)
        fits += [fit_ridge_on_folds(pair, rank, ridge) for pair in folds]
    return fits


def _fold_stats(
    model: nn.Module, layers: Sequence[nn.Module], data: list[dict[str, Any]]
) -> list[tuple[RidgeStats, RidgeStats]]:
    """Each layer's two-fold regression statistics of its update on its input over the
    real tokens of ``data`` (one forward per batch, stopped after the last of
    ``layers``), summed over the ranks."""
    device = model_device(model)
    hidden = int(model.config.hidden_size)
    folds = [(RidgeStats(hidden, device), RidgeStats(hidden, device)) for _ in layers]
    parts: list[torch.Tensor] = []

    def add(call: LayerCall) -> None:
        x, y = call.hidden_states, call.output_states
        for stats, part in zip(folds[call.index], parts):
            stats.add(x[part], (y - x)[part])

    rows_seen = 0
    with capture_layers(layers, add, stop_after_last=True):
        for batch in tqdm(data, desc="AdaDSF importance (map fit)", leave=False):
            inputs = tensors_to_device(batch, device)
            ids = inputs["input_ids"]
            real = real_token_mask(inputs.get("attention_mask"), *ids.shape, device)
            parts[:] = ridge_folds(real, rows_seen)
            rows_seen += ids.shape[0]
            with contextlib.suppress(StopForward):
                model(**inputs, use_cache=False)
    for a, b in folds:
        a.all_reduce()
        b.all_reduce()
    return folds


@torch.no_grad()
def skip_path_loss_importance(
    model: nn.Module,
    layers: Sequence[nn.Module],
    batches: Iterable[Mapping[str, Any]],
    max_tokens: int = 2048,
    fit_tokens: int = 16384,
    rank: int | None = None,
    ridge: float | str = "auto",
) -> list[float]:
    """Rise of the mean next-token NLL (nats) when each of ``layers`` alone is
    replaced by its skip path ``x + u(x)``, measured on the first ``max_tokens`` real
    tokens of ``batches``; ``u`` (rank ``rank``, penalty ``ridge``) is fitted on the
    dense activations of the batches after those, up to ``fit_tokens`` real tokens.
    Refuses calibration data with no batch left to fit on."""
    measured = _token_batches(batches, max_tokens)
    # a re-iterable (a DataLoader, a list) starts over: skip the measured batches; a
    # one-shot iterator has already given them
    after = (
        batches
        if isinstance(batches, Iterator)
        else islice(batches, len(measured), None)
    )
    rest = _token_batches(after, fit_tokens)
    if not rest:
        raise ValueError(
            f"importance: skip_path_loss fits each layer's map on the calibration "
            f"batches after the first {max_tokens} real tokens (importance_tokens), "
            "and there are none: pass more calibration samples or lower "
            "importance_tokens"
        )
    was_training = model.training
    model.eval()
    try:
        fits = _fit_maps(model, layers, rest, rank, ridge)
        param = next(model.parameters())
        maps = []
        for fit in fits:
            skip = SkipPath(int(model.config.hidden_size), rank)
            skip.load_fit(fit)
            maps.append(skip.to(device=param.device, dtype=param.dtype))
        replaced = [_replaced_by(skip) for skip in maps]
        dense, tokens, rises = _rises(
            model, measured, replaced, layers, "skip_path_loss"
        )
    finally:
        model.train(was_training)
    logger.info(
        f"AdaDSF importance: dense NLL {dense:.4f} on {tokens} tokens; rise when "
        f"replaced by the skip path (R^2 [{', '.join(f'{f.r2:.2f}' for f in fits)}] "
        f"on {fits[0].tokens} tokens) [{', '.join(f'{d:.3f}' for d in rises)}]"
    )
    return rises
