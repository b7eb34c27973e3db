"""Which layers matter: the per-layer signal every allocation strategy ranks layers by.

The paper ranks layers by their input/output cosine similarity (a layer that changes its
input little can skip more tokens; ShortGPT removes the layers with the lowest Block
Influence ``1 - cos``). That is a proxy: how much a layer changes its input is not how
much skipping it changes the output. ``importance: loss`` measures the effect itself:
the rise of the next-token loss on calibration text when the layer is skipped entirely
(its output replaced by its input), one layer at a time, everything else dense.

The modifier feeds the result to the same strategies as a similarity-like score in
``[0, 1]`` (1 = the cheapest layer to skip, 0 = the costliest), the loss rises ``d_i``
min-max scaled (:func:`similarity_like`). So ``allocation: layer_drop`` removes the
layers whose removal costs the least loss, and ``similarity`` gives them fewer tokens.
Cost: one dense forward plus one per targeted layer over ``importance_tokens`` real
calibration tokens (SmolLM2-135M, 2,048 tokens: about 30 forwards of 2k tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from loguru import logger
from pydantic import BaseModel
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier import distributed
from adadsf_modifier.constraints import PositiveInt
from adadsf_modifier.utils import MODEL_INPUT_KEYS, next_token_nll

__all__ = ["ImportanceFields", "loss_importance", "similarity_like"]


class ImportanceFields(BaseModel):
    """The signal allocation ranks layers by (a pydantic mixin of the modifier).

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      allocation: layer_drop
      importance: loss        # similarity (default, the paper) | loss
    ```

    :param importance: ``similarity``: the input/output cosine of dense calibration
        (the paper; ShortGPT's Block Influence for ``layer_drop``); ``loss``: the
        measured rise of the calibration next-token loss when the layer alone is
        skipped (see :mod:`adadsf_modifier.importance`)
    :param importance_tokens: real calibration tokens (per process) that ``loss``
        measures on
    """

    importance: Literal["similarity", "loss"] = "similarity"
    importance_tokens: PositiveInt = 2048


def _token_batches(
    batches: Iterable[Mapping[str, Any]], max_tokens: int
) -> list[dict[str, Any]]:
    """The first batches that together hold at least ``max_tokens`` real tokens."""
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


def _skip_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: the layer's output replaced by its input (the layer skipped)."""
    x = args[0] if args else kwargs["hidden_states"]
    return (x, *output[1:]) if isinstance(output, tuple) else x


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
        base = distributed.sum_across_ranks(list(next_token_nll(model, data)))
        if base[1] == 0:
            raise ValueError("importance: loss saw no real calibration tokens")
        dense = base[0] / base[1]
        rises = []
        bar = tqdm(layers, desc="AdaDSF importance (loss)", leave=False)
        for layer in bar:
            handle = layer.register_forward_hook(_skip_hook, with_kwargs=True)
            try:
                nll, n = distributed.sum_across_ranks(list(next_token_nll(model, data)))
            finally:
                handle.remove()
            rises.append(nll / n - dense)
    finally:
        model.train(was_training)
    logger.info(
        f"AdaDSF importance: dense NLL {dense:.4f} on {base[1]} tokens; rise when "
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
