"""The kinds of checkpoint this package writes, told apart by their sidecar:
``adadsf_config.json`` or FTP's ``ftp_routing.json``. Both names and the loader
registry live here, so that the shared save and loader need nothing from
:mod:`adadsf_modifier.ftp`, which builds on this."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adadsf_modifier.checkpoint.sidecar import SIDECAR_NAME, AdaDSFCheckpointError

FTP_SIDECAR_NAME = "ftp_routing.json"
SIDECAR_NAMES = (SIDECAR_NAME, FTP_SIDECAR_NAME)

# Sidecar name -> its loader (path, **kwargs -> routed model); FTP registers its own.
LOADERS: dict[str, Callable[..., Any]] = {}


def register_loader(sidecar: str, loader: Callable[..., Any]) -> None:
    if sidecar not in SIDECAR_NAMES:
        raise ValueError(f"{sidecar!r} is not a sidecar this package writes")
    LOADERS[sidecar] = loader


@dataclass(frozen=True)
class CheckpointKind:
    """The steps of a save that differ between AdaDSF and FTP checkpoints: ``describe``
    (model -> sidecar, checked before anything is written), ``as_json`` (compared
    across ranks), ``verify`` (reads the written router tensors back), ``write`` (the
    sidecar, durably, last), ``summary`` (for the log line)."""

    label: str
    describe: Callable[[Any], Any]
    as_json: Callable[[Any], Any]
    verify: Callable[[Path, Any], Any]
    write: Callable[[Path, Any], None]
    summary: Callable[[Any], str]


def checkpoint_sidecar(path: str | os.PathLike[str]) -> str | None:
    """The name of the sidecar ``path`` holds; ``None`` for anything else (a plain
    model folder, a hub id). Both sidecars, or none while the weights hold routers (a
    lost sidecar: loaded plain it would be the dense-depth model), are refused."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = [name for name in SIDECAR_NAMES if (path / name).is_file()]
    if len(found) > 1:
        raise AdaDSFCheckpointError(
            f"{path} holds both {SIDECAR_NAME} and {FTP_SIDECAR_NAME}, so it is not "
            "clear which routing the weights belong to; delete the stale one (the "
            "older file) or save the model again"
        )
    if not found and _holds_routers(path):
        raise AdaDSFCheckpointError(
            f"{path} holds router tensors but neither {SIDECAR_NAME} nor "
            f"{FTP_SIDECAR_NAME}: its routing data is missing, so it can be loaded "
            "neither routed nor as the model it was made from; restore the sidecar or "
            "save the routed model again"
        )
    return found[0] if found else None


def _holds_routers(path: Path) -> bool:
    from adadsf_modifier.checkpoint.tensors import safetensors_files

    if not any(path.glob("*.safetensors")):
        return False
    try:
        names = safetensors_files(path)
    except AdaDSFCheckpointError:
        return False  # a malformed index: the loader that reads it says so
    return any(".router." in name for name in names)
