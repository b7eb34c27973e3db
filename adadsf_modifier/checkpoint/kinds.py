"""The kinds of checkpoint this package writes, and how to tell them apart on disk.

Both kinds are ordinary (possibly compressed-tensors) Hugging Face checkpoints plus
one sidecar file that says how to route the model again; the sidecar's name is the
kind:

* ``adadsf_config.json``: :class:`~adadsf_modifier.AdaDSFModifier`'s per-layer
  ``TokenRouter`` s (schema in :mod:`.sidecar`);
* ``ftp_routing.json``: :class:`~adadsf_modifier.FTPModifier`'s shared router
  (written and read by :mod:`adadsf_modifier.ftp.checkpoint`).

The save machinery (checks first, write into a temporary folder, read the router
tensors back, sidecar last, one rename, source rank only under ``torchrun``) is the
same for both, in :mod:`.save`; a :class:`CheckpointKind` holds the few steps that
differ. Both names live here, in the package both kinds build on, so that the save
(which must not carry another kind's stale sidecar into a new checkpoint) and the
loader (which dispatches on the sidecar) need nothing from :mod:`adadsf_modifier.ftp`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adadsf_modifier.checkpoint.sidecar import SIDECAR_NAME, AdaDSFCheckpointError

__all__ = [
    "FTP_SIDECAR_NAME",
    "LOADERS",
    "SIDECAR_NAMES",
    "CheckpointKind",
    "checkpoint_sidecar",
    "register_loader",
]

FTP_SIDECAR_NAME = "ftp_routing.json"
SIDECAR_NAMES = (SIDECAR_NAME, FTP_SIDECAR_NAME)
"""Every sidecar this package writes: a folder holding one of them is a routed
checkpoint, and a save never carries one over from the folder it replaces."""


LOADERS: dict[str, Callable[..., Any]] = {}
"""Sidecar name -> the loader that reloads a folder holding it (``path, **kwargs`` ->
routed model). A modifier package registers its own when it is imported (FTP's in
:mod:`adadsf_modifier.ftp.checkpoint`), so the generic loader dispatches without
importing the packages that build on it."""


def register_loader(sidecar: str, loader: Callable[..., Any]) -> None:
    """Make ``adadsf_modifier.from_pretrained`` reload folders holding ``sidecar``
    with ``loader``."""
    if sidecar not in SIDECAR_NAMES:
        raise ValueError(f"{sidecar!r} is not a sidecar this package writes")
    LOADERS[sidecar] = loader


@dataclass(frozen=True)
class CheckpointKind:
    """The steps of a save that differ between AdaDSF and FTP checkpoints.

    :param label: the modifier's name, for messages and logs (``"AdaDSF"``, ``"FTP"``)
    :param describe: the sidecar (the file that marks the folder a complete
        checkpoint of this kind) for a model, built and checked in memory before
        anything is written (raises on a model that cannot be saved)
    :param as_json: the sidecar as JSON data, compared across ranks under torchrun
    :param verify: reads the freshly written router tensors back from the temporary
        folder and checks them against the sidecar (present, shapes, full precision)
    :param write: writes the sidecar into the temporary folder, durably; called last
    :param summary: what was saved, for the log line
    """

    label: str
    describe: Callable[[Any], Any]
    as_json: Callable[[Any], Any]
    verify: Callable[[Path, Any], Any]
    write: Callable[[Path, Any], None]
    summary: Callable[[Any], str]


def checkpoint_sidecar(path: str | os.PathLike[str]) -> str | None:
    """The name of the sidecar ``path`` holds, so which loader reloads it; ``None``
    for anything else (a plain model folder, a hub id, a missing path).

    :raises AdaDSFCheckpointError: the folder holds both sidecars, so which routing it
        stores cannot be told (a save of this package never leaves both: each
        replaces the whole folder); or neither, while its weights hold routers (the
        sidecar was lost: loaded as a plain model it would be the dense-depth model,
        measured as if it were the routed one)
    """
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
    """Whether the folder's safetensors files name router tensors (headers only)."""
    from adadsf_modifier.checkpoint.tensors import safetensors_files

    if not any(path.glob("*.safetensors")):
        return False
    try:
        names = safetensors_files(path)
    except AdaDSFCheckpointError:
        return False  # a malformed index: the loader that reads it says so
    return any(".router." in name for name in names)
