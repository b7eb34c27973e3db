"""The results study (``adadsf study``): every compared method under the same data,
alignment budget and seeds, at several budgets, with 95% intervals and paired
differences, rendered to ``RESULTS.md`` + ``results.json`` + plots (the shipped
study's: ``docs/results/``).

Modules: :mod:`.methods` (the compared arms), :mod:`.settings` (every knob of a
study) and :mod:`.quick` (its smoke-test settings), :mod:`.arms` (each arm's modifier
fields), :mod:`.spec` (run identity and key), :mod:`.plan` (which runs, in which
order), :mod:`.tuning` (hyper-parameters chosen on validation), :mod:`.run_cache`
(finished runs on disk), :mod:`.runner` and :mod:`.measure` (one run),
:mod:`.hardware` (the machine a run was computed on), :mod:`.stats` (intervals, paired
differences), :mod:`.targets` (the quality targets met or missed),
:mod:`.task_resolution` (how finely task scores resolve), :mod:`.aggregate`
(``results.json``), :mod:`.wall_clock` (test PPL against measured speedup: frontier
and verdicts on speed), :mod:`.render` / :mod:`.plots` (Markdown, PNG), :mod:`.cost`
(up-front estimate), :mod:`.study` (orchestration), :mod:`.argv` (the options, and a
recorded command with each option once), :mod:`.command` (CLI).

The heavy modules (runner, measurements, lm-eval) load only when a study runs.
"""

from adadsf_lab.study.argv import add_study_arguments
from adadsf_lab.study.command import build_settings, run_study_command
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.quick import quick_settings
from adadsf_lab.study.settings import StudyInputError, StudySettings

__all__ = [
    "METHODS",
    "StudyInputError",
    "StudySettings",
    "add_study_arguments",
    "build_settings",
    "quick_settings",
    "run_study_command",
]
