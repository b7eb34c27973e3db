"""The token rows a modifier is given (calibration batches, ``align_dataset``),
checked in one pass before any forward: a bad id or mask would otherwise fail minutes
later as a bare ``IndexError`` or size error, or mask the wrong tokens silently."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from adadsf_modifier.constraints import InputError


def vocabulary_size(model: nn.Module) -> int:
    """How many token ids ``model`` can embed (a padded table exceeds
    ``config.vocab_size``)."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows if rows is not None else model.config.vocab_size)


def _tensor(value: Any, where: str, key: str) -> torch.Tensor:
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(
            f"{where}: `{key}` is not a list of integers or a tensor ({err})"
        ) from None


def _check_item(item: Any, where: str, vocab_size: int) -> None:
    if not isinstance(item, Mapping) or "input_ids" not in item:
        found = sorted(item) if isinstance(item, Mapping) else type(item).__name__
        raise InputError(f"{where}: needs an `input_ids` column, got {found}")
    ids = _tensor(item["input_ids"], where, "input_ids")
    if ids.numel() and (ids.is_floating_point() or ids.dtype == torch.bool):
        raise InputError(f"{where}: input_ids must be integers, got {ids.dtype}")
    mask = item.get("attention_mask")
    if mask is not None:
        mask = _tensor(mask, where, "attention_mask")
        if tuple(mask.shape) != tuple(ids.shape):
            raise InputError(
                f"{where}: attention_mask has shape {tuple(mask.shape)} but its "
                f"input_ids {tuple(ids.shape)}: each row needs one mask entry per "
                "token"
            )
    if not ids.numel():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InputError(
            f"{where}: token id {bad} is outside the model's vocabulary (ids 0 to "
            f"{vocab_size - 1}): tokenize the data with the model's own tokenizer"
        )


def check_token_rows(
    source: Iterable[Mapping[str, Any]], vocab_size: int, what: str
) -> int:
    """Check every item of ``source``; returns how many there were (``what`` names
    an item in messages). Under a forked RNG, so that a shuffling loader's later
    passes are unchanged; a one-shot iterator, which this pass would empty, is not
    checked (returns 0)."""
    count = 0
    with torch.random.fork_rng(devices=[]):  # iter() of a loader draws from it too
        items = iter(source)
        if items is source:
            return count
        for count, item in enumerate(items, start=1):
            _check_item(item, f"{what} {count - 1}", vocab_size)
    return count
