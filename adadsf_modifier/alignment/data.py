"""Training rows for the alignment stage: llm-compressor's calibration batches (padded,
maybe shuffled) or a user's rows, flattened into rows of real tokens, so that the
stage's own batch size and seed decide what each step sees."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from loguru import logger
from torch.nn.utils.rnn import pad_sequence


def training_rows(
    source: Iterable[Mapping[str, Any]], seq_len: int
) -> list[torch.Tensor]:
    """1-D rows of real token ids (padding removed by the attention mask, left or
    right), each cut to its first ``seq_len``; ``source`` yields rows or batches with
    ``input_ids`` and optionally ``attention_mask``."""
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
    """Endless batches of ``batch_size`` rows over epochs of ``rows``, each a fresh
    permutation from a generator seeded with ``seed``; a batch crossing an epoch
    boundary is completed from the next one. Rows are right-padded with
    ``pad_token_id``."""

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        batch_size: int,
        seed: int,
        pad_token_id: int = 0,
    ):
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
        """``input_ids``, ``attention_mask`` and ``row_index`` (for the teacher
        cache)."""
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
