"""Rows of their own for the recipe's alignment stages, so that ``adadsf compress``
trains the way the results study measured instead of cycling the calibration rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loguru import logger

from adadsf_modifier import distributed
from adadsf_modifier.evaluation import calibration_dataset
from adadsf_modifier.evaluation.text_splits import packed_rows
from adadsf_modifier.modifier import AdaDSFModifier

__all__ = ["alignment_rows"]


def alignment_rows(
    modifiers: Sequence[Any],
    tok: Any,
    rows: int | None,
    seed: int,
    texts: list[str] | None = None,
    source: str | None = None,
) -> int | None:
    """Gives each AdaDSF modifier of the recipe that trains (``align_steps > 0``) and
    has no ``align_dataset`` its own training rows of the calibration text, cut to its
    ``align_seq_len``: ``rows`` of them, or by default one pass of its steps
    (``align_steps x align_batch_size`` per process) so that no row is seen twice.
    ``rows == 0`` keeps the old behaviour: training cycles through the calibration
    rows (few, and short, by default). Returns the row count given (``None``: none).

    The same text and seed as the calibration rows: what the results study measured
    (``docs/results/``); ``texts``: the user's documents (``--dataset source``)."""
    given = None
    if rows == 0:
        return given
    for mod in modifiers:
        trains = isinstance(mod, AdaDSFModifier) and mod.align_steps
        if not trains or mod.align_dataset is not None:
            continue
        n = rows or mod.align_steps * mod.align_batch_size * distributed.world_size()
        seq_len = mod.align_seq_len
        mod.align_dataset = (
            calibration_dataset(tok, n, seq_len, seed=seed)
            if texts is None
            else packed_rows(tok, texts, n, seq_len, f"--dataset {source}")
        )
        logger.info(
            f"alignment: {n} rows of {mod.align_seq_len} tokens "
            f"({mod.align_steps} steps x {mod.align_batch_size} rows)"
        )
        given = n
    return given
