"""What the CLI tests of the plug-in and of the lab share: calling ``adadsf``
in-process, the one-line-error rule, an evaluation record, and a way to fail a test
whose command got past its checks."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import pytest

from adadsf_modifier.cli import main

RECORD = {"label": "dense", "model": "m", "routed": False, "routing_mode": None}
"""The smallest valid ``adadsf eval`` record."""


def run(capsys, *argv) -> tuple[int, str]:
    """``adadsf ARGV...`` in this process: ``(exit status, stderr)``."""
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str) -> str:
    """``err``, checked to be the CLI's promise: exit 2, one line, no traceback."""
    assert code == 2
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    return err


def refuse_heavy_work(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: Iterable[str]
) -> None:
    """Make each of ``module``'s ``names`` fail the test when called: a command that
    reaches them got past its argument checks."""

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started before the arguments were checked")

    for name in names:
        monkeypatch.setattr(module, name, refuse)
