"""Choosing the hyper-parameters on the validation split, before any main run.

The first of ``tune_methods`` chooses its learning rates (stage 1), then tau and beta
with them (stage 2); each later method chooses its own rates with that tau and beta
(or trains at the one pair ``tune_rates`` fixes for it). Every choice is the lowest
validation perplexity; a run that fails (say, diverges) simply loses. With one
candidate in every grid of the first method there is nothing to choose, and no
tuning run is spent on it (:func:`~adadsf_lab.study.plan.single_candidate`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.plan import (
    Context,
    Tuned,
    choose_best,
    fixed_rates,
    single_candidate,
    tune_specs,
)
from adadsf_lab.study.settings import StudySettings
from adadsf_lab.study.spec import RunSpec

__all__ = ["tune_on_validation"]


class SpecRunner(Protocol):
    """What tuning needs of the study's runner: a record per spec (cached or
    computed; ``None`` when it did not finish), whether the budget stopped it, and
    the list failures go to."""

    failed: list[str]

    @property
    def stopped(self) -> bool: ...

    def run(self, spec: RunSpec) -> dict | None: ...


def tune_on_validation(
    s: StudySettings, ctx: Context, runner: SpecRunner
) -> tuple[Tuned | None, list[dict]]:
    """``(tuned, tuning records)``; ``tuned`` is ``None`` when the runs are not all
    finished (stopped by the time or run budget, or failed)."""
    if not s.tune:
        return Tuned.from_settings(s, "settings (tuning off)"), []
    records: dict[str, dict] = {}

    def run_all(specs: list[RunSpec]) -> list[dict] | None:
        """The records of ``specs`` (cached or computed); None if the runner stopped
        before all of them finished."""
        for spec in specs:
            if spec.key not in records and (r := runner.run(spec)) is not None:
                records[spec.key] = r
        if any(x.key not in records for x in specs) and runner.stopped:
            return None
        return [records[x.key] for x in specs if x.key in records]

    try:  # a failed (e.g. diverged) setting simply loses
        tuned = single_candidate(s)
        if tuned is None:
            if (stage1 := run_all(tune_specs(s, ctx))) is None:
                return None, list(records.values())
            first = choose_best(stage1)
            best_lrs = (first["align_lr"], first.get("align_layer_lr"))
            if (stage2 := run_all(tune_specs(s, ctx, best_lrs))) is None:
                return None, list(records.values())
            best = choose_best(stage2)
            lr, layer_lr = best_lrs
            tuned = Tuned(
                lr, best["temperature"], best["beta"], "validation split", layer_lr
            )
        per_method = {}
        for method in s.tune_methods[1:]:
            if (fixed := fixed_rates(s, method)) is not None:
                per_method[method] = fixed
                continue
            if (own := run_all(tune_specs(s, ctx, method=method, base=tuned))) is None:
                return None, list(records.values())
            pick = choose_best(own)
            per_method[method] = {
                "align_lr": pick["align_lr"],
                "align_layer_lr": pick.get("align_layer_lr"),
            }
    except RuntimeError as err:
        runner.failed.append(f"tuning: {err}")
        return None, list(records.values())
    return replace(tuned, per_method=_with_bases(s, per_method)), list(records.values())


def _with_bases(
    s: StudySettings, per_method: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``per_method`` plus each derived arm (a quantized arm, a dense control)
    without rates of its own at its base arm's: the pair then differs only in the
    quantization, or the routing (a base trained at the first method's rates needs no
    entry, and neither does its arm)."""
    out = dict(per_method)
    for method in s.methods:
        m = METHODS[method]
        if m.base in per_method and method not in out:
            role = "quantizes" if m.quantize else "controls"
            out[method] = {
                **per_method[m.base],
                "source": f"{METHODS[m.base].short_label}'s, the arm it {role}",
            }
    return out
