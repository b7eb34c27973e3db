"""The study's command line: its options, and a recorded command as a reader needs it.

:func:`add_study_arguments` declares the options of ``adadsf study`` (the ``study``
subparser of ``adadsf`` and ``python -m adadsf_lab.study`` both take them from
here). :func:`canonical_command` rewrites a recorded command with each option once:
wrapper scripts (such as ``benchmarks/gpu/study.sh``) pass their fixed arguments
first and the caller's after, so a command can name ``--methods``, ``--cache-dir`` or
one ``--set`` key several times; argparse keeps the last of each, which is what ran,
and the rewritten command shows only that, so a reader of ``RESULTS.md`` need not
work it out from a very long line.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from collections.abc import Sequence

from adadsf_lab.study.methods import METHODS

__all__ = ["add_study_arguments", "canonical_command", "setting_key", "shared_options"]

#: the option that repeats with different meanings (``action="append"``): kept per key
_SET = "--set"


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the study's options to ``parser`` (the ``study`` subparser of ``adadsf``)."""
    parser.add_argument(
        "--model",
        default=None,
        help="local model folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one seed, budget 0.8, tiny limits (~20 min on 2 CPU cores): checks "
        "the pipeline, proves nothing",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="methods to run, comma or space separated (default all: "
        f"{', '.join(METHODS)})",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=None,
        help="retention budgets in (0, 1] (default 0.9 0.8 0.7)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="number of seeds, 0..N-1 (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--cache-dir",
        default="outputs/study_cache",
        help="finished runs, one JSON per run (default outputs/study_cache)",
    )
    parser.add_argument(
        "--output-dir",
        default="outputs/study",
        help="where RESULTS.md, results.json and the plots go (default outputs/study; "
        "the shipped study's: docs/results, `make results`)",
    )
    parser.add_argument(
        "--settings",
        default=None,
        metavar="YAML",
        help="a YAML mapping of study settings (e.g. lab/shipped_study.yaml, the "
        "shipped study's), read first; --methods/--budgets/--seeds and --set "
        "override it",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any study setting (YAML value; lists comma separated), e.g. "
        "--set task_limit=200; --list-settings shows them",
    )
    parser.add_argument(
        "--max-hours",
        type=float,
        default=None,
        help="start no run that would not finish within this many hours by its "
        "estimate (the mean of its method's finished runs, else the cost model; "
        "--plan prints them); rerun later to resume",
    )
    parser.add_argument(
        "--keep-models",
        default=None,
        metavar="DIR",
        help="keep each computed routed run's checkpoint under DIR/<phase>/<method>/"
        "<run key> (about 0.3 GB a SmolLM2 run), so questions about inference alone "
        "(a routing mode, a band) reload it instead of training again",
    )
    parser.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="compute at most this many new runs in this invocation",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the run count and estimated cost, run nothing",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="compute nothing: render RESULTS.md/results.json from the cached runs "
        "(also runs computed on another machine, e.g. a GPU, with this cache)",
    )
    parser.add_argument(
        "--list-settings",
        action="store_true",
        help="print every setting with its value and exit",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace RESULTS.md / results.json not written by a study",
    )


def setting_key(raw: str) -> str:
    """The study setting a ``--set KEY=VALUE`` names: ``KEY`` stripped, ``-`` read as
    ``_`` (``--set task-limit=5`` sets ``task_limit``)."""
    return raw.strip().replace("-", "_")


@functools.cache
def _long_options() -> tuple[str, ...]:
    parser = argparse.ArgumentParser(add_help=False)
    add_study_arguments(parser)
    return tuple(o for a in parser._actions for o in a.option_strings)


def _option_name(word: str) -> str:
    """The option ``word`` names, as argparse reads it: the exact name, else the one
    option it is a unique prefix of (``--meth`` -> ``--methods``), else ``word``."""
    names = _long_options()
    if word in names:
        return word
    matches = [n for n in names if n.startswith(word)]
    return matches[0] if len(matches) == 1 else word


def canonical_command(command: str) -> str:
    """``command`` (``adadsf study ...``, shell-quoted) with each option once, at its
    first place, with the value argparse took: the last (``--set``: each setting once,
    its last value).

    Every option of ``adadsf study`` is a ``--long`` one, so a word that does not start
    with ``--`` is a value of the option before it (``--methods a b`` takes both);
    ``--opt=value`` reads as ``--opt value`` and is written back so only where the
    value starts with ``-``. A command that shell quoting cannot split is returned as
    it is.
    """
    parsed = _option_groups(command)
    if parsed is None:
        return command
    head, groups = parsed
    return shlex.join(head + [w for g in groups for w in g])


def shared_options(commands: Sequence[str]) -> tuple[str, list[str]]:
    """The words every one of ``commands`` shares (the program and each option with the
    same value, in canonical form and in the first command's order), and what each
    command adds to them, shell-quoted.

    ``RESULTS.md`` lists the invocations that computed a study's runs; they differ in a
    few options (``--methods``, ``--max-hours``) and share a dozen, so a reader sees the
    shared part once. Where a command cannot be split by shell quoting, or the commands
    run different programs, nothing is shared: the shared part is empty and each
    command is returned as it is.
    """
    parsed = [_option_groups(c) for c in commands]
    if not parsed or any(p is None or p[0] != parsed[0][0] for p in parsed):
        return "", list(commands)  # unsplittable, or other programs: nothing shared
    keyed = [(head, [shlex.join(g) for g in groups]) for head, groups in parsed]
    first_head, first_groups = keyed[0]
    common = [g for g in first_groups if all(g in groups for _, groups in keyed)]
    rest = [" ".join(g for g in groups if g not in common) for _, groups in keyed]
    return " ".join([shlex.join(first_head), *common]), rest


def _option_groups(command: str) -> tuple[list[str], list[list[str]]] | None:
    """The words before the first option, and each option of the canonical form with
    its values (``[name, value...]``; ``[name=value]`` where the value starts with
    ``-``; ``--set``: one group per setting); ``None`` when shell quoting cannot split
    ``command``."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    head: list[str] = []
    # a dict keeps a key at its first place when it is assigned again
    options: dict[str, list[str]] = {}
    sets: dict[str, str] = {}  # --set KEY=VALUE, by setting
    name: str | None = None
    for word in words:
        if word.startswith("--"):
            raw, eq, value = word.partition("=")
            name = _option_name(raw)
            if name != _SET or name not in options:
                options[name] = []
            if eq:
                _add(options, sets, name, value)
        elif name is None:
            head.append(word)
        else:
            _add(options, sets, name, word)
    groups: list[list[str]] = []
    for name, values in options.items():
        if name == _SET:
            groups += [_group(name, [value]) for value in sets.values()]
        else:
            groups.append(_group(name, values))
    return head, groups


def _group(name: str, values: list[str]) -> list[str]:
    if not values:
        return [name]  # a flag
    if values[0].startswith("-"):
        return [f"{name}={values[0]}", *values[1:]]  # else it would read as an option
    return [name, *values]


def _add(options: dict[str, list[str]], sets: dict[str, str], name: str, value: str):
    if name == _SET:
        sets[setting_key(value.partition("=")[0])] = value
    else:
        options[name].append(value)
