"""The dense teacher's outputs, computed once per training row and reused
(``align_teacher_cache``).

Why: the teacher is frozen, so its outputs on a row never change, yet without a cache
the loop runs it on every step. Alignment cycles over the same rows for several epochs
(100 steps of 8 rows over 128 calibration rows: 6 epochs), and the teacher's forward is
about a quarter of a step's work. The cache keeps, per row, the teacher's *final normed
hidden state* (and, when the hidden-alignment term is on, every decoder layer's output)
and recomputes the logits through the teacher's own output embedding: the lm_head is
~20 % of a forward of SmolLM2-135M, while storing full logits (49,152 per token) would
not fit in memory.

Exactness: a row's first batch runs the teacher as without the cache (bit-identical
outputs); later batches read the stored states, which equal a fresh forward up to the
last bits of a differently composed batch. The first computed batch checks that the
output embedding applied to the last hidden state reproduces the teacher's logits; a
model whose logits are not ``lm_head(last hidden state)`` (say, soft-capped) is refused
there. Memory is ``tokens x hidden x (1 or layers) x bytes``, checked against the free
memory before calibration (the modifier) and again before the first step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
from loguru import logger
from torch import nn
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "TeacherCache",
    "check_teacher_cache_fits",
    "rows_read_again",
    "teacher_cache_bytes",
]

Forward = Callable[
    [nn.Module, Mapping[str, torch.Tensor], bool],
    tuple[torch.Tensor, tuple[torch.Tensor, ...] | None],
]


def rows_read_again(n_rows: int, steps: int, batch_size: int) -> bool:
    """Whether ``steps`` batches of ``batch_size`` rows (fewer when there are fewer
    rows, as :class:`~adadsf_modifier.alignment.data.RowBatcher` draws them) read some
    of the ``n_rows`` rows a second time: only then is a cached output ever read back.
    One pass over fresh rows (the results study's design) would only pay the cache's
    memory."""
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
    half the free memory of ``device``. Called before calibration (the modifier) and
    again when the stage starts."""
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
    like a teacher forward would.

    :param teacher: the frozen dense teacher (unwrapped: its output embedding is called
        directly)
    :param rows: the training rows (only their sizes are read, for the memory check)
    :param need_hidden: keep every decoder layer's output (the hidden-alignment term)
    :param forward: the loop's forward, ``(model, batch, hidden) -> (logits, states)``
    """

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
        ``row_index`` names its rows (:class:`~.data.RowBatcher`)."""
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
