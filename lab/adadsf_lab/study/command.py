"""``adadsf study``: the command-line face of the results study.

    adadsf study                       # the full study -> RESULTS.md, results.json
    adadsf study --quick               # one seed, small limits: a smoke test (minutes)
    adadsf study --plan                # print the runs and their estimated cost only
    adadsf study --methods adadsf,uniform --budgets 0.8 --seeds 3
    adadsf study --max-hours 5         # only runs that fit in 5 h; rerun to resume
    adadsf study --set task_limit=200 --set speed=false

:mod:`adadsf_lab.commands` wires it into ``adadsf`` with :func:`add_study_arguments`
(its options live in :mod:`~adadsf_lab.study.argv`) and :func:`run_study_command`;
``python -m adadsf_lab.study`` runs it without the rest of the CLI. Bad input
raises :class:`~adadsf_lab.study.settings.StudyInputError` (one line) before any
heavy work.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from adadsf_lab.study.argv import add_study_arguments, setting_key
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.quick import quick_settings
from adadsf_lab.study.settings import StudyInputError, StudySettings
from adadsf_modifier.constraints import first_error

__all__ = ["add_study_arguments", "build_settings", "main", "run_study_command"]


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _parse_value(key: str, raw: str) -> Any:
    field = StudySettings.model_fields[key]
    value = yaml.safe_load(raw) if raw.strip() else None
    if typing.get_origin(field.annotation) is tuple:
        if isinstance(value, str):
            value = [yaml.safe_load(v) for v in _split([value]) or []]
        elif not isinstance(value, list):
            value = [value]
    return value


def _settings_file(path: str | None) -> dict[str, Any]:
    """The settings a ``--settings`` YAML file names (checked by ``StudySettings``)."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise StudyInputError(f"--settings {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise StudyInputError(f"--settings {path}: not YAML: {err}") from err
    if not isinstance(data, dict):
        raise StudyInputError(f"--settings {path}: expected a mapping of settings")
    unknown = sorted(set(data) - set(StudySettings.model_fields))
    if unknown:
        raise StudyInputError(
            f"--settings {path}: unknown setting(s) {unknown}; --list-settings "
            "shows them"
        )
    return data


def build_settings(args: argparse.Namespace) -> StudySettings:
    """The study settings from the parsed arguments: ``--quick`` preset (or the full
    defaults), then the ``--settings`` file, ``--methods/--budgets/--seeds``, then each
    ``--set``."""
    fields: dict[str, Any] = _settings_file(getattr(args, "settings", None))
    methods = _split(args.methods)
    if methods is not None:
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise StudyInputError(
                f"unknown method(s) {unknown}; known: {', '.join(METHODS)}"
            )
        fields["methods"] = methods
    budgets = _split(args.budgets)
    if budgets is not None:
        try:
            values = [float(b) for b in budgets]
        except ValueError as err:
            raise StudyInputError(f"--budgets: not a number: {err}") from err
        bad = [b for b in values if not (0.0 < b <= 1.0)]
        if bad or not values:
            raise StudyInputError(f"--budgets: {bad or values} outside (0, 1]")
        fields["budgets"] = values
    if args.seeds is not None:
        if args.seeds < 1:
            raise StudyInputError(f"--seeds must be >= 1, got {args.seeds}")
        fields["seeds"] = args.seeds
    for item in args.overrides:
        key, sep, raw = item.partition("=")
        key = setting_key(key)
        if not sep or key not in StudySettings.model_fields:
            raise StudyInputError(
                f"--set {item!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(StudySettings.model_fields)}"
            )
        try:
            fields[key] = _parse_value(key, raw)
        except yaml.YAMLError as err:
            raise StudyInputError(f"--set {item!r}: {err}") from err
    try:
        return quick_settings(**fields) if args.quick else StudySettings(**fields)
    except ValidationError as err:
        raise StudyInputError(first_error(err)) from err


def run_study_command(args: argparse.Namespace) -> dict:
    """Entry point of ``adadsf study``: returns the results dict (or the settings with
    ``--list-settings``, the plan with ``--plan``)."""
    settings = build_settings(args)
    if args.list_settings:
        dump = settings.model_dump(mode="json")
        for k, v in dump.items():
            print(f"{k} = {v}")
        return dump
    if args.max_runs is not None and args.max_runs < 0:
        raise StudyInputError(f"--max-runs must be >= 0, got {args.max_runs}")
    if args.max_hours is not None and args.max_hours <= 0:
        raise StudyInputError(f"--max-hours must be > 0, got {args.max_hours}")
    from adadsf_lab.study.study import run_study

    words = sys.argv[1:]
    if words[:1] == ["study"]:  # `adadsf study ...`: the subcommand, not a value
        words = words[1:]
    command = getattr(args, "command_line", None) or shlex.join(
        ["adadsf", "study", *words]
    )
    return run_study(
        settings,
        args.model,
        args.output_dir,
        args.cache_dir,
        command=command,
        overwrite=args.overwrite,
        max_hours=args.max_hours,
        max_runs=args.max_runs,
        plan_only=args.plan,
        render_only=getattr(args, "render_only", False),
        keep_models=getattr(args, "keep_models", None),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m adadsf_lab.study [options]``: exit 2 with one line on bad
    input."""
    parser = argparse.ArgumentParser(
        prog="adadsf study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_study_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(
        ["adadsf", "study", *(sys.argv[1:] if argv is None else argv)]
    )
    try:
        run_study_command(args)
    except StudyInputError as err:
        print(f"adadsf study: error: {err}", file=sys.stderr)
        return 2
    return 0
