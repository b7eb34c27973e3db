"""A study command as a reader needs it: each option once, with the value it took.

Wrapper scripts (``benchmarks/pinned_study.sh`` and the study scripts built on it) pass
their fixed arguments first and the caller's after, so a recorded command can name
``--methods``, ``--cache-dir`` or one ``--set`` key several times; argparse keeps the
last of each, which is what ran, but a reader of ``RESULTS.md`` has to work that out
from lines a thousand characters long. :func:`canonical_command` writes the same
command with each option at its first place and its last value (``--set``: each key
once, its last value), so that equal configurations also read alike.
"""

from __future__ import annotations

import shlex

__all__ = ["canonical_command"]

#: options that may repeat with different meanings (``action="append"``): kept per key
_APPEND = "--set"


def canonical_command(command: str) -> str:
    """``command`` (``adadsf study ...``, shell-quoted) with each ``--option`` once.

    Every option of ``adadsf study`` is a ``--long`` one, so a word that does not start
    with ``--`` is a value of the option before it (``--methods a b`` takes both).
    ``--opt=value`` reads as ``--opt value``. A command that shell quoting cannot split
    is returned as it is.
    """
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    head: list[str] = []
    # a dict keeps a key at its first place when it is assigned again: first place,
    # last value
    options: dict[str, list[str]] = {}
    sets: dict[str, str] = {}  # --set KEY=VALUE, by KEY
    name: str | None = None
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            if name != _APPEND or name not in options:
                options[name] = []
            if eq:
                _add(options, sets, name, value)
        elif name is None:
            head.append(word)
        else:
            _add(options, sets, name, word)
    out = list(head)
    for name, values in options.items():
        if name == _APPEND:
            for value in sets.values():
                out += [_APPEND, value]
        else:
            out += [name, *values]
    return " ".join(shlex.quote(w) for w in out)


def _add(options: dict[str, list[str]], sets: dict[str, str], name: str, value: str):
    if name == _APPEND:
        sets[value.partition("=")[0]] = value
    else:
        options[name].append(value)
