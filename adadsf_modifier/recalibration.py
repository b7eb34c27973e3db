"""Refit a saved routed checkpoint's causal thresholds on a deployment's own text.

Causal routing keeps a token at a layer when its router score passes the layer's
threshold, and the thresholds were fitted on the calibration set: on text unlike it
more (or fewer) tokens pass, and the compute budget drifts.
The thresholds are the only part of a routed model fitted to the text's distribution
that needs no training, so a deployment can refit them on its own text without
touching a weight: :func:`recalibrate_checkpoint` loads the checkpoint, refits every
routed layer's threshold on the given rows in one bottom-up walk
(:func:`~adadsf_modifier.fitting.thresholds.calibrate_thresholds`) and writes a new
checkpoint whose weight files are the old ones (hard links where the filesystem
allows: a tool that later rewrites a weight file in place would change both), its other
files copies, and its sidecar the old one with only ``causal_threshold`` changed. The
rows' kept share is measured before the refit (one forward) and read off the walk
after it (in sample: the thresholds are fitted to those rows), so the command can say
how far the old thresholds were off; in all about two forward passes over the rows.

Every routed layer must route causally (stored mode ``auto`` or ``causal``): a layer in
``rank`` or ``topk`` mode reads no threshold, and a threshold above it would be fitted
on inputs it will not see. One process: under ``torchrun`` it is refused.

Both kinds of checkpoint: AdaDSF's (``adadsf_config.json``) and FTP's
(``ftp_routing.json``), whose thresholds are a field of their sidecars' layer entries.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from adadsf_modifier import distributed
from adadsf_modifier.atomic import atomic_directory, write_text_durably
from adadsf_modifier.checkpoint.kinds import FTP_SIDECAR_NAME, checkpoint_sidecar
from adadsf_modifier.checkpoint.load import from_pretrained
from adadsf_modifier.checkpoint.save import link_or_copy
from adadsf_modifier.checkpoint.sidecar import (
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    read_sidecar,
)
from adadsf_modifier.constraints import InputError
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.fitting.thresholds import (
    THRESHOLD_TOLERANCE,
    check_calibration_rows,
)
from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.ftp.checkpoint import read_ftp_sidecar
from adadsf_modifier.routing import routed_layers

__all__ = ["Recalibration", "check_destination_apart", "recalibrate_checkpoint"]

#: Stored routing modes in which an evaluated layer reads its causal threshold.
_CAUSAL = (None, "auto", "causal")
#: Weight files, shared with the source by hard links.
_WEIGHTS = re.compile(r".*\.(safetensors|bin)")

#: Each kind's sidecar reader (validated; the thresholds are a field of its layers).
_SIDECARS = {SIDECAR_NAME: read_sidecar, FTP_SIDECAR_NAME: read_ftp_sidecar}


@dataclass
class Recalibration:
    """What :func:`recalibrate_checkpoint` changed and measured: per routed layer (in
    layer order) its index, old and new threshold; the routed layers' kept share of the
    rows' real tokens under the old and the new thresholds, beside the share their
    retention ratios plan (``target``)."""

    layer_indices: list[int] = field(default_factory=list)
    old_thresholds: list[float | None] = field(default_factory=list)
    new_thresholds: list[float | None] = field(default_factory=list)
    kept_before: float = math.nan
    kept_after: float = math.nan
    target: float = math.nan
    rows: int = 0
    tokens: int = 0


def recalibrate_checkpoint(
    source: str | os.PathLike[str],
    rows: torch.Tensor,
    dest: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    tolerance: float = THRESHOLD_TOLERANCE,
) -> Recalibration:
    """Refit ``source``'s causal thresholds on ``rows`` (``[n, seq]`` token ids, every
    token real) and write the checkpoint to ``dest`` (``source`` itself replaces it in
    place; either way atomically: a failure leaves ``dest`` as it was).

    :raises AdaDSFCheckpointError: ``source`` is not a checkpoint this package writes
    :raises InputError: a layer that reads no threshold (``rank`` / ``topk`` mode), a
        destination inside the checkpoint or holding it, or ``torchrun``
    :raises ThresholdCalibrationError: the rows cannot reach a layer's ratio (too
        short: before the weights load; too many tied scores: before anything is
        written)
    """
    source, dest = Path(source), Path(dest)
    if distributed.is_distributed():
        raise InputError("recalibrating a checkpoint runs in one process, not torchrun")
    check_destination_apart(source, dest)
    kind = checkpoint_sidecar(source)
    if kind not in _SIDECARS:
        raise AdaDSFCheckpointError(
            f"{source} is not a routed checkpoint (no {SIDECAR_NAME} nor "
            f"{FTP_SIDECAR_NAME}): recalibrating thresholds needs one"
        )
    sidecar = _SIDECARS[kind](source)  # validated before the weights load
    routed = [e for e in sidecar.layers if getattr(e, "routed", True)]
    fixed = [e for e in routed if getattr(e, "routing_mode", None) not in _CAUSAL]
    if fixed:
        raise InputError(
            f"layer {fixed[0].index} of {source} routes in mode "
            f"{fixed[0].routing_mode!r}, which reads no threshold: only checkpoints "
            "whose layers route causally (mode auto or causal) have thresholds to refit"
        )
    batches = [
        {"input_ids": row[None], "attention_mask": torch.ones_like(row[None])}
        for row in rows
    ]
    # rows too short for a ratio are refused before the weights load
    check_calibration_rows([e.retention_ratio for e in routed], batches, tolerance)
    model = from_pretrained(source, dtype=dtype).eval()

    before = KeptShare(model)
    for batch in batches:
        before.add(normalized_flops(model, batch))
    layers = {m.layer_index: m for m in routed_layers(model)}
    old = {i: m.causal_threshold for i, m in layers.items()}
    fit = calibrate_thresholds(model, batches, tolerance=tolerance)
    # every routed layer is offered every (real) token of the rows, so the share a
    # forward of the refit model would count on them is the mean of the walk's
    # per-layer kept fractions (which are what such a forward measures)
    kept_after = sum(fit.kept_fraction) / len(fit.kept_fraction)
    entries = []
    for entry in sidecar.layers:  # FTP's sidecar lists its routed layers only
        if getattr(entry, "routed", True) and entry.index in layers:
            entry = entry.model_copy(
                update={"causal_threshold": layers[entry.index].causal_threshold}
            )
        entries.append(entry)
    updated = sidecar.model_copy(update={"layers": entries})
    text = json.dumps(
        updated.model_dump(mode="json", by_alias=True), indent=2, allow_nan=False
    )
    _write_beside(source, dest, kind, text + "\n")
    report = Recalibration(
        layer_indices=sorted(layers),
        old_thresholds=[old[i] for i in sorted(layers)],
        new_thresholds=[layers[i].causal_threshold for i in sorted(layers)],
        kept_before=before.fraction,
        kept_after=kept_after,
        target=before.target,
        rows=int(rows.shape[0]),
        tokens=int(rows.numel()),
    )
    logger.info(
        f"AdaDSF thresholds refit on {report.rows} x {rows.shape[1]} tokens: kept "
        f"share {report.kept_before:.3f} -> {report.kept_after:.3f} (target "
        f"{report.target:.3f}); written to {dest}"
    )
    return report


def check_destination_apart(source: Path, dest: Path) -> None:
    """Refuse a destination inside the checkpoint (the copy would copy its own
    temporary folder) or holding it (replacing it would delete the checkpoint); the
    checkpoint itself is fine (replaced in place)."""
    a, b = source.resolve(), dest.resolve()
    if a != b and (a in b.parents or b in a.parents):
        where = "inside" if a in b.parents else "a folder holding"
        raise InputError(
            f"the destination {dest} is {where} the checkpoint {source}: write the "
            "recalibrated checkpoint beside it, or onto it to replace it in place"
        )


def _write_beside(source: Path, dest: Path, sidecar_name: str, text: str) -> None:
    """``dest``: ``source``'s weight files hard-linked where possible (not rewritten),
    its other files copied (a later in-place edit of a config or tokenizer file must
    not reach the source), its sidecar ``sidecar_name`` replaced by ``text``, published
    atomically."""
    with atomic_directory(dest) as tmp:
        for entry in source.iterdir():
            if entry.name == sidecar_name:
                continue  # written anew below
            target = tmp / entry.name
            if entry.is_dir():
                shutil.copytree(entry, target)
            elif _WEIGHTS.fullmatch(entry.name):
                link_or_copy(str(entry), str(target))
            else:
                shutil.copy2(entry, target)
        write_text_durably(tmp / sidecar_name, text)  # last: the completeness marker
