"""The shared atomic-directory helper (``adadsf_modifier.atomic``) used by checkpoint
saves and the asset cache."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from adadsf_modifier import atomic
from adadsf_modifier.atomic import (
    atomic_directory,
    give_files_folder_mode,
    make_temp_dir,
    remove_stale_temp_dirs,
)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _temp_name(dest: Path, pid: int, host: str | None = None) -> Path:
    host = host or atomic._host_tag()
    return dest.parent / f".{dest.name}.{atomic.TEMP_TAG}-{host}-{pid}-0123abcd"


def test_block_success_publishes_and_failure_keeps_the_old_folder(tmp_path):
    dest = tmp_path / "out"
    with atomic_directory(dest) as tmp:
        assert tmp.parent == tmp_path and not dest.exists()
        (tmp / "a.txt").write_text("one")
    assert (dest / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(dest) as tmp:
            (tmp / "a.txt").write_text("two")
            raise RuntimeError("boom")
    assert (dest / "a.txt").read_text() == "one"
    with atomic_directory(dest) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(os.listdir(dest)) == ["b.txt"]  # replaced, not merged
    assert os.listdir(tmp_path) == ["out"]


def test_symlink_destination_replaces_the_target_and_stays_a_link(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    with atomic_directory(real) as tmp:
        (tmp / "v").write_text("1")
    link.symlink_to(real)
    with atomic_directory(link) as tmp:
        (tmp / "v").write_text("2")
    assert link.is_symlink() and (real / "v").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_dangling_symlink_destination_creates_the_target(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "sub" / "real")
    with atomic_directory(link) as tmp:
        (tmp / "v").write_text("1")
    assert link.is_symlink() and (tmp_path / "sub" / "real" / "v").read_text() == "1"


def test_only_temp_folders_of_dead_local_writers_are_removed(tmp_path):
    dest = tmp_path / "out"
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead = _temp_name(dest, _dead_pid())
        alive = _temp_name(dest, live.pid)
        mine = make_temp_dir(dest)  # this process: maybe another thread's save
        other_host = _temp_name(dest, _dead_pid(), host="ffffffff")
        other_dest = _temp_name(tmp_path / "other", _dead_pid())
        legacy = tmp_path / f".out.{atomic.TEMP_TAG}-ab_cd123"  # no owner: unknown
        for path in (dead, alive, other_host, other_dest, legacy):
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"x" * 10)
        assert remove_stale_temp_dirs(dest) == [dead]
        assert not dead.exists()
        for path in (alive, mine, other_host, other_dest, legacy):
            assert path.exists(), path
    finally:
        live.kill()
        live.wait()
    assert remove_stale_temp_dirs(dest) == [alive]


def test_temp_folder_has_plain_mkdir_mode_or_the_destinations(tmp_path):
    previous = os.umask(0o027)
    try:
        fresh = make_temp_dir(tmp_path / "new")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o750
        existing = tmp_path / "existing"
        existing.mkdir()
        existing.chmod(0o711)
        assert stat.S_IMODE(make_temp_dir(existing).stat().st_mode) == 0o711
    finally:
        os.umask(previous)


def test_files_get_the_folder_mode_without_execute(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    folder.chmod(0o755)
    (folder / "w.safetensors").write_bytes(b"")
    (folder / "w.safetensors").chmod(0o600)
    (folder / "sub").mkdir()
    give_files_folder_mode(folder)
    assert stat.S_IMODE((folder / "w.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((folder / "sub").stat().st_mode) & 0o100  # dirs untouched


def test_publish_without_rename_exchange_still_replaces(tmp_path, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE): two renames, same result."""
    monkeypatch.setattr(atomic, "_rename_exchange", lambda a, b: False)
    dest = tmp_path / "out"
    for version in ("1", "2"):
        with atomic_directory(dest) as tmp:
            (tmp / "v").write_text(version)
    assert (dest / "v").read_text() == "2"
    assert os.listdir(tmp_path) == ["out"]
