"""Where an output goes, checked before the (minutes to hours of) work that produces
it. Outputs are written through a temporary sibling renamed into place, so the folder
above (or the nearest existing one) must be writable, and so must an existing folder it
replaces. Writability is tried, not guessed: a file created exclusively catches what
``os.access`` misses (read-only mounts for root, network filesystems).

:func:`install` wraps ``Oneshot.__init__`` (llmcompressor 0.14 gives its modifiers
neither the output folder nor a hook before its work) to check ``output_dir`` before
the model loads and, once it has, to refuse a recipe that would quantize a routed
model's routers.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.atomic import resolve_destination
from adadsf_modifier.constraints import InputError
from adadsf_modifier.recipe_checks import check_routed_model_keeps_routing
from adadsf_modifier.routing import RoutedLayer
from adadsf_modifier.routing.skip_path import skip_path_of

_MARK = "_adadsf_checks_output_dir"


class DestinationError(InputError):
    """An output cannot be written where the user asked for it."""


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(folder: Path, shown: str, what: str) -> None:
    reason = "no write permission"
    if os.access(folder, os.W_OK | os.X_OK):
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".adadsf-write-check.")
        except OSError as err:
            reason = err.strerror or str(err)
        else:
            os.close(fd)
            os.unlink(probe)
            return
    raise DestinationError(
        f"{what} {shown} cannot be written: {folder} is not writable ({reason})"
    )


def check_destination(
    path: str | os.PathLike[str], kind: Literal["folder", "file"], what: str
) -> Path:
    """Refuse ``path`` as the destination of a ``kind`` output unless it can be written
    the way this package writes it (a folder's symbolic link is judged by its target, a
    file's link is replaced); ``what`` names the option in messages."""
    shown = os.fspath(path)
    dest = (
        resolve_destination(path) if kind == "folder" else Path(os.path.abspath(path))
    )
    if kind == "folder" and dest.exists() and not dest.is_dir():
        raise DestinationError(f"{what} {shown} is a file, not a folder")
    if kind == "file" and dest.is_dir():
        raise DestinationError(f"{what} {shown} is a folder, not a file")
    parent = _nearest_existing(dest.parent)
    if not parent.is_dir():
        raise DestinationError(
            f"{what} {shown} cannot be created: {parent} is not a folder"
        )
    _check_writable(parent, shown, what)
    if kind == "folder" and dest.is_dir():
        _check_writable(dest, shown, what)
    return Path(path)


def _check_output_dir(output_dir: Any) -> None:
    """On the rank that saves; every rank fails with it (else the others would wait in
    their first collective)."""

    def check() -> None:
        if distributed.is_source_process():
            check_destination(output_dir, "folder", "output_dir")

    distributed.agree_on_errors(check)


def _check_routed_model(model: Any, recipe: Any) -> None:
    """Found here: the recipe checks cannot import the routing, which imports them."""
    if not isinstance(model, nn.Module) or recipe is None:
        return
    routed = [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedLayer)]
    skips = [s for _, m in routed if (s := skip_path_of(m)) is not None]
    check_routed_model_keeps_routing(
        model, recipe, [n for n, _ in routed], skips[0] if skips else None
    )


def install() -> None:
    from llmcompressor.entrypoints.oneshot import Oneshot

    if getattr(Oneshot.__init__, _MARK, False):
        return
    original = Oneshot.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("output_dir") is not None:
            _check_output_dir(kwargs["output_dir"])
        original(self, *args, **kwargs)
        _check_routed_model(self.model, self.recipe)

    setattr(__init__, _MARK, True)
    Oneshot.__init__ = __init__
