"""Refit a saved routed checkpoint's causal thresholds on a deployment's own text.

On text unlike the calibration set the kept share, so the compute, drifts; the
thresholds are the only part fitted to the text that needs no training.
:func:`recalibrate_checkpoint` refits them in one bottom-up walk and writes a checkpoint
that differs only in the sidecar's ``causal_threshold`` (weights hard-linked). Every
routed layer must route causally; one process only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
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

_CAUSAL = (None, "auto", "causal")  # stored modes in which a layer reads a threshold
_WEIGHTS = re.compile(r".*\.(safetensors|bin)")  # hard-linked, not copied
_SIDECARS = {SIDECAR_NAME: read_sidecar, FTP_SIDECAR_NAME: read_ftp_sidecar}


@dataclass
class Recalibration:
    """Per routed layer its index, old and new threshold; the routed layers' kept share
    of the rows' tokens under the old and new thresholds, and the planned share."""

    layer_indices: list[int]
    old_thresholds: list[float | None]
    new_thresholds: list[float | None]
    kept_before: float
    kept_after: float
    target: float
    rows: int
    tokens: int


def recalibrate_checkpoint(
    source: str | os.PathLike[str],
    rows: torch.Tensor,
    dest: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    tolerance: float = THRESHOLD_TOLERANCE,
    allow_missed_plan: bool = False,
) -> Recalibration:
    """Refit ``source``'s causal thresholds on ``rows`` (``[n, seq]`` ids, every token
    real) and write the checkpoint to ``dest`` atomically (``source`` itself: in
    place). Rows too short for a ratio are refused before the weights load.

    A refit in which a layer's kept share of the rows misses its planned ratio by more
    than ``tolerance`` is refused before anything is written (:class:`InputError`):
    repetitive text ties the router scores, so no threshold reaches the plan, and
    such thresholds would spend another budget on ordinary text. ``allow_missed_plan``
    writes it anyway, with a warning."""
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
    check_calibration_rows([e.retention_ratio for e in routed], batches, tolerance)
    model = from_pretrained(source, dtype=dtype).eval()

    before = KeptShare(model)
    for batch in batches:
        before.add(normalized_flops(model, batch))
    layers = {m.layer_index: m for m in routed_layers(model)}
    old = {i: m.causal_threshold for i, m in layers.items()}
    fit = calibrate_thresholds(model, batches, tolerance=tolerance)
    # every routed layer sees every token of the rows: the share a forward of the refit
    # model counts is the mean of the walk's per-layer kept fractions
    kept_after = sum(fit.kept_fraction) / len(fit.kept_fraction)
    _check_plan(fit.layer_indices, fit.kept_fraction, fit.target_ratios, tolerance,
                allow_missed_plan)  # fmt: skip
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


def _check_plan(
    indices: list[int],
    kept: list[float],
    targets: list[float],
    tolerance: float,
    allow: bool,
) -> None:
    missed = [
        f"layer {i} kept {k:.3f} against a plan of {t:.3f}"
        for i, k, t in zip(indices, kept, targets)
        if abs(k - t) > tolerance
    ]
    if not missed:
        return
    message = (
        f"the refit thresholds miss their plan by more than {tolerance:g} on "
        f"{len(missed)} routed layer(s): {'; '.join(missed)}. The text is too "
        "repetitive (tied router scores) or too unlike what the model will serve"
    )
    if not allow:
        raise InputError(
            f"{message}: nothing was written; calibrate on more varied text, or "
            "accept these thresholds (--allow-missed-plan, allow_missed_plan=True)"
        )
    logger.warning(f"{message}; written anyway (allow_missed_plan)")


def check_destination_apart(source: Path, dest: Path) -> None:
    """Refuse a destination inside the checkpoint (the copy would copy itself) or
    holding it (replacing it would delete it); the checkpoint itself is fine."""
    a, b = source.resolve(), dest.resolve()
    if a != b and (a in b.parents or b in a.parents):
        where = "inside" if a in b.parents else "a folder holding"
        raise InputError(
            f"the destination {dest} is {where} the checkpoint {source}: write the "
            "recalibrated checkpoint beside it, or onto it to replace it in place"
        )


def _write_beside(source: Path, dest: Path, sidecar_name: str, text: str) -> None:
    """``dest``: ``source``'s weight files hard-linked, its other files copied (an
    in-place edit of one must not reach the source), its sidecar replaced by
    ``text``."""
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
