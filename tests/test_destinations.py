"""A destination that cannot be written (an existing file, a path under a file, a
read-only folder) is refused before any work: by ``oneshot(output_dir=...)`` before
the model loads and calibration starts, by ``adadsf compress`` / ``eval`` / ``bench``
before the model loads, in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error, refuse_heavy_work, run
from llmcompressor import oneshot
from tiny_models import save_tiny_model, tiny_tokenizer, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier.cli.commands as commands
import adadsf_modifier.destinations as destinations
import adadsf_modifier.modifier as modifier_module
from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.destinations import DestinationError, check_destination

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    path = save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "llama"), 2)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def read_only(monkeypatch):
    """Make a folder unwritable for this process: ``chmod 0o555``, or, for root (whom
    permissions do not stop), ``os.access`` denying writes there, as it does for
    everyone else on such a folder."""
    changed: list[Path] = []
    root = os.geteuid() == 0
    real_access = os.access

    def make(folder: Path) -> Path:
        folder.mkdir(exist_ok=True)
        if root:
            locked = os.path.realpath(folder)
            monkeypatch.setattr(
                destinations.os,
                "access",
                lambda p, mode, **kw: (
                    not (mode & os.W_OK and os.path.realpath(p) == locked)
                    and real_access(p, mode, **kw)
                ),
            )
        else:
            folder.chmod(0o555)
            changed.append(folder)
        return folder

    yield make
    for folder in changed:
        folder.chmod(0o755)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if oneshot loads its model or the calibration starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the destination was checked")

    monkeypatch.setattr(modifier_module, "run_calibration_batches", refuse)
    import llmcompressor.entrypoints.utils as entry_utils

    monkeypatch.setattr(entry_utils, "initialize_model_from_path", refuse)
    refuse_heavy_work(monkeypatch, commands, ("compress", "evaluate", "bench"))


def _blocker(tmp_path: Path) -> Path:
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    return blocker


def _destinations(tmp_path: Path, read_only) -> dict[str, tuple[Path, str]]:
    """Each unusable folder destination and what its refusal says."""
    blocker = _blocker(tmp_path)
    return {
        "existing_file": (blocker, "is a file, not a folder"),
        "under_a_file": (blocker / "sub", "is not a folder"),
        "read_only": (read_only(tmp_path / "ro"), "is not writable"),
        "in_a_read_only_folder": (read_only(tmp_path / "ro") / "out", "not writable"),
    }


CASES = ["existing_file", "under_a_file", "read_only", "in_a_read_only_folder"]


@pytest.mark.parametrize("case", CASES)
def test_oneshot_refuses_an_unusable_output_dir_before_any_work(
    tmp_path, dense_dir, read_only, no_work, case
):
    out, says = _destinations(tmp_path, read_only)[case]
    with pytest.raises(DestinationError, match=f"output_dir {out}.*{says}"):
        oneshot(model=str(dense_dir), recipe=[AdaDSFModifier(retention=0.6)],
                dataset=token_dataset(4, 16), num_calibration_samples=4,
                max_seq_length=16, output_dir=str(out))  # fmt: skip
    assert (tmp_path / "a_file").read_text() == "mine"


def test_oneshot_with_a_loaded_model_refuses_before_calibration(
    tmp_path, dense_dir, no_work
):
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    out = _blocker(tmp_path)
    with pytest.raises(DestinationError, match="is a file, not a folder"):
        oneshot(model=model, recipe=[AdaDSFModifier(retention=0.6)],
                dataset=token_dataset(4, 16), num_calibration_samples=4,
                max_seq_length=16, output_dir=str(out))  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_compress_refuses_an_unusable_output_dir_in_one_line(
    capsys, tmp_path, dense_dir, read_only, no_work, case
):
    out, says = _destinations(tmp_path, read_only)[case]
    err = one_line_error(
        *run(capsys, "compress", "--model", dense_dir, "--output-dir", out)
    )
    assert str(out) in err and ("not a director" in err or says in err), err


@pytest.mark.parametrize("command", ["eval", "bench"])
@pytest.mark.parametrize("case", ["read_only_folder", "under_a_file"])
def test_eval_and_bench_refuse_an_unwritable_output_in_one_line(
    capsys, tmp_path, dense_dir, read_only, no_work, command, case
):
    if case == "read_only_folder":
        out = read_only(tmp_path / "ro") / "result.json"
    else:
        out = _blocker(tmp_path) / "result.json"
    model = ["--model", dense_dir] if command == "eval" else ["--routed", dense_dir]
    err = one_line_error(*run(capsys, command, *model, "--output", out))
    assert str(out) in err


def test_a_writable_destination_passes_and_leaves_nothing_behind(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "kept").write_text("x")
    for path, kind in ((existing, "folder"), (tmp_path / "new" / "deeper", "folder"),
                       (tmp_path / "result.json", "file")):  # fmt: skip
        assert check_destination(path, kind, "out") == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert [p.name for p in existing.iterdir()] == ["kept"]
    with pytest.raises(DestinationError, match="is a folder, not a file"):
        check_destination(existing, "file", "--output")
