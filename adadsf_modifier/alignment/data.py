"""Training rows for the alignment stage: unpadded, truncated, re-batched with a seed.

The stage trains on llm-compressor's calibration ``DataLoader`` (batches, possibly
padded and shuffled) or on a user's dataset (rows). Both are flattened into rows of real
tokens, so the stage's own batch size and seed decide what each step sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from loguru import logger
from torch.nn.utils.rnn import pad_sequence

__all__ = ["RowBatcher", "training_rows"]


def _check_positive(value: int, name: str) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")


def training_rows(
    source: Iterable[Mapping[str, Any]], seq_len: int
) -> list[torch.Tensor]:
    """Flatten ``source`` into 1-D rows of real token ids, each cut to its first
    ``seq_len`` tokens.

    ``source`` yields mappings with ``input_ids`` and optionally ``attention_mask``,
    either one row each (a ``datasets.Dataset``, a list of dicts) or a batch each
    (llm-compressor's calibration ``DataLoader``). Padding is removed using the
    attention mask (left or right padding alike), so the rows can be re-batched at any
    batch size; other keys (``labels``...) are ignored.
    """
    _check_positive(seq_len, "seq_len")
    rows: list[torch.Tensor] = []
    for item in source:
        if "input_ids" not in item:
            raise ValueError(
                f"alignment data needs an `input_ids` column, got {sorted(item)}"
            )
        ids = torch.as_tensor(item["input_ids"], dtype=torch.long)
        mask = item.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        if ids.dim() == 1:
            ids, mask = ids.unsqueeze(0), mask.unsqueeze(0)
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"alignment data: input_ids {tuple(ids.shape)} / attention_mask "
                f"{tuple(mask.shape)} must be matching 1-D rows or 2-D batches"
            )
        for row, row_mask in zip(ids.cpu(), mask.cpu()):
            real = row[row_mask.bool()][:seq_len]
            if real.numel() > 0:
                rows.append(real.clone())
    if not rows:
        raise ValueError("alignment data holds no real tokens (empty, or all padding)")
    return rows


class RowBatcher:
    """Endless batches of ``batch_size`` rows, cycling over shuffled epochs of ``rows``.

    Each epoch is a fresh permutation drawn from a generator seeded with ``seed``; a
    batch that crosses an epoch boundary takes its remaining rows from the next epoch,
    so every batch has the same number of rows. Rows of different lengths are
    right-padded with ``pad_token_id`` and masked out in ``attention_mask``.
    """

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        batch_size: int,
        seed: int,
        pad_token_id: int = 0,
    ):
        if not rows:
            raise ValueError("RowBatcher needs at least one row")
        _check_positive(batch_size, "batch_size")
        self.rows = list(rows)
        self.batch_size = min(batch_size, len(self.rows))
        if self.batch_size < batch_size:
            logger.warning(
                f"AdaDSF alignment: only {len(self.rows)} rows of training data, using "
                f"batch size {self.batch_size} instead of {batch_size}"
            )
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    def _next_index(self) -> int:
        if not self._order:
            self._order = torch.randperm(
                len(self.rows), generator=self._generator
            ).tolist()
        return self._order.pop(0)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and ``row_index`` (which rows, for the
        teacher cache)."""
        index = [self._next_index() for _ in range(self.batch_size)]
        chosen = [self.rows[i] for i in index]
        return {
            "row_index": torch.tensor(index, dtype=torch.long),
            "input_ids": pad_sequence(
                chosen, batch_first=True, padding_value=self.pad_token_id
            ),
            "attention_mask": pad_sequence(
                [torch.ones_like(r) for r in chosen], batch_first=True
            ),
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()
