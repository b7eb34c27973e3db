"""The dense teacher's outputs, computed once per training row and reused in later
epochs (``align_teacher_cache``): the teacher is frozen, yet without a cache it runs
every step.

Per row the cache keeps the teacher's final normed hidden state (and, for the
hidden-alignment term, every layer's output) and recomputes the logits through the
teacher's output embedding: full logits would not fit in memory. A row's first batch
runs the teacher as without the cache; later ones read the stored states, equal to a
fresh forward up to the last bits of a differently composed batch. The first computed
batch checks that the output embedding of the last hidden state gives the teacher's
logits (a soft-capped model is refused there).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
from loguru import logger
from torch import nn
from torch.nn.utils.rnn import pad_sequence

Forward = Callable[
    [nn.Module, Mapping[str, torch.Tensor], bool],
    tuple[torch.Tensor, tuple[torch.Tensor, ...] | None],
]


def rows_read_again(n_rows: int, steps: int, batch_size: int) -> bool:
    """Whether ``steps`` batches (of at most ``n_rows`` rows, as ``RowBatcher`` draws
    them) read some row twice: only then is a cached output ever read back."""
    return steps * min(batch_size, n_rows) > n_rows


def teacher_cache_bytes(
    rows: Sequence[torch.Tensor], teacher: nn.Module, need_hidden: bool
) -> int:
    """Bytes the cache holds once every row has been seen."""
    cfg = teacher.config
    states = cfg.num_hidden_layers if need_hidden else 1
    dtype = next(teacher.parameters()).dtype
    tokens = sum(int(r.numel()) for r in rows)
    return tokens * cfg.hidden_size * states * dtype.itemsize


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_teacher_cache_fits(
    model: nn.Module,
    rows: Sequence[torch.Tensor],
    need_hidden: bool,
    device: torch.device,
) -> int:
    """The cache's size in bytes; :class:`MemoryError` when it would take more than
    half the free memory of ``device`` (checked before calibration and again when the
    stage starts)."""
    if model.get_output_embeddings() is None:
        raise ValueError(
            f"align_teacher_cache: {type(model).__name__} has no output embedding to "
            "recompute the logits with; turn align_teacher_cache off"
        )
    need = teacher_cache_bytes(rows, model, need_hidden)
    free = _free_bytes(device)
    if free is not None and need > free // 2:
        raise MemoryError(
            f"align_teacher_cache needs {need / 2**30:.2f} GiB for {len(rows)} rows, "
            f"more than half of the {free / 2**30:.2f} GiB free on {device.type}: "
            "turn align_teacher_cache off, or train on fewer or shorter rows "
            "(align_seq_len)"
        )
    return need


class TeacherCache:
    """Per-row teacher states; :meth:`outputs` gives a batch's ``(logits, hidden)``
    as a teacher forward would (``forward``: the loop's; ``teacher`` unwrapped, its
    output embedding is called directly)."""

    def __init__(
        self,
        teacher: nn.Module,
        rows: Sequence[torch.Tensor],
        need_hidden: bool,
        forward: Forward,
        device: torch.device,
    ):
        self.teacher, self.need_hidden, self._forward = teacher, need_hidden, forward
        need = check_teacher_cache_fits(teacher, rows, need_hidden, device)
        self.head = teacher.get_output_embeddings()
        logger.info(
            f"AdaDSF alignment: caching the teacher's outputs per row "
            f"({need / 2**30:.2f} GiB once every row is seen; "
            f"{'every layer' if need_hidden else 'last hidden state'})"
        )
        self._states: dict[int, list[torch.Tensor]] = {}
        self._checked = False
        self.computed = self.reused = 0  # batches: the teacher ran / it did not

    def outputs(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The teacher's logits and (if kept) per-layer states on ``batch``, whose
        ``row_index`` names its rows."""
        ids = batch["row_index"].tolist()
        if any(i not in self._states for i in ids):
            return self._compute(batch, ids)
        self.reused += 1
        # right-padded with zeros like the batch (padding is masked out of the losses)
        states = [
            pad_sequence([self._states[i][k] for i in ids], batch_first=True)
            for k in range(len(self._states[ids[0]]))
        ]
        logits = self.head(states[-1])
        return logits, tuple(states) if self.need_hidden else None

    def _compute(self, batch, ids):
        self.computed += 1
        logits, hidden = self._forward(self.teacher, batch, True)
        last = hidden[-1]
        if not self._checked:
            again = self.head(last)
            if not torch.allclose(again, logits, rtol=1e-3, atol=1e-3):
                err = float((again - logits).abs().max())
                raise ValueError(
                    f"align_teacher_cache: {type(self.teacher).__name__}'s logits are "
                    "not its output embedding applied to its last hidden state (max "
                    f"difference {err:.3g}); turn align_teacher_cache off"
                )
            self._checked = True
        lengths = batch["attention_mask"].sum(1).tolist()
        kept = hidden if self.need_hidden else (last,)
        for row, (i, n) in enumerate(zip(ids, lengths)):
            if i not in self._states:
                self._states[i] = [s[row, :n].detach().clone() for s in kept]
        return logits, hidden if self.need_hidden else None
