"""Publish a directory atomically: build it in a hidden sibling, then rename it into
place, so that readers see the previous folder or the complete new one, never a
half-written model (after a crash, a SIGKILL, a full disk).

A temporary sibling is named ``.NAME.adadsf-tmp-<host hash>-<pid>-<random>``: the next
writer of the same destination removes those whose writer no longer runs on this host,
and leaves live writers' and other hosts' (a shared filesystem) alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from loguru import logger

TEMP_TAG = "adadsf-tmp"
# The previous folder moved aside where renameat2 is missing. Never removed by another
# writer: if this one dies between its two renames, it is the only copy.
_OLD_TAG = "adadsf-old"

_OWNER = re.compile(r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]+")
_LEGACY = re.compile(r"[A-Za-z0-9_]{8}")  # tempfile.mkdtemp names of earlier versions


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _prefix(dest: Path, tag: str = TEMP_TAG) -> str:
    return f".{dest.name}.{tag}-"


def resolve_destination(path: str | os.PathLike[str]) -> Path:
    """The absolute real path to write: a symbolic link (even dangling) is followed, so
    that publishing replaces its target."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def make_temp_dir(dest: Path) -> Path:
    """An empty temporary sibling of ``dest`` owned by this process, with ``dest``'s
    mode or a plain mkdir's (``mkdtemp``'s 0700 would lock out a shared cache)."""
    prefix = f"{_prefix(dest)}{_host_tag()}-{os.getpid()}-"
    for _ in range(100):
        path = dest.parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        if dest.is_dir():
            path.chmod(stat.S_IMODE(dest.stat().st_mode))
        return path
    raise FileExistsError(f"could not create a temporary folder next to {dest}")


def _owner_is_gone(owner: str) -> bool:
    """True only if the writer named by ``<host>-<pid>-<random>`` surely is gone."""
    match = _OWNER.fullmatch(owner)
    if match is None or match["host"] != _host_tag():
        return False  # not ours to judge: another host (shared filesystem) or unknown
    pid = int(match["pid"])
    if pid == os.getpid():
        return False  # another thread of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, owned by another user
        return False
    return False


def remove_stale_temp_dirs(dest: Path) -> list[Path]:
    """Remove (and return) ``dest``'s temporary siblings whose writer no longer runs (a
    killed save's full-size hidden folder)."""
    prefix = _prefix(dest)
    removed: list[Path] = []
    legacy: list[Path] = []
    try:
        entries = list(os.scandir(dest.parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        owner = entry.name[len(prefix) :]
        path = Path(entry.path)
        if _owner_is_gone(owner):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(path)
        elif _LEGACY.fullmatch(owner):
            legacy.append(path)
    if removed:
        logger.info(f"Removed {len(removed)} stale temporary folder(s) of {dest}")
    if legacy:
        logger.warning(
            f"Found temporary folder(s) of {dest} left by an earlier adadsf_modifier "
            f"version, which cannot tell whether their writer still runs: "
            f"{[str(p) for p in legacy]}; delete them if no save is running."
        )
    return removed


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False if unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p] * 2 + [ctypes.c_uint]
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(
        err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}"
    )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_dir(tmp: Path, dest: Path) -> None:
    """Put the finished folder ``tmp`` at ``dest``: an existing one is swapped
    atomically where the kernel allows, else moved aside and put back if the second
    rename fails."""
    if not dest.exists() and not dest.is_symlink():
        os.rename(tmp, dest)
    elif _rename_exchange(tmp, dest):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous folder
    else:
        old = (
            dest.parent
            / f"{_prefix(dest, _OLD_TAG)}{os.getpid()}-{secrets.token_hex(4)}"
        )
        os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dest.parent)  # persist the rename itself


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``dest`` when the block succeeds;
    if it raises (or the process dies), ``dest`` stays as it was."""
    dest = resolve_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(dest)
    tmp = make_temp_dir(dest)
    try:
        yield tmp
        publish_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one. The
    temporary file's name is unpredictable and created exclusively (a fixed name could
    be a planted symbolic link); a link at ``path`` is replaced, not followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` and fsync it: a completeness marker must not reach the disk
    before its own content."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def give_files_folder_mode(folder: Path) -> None:
    """Give every file directly in ``folder`` the folder's permissions minus execute
    (safetensors writes 0600 files, which a shared cache could not read)."""
    mode = stat.S_IMODE(folder.stat().st_mode) & 0o666
    for item in folder.iterdir():
        if item.is_file() and not item.is_symlink():
            item.chmod(mode)
