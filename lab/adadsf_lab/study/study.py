"""The study end to end: check inputs, plan, tune on validation, run (or reuse) every
run, aggregate, write ``RESULTS.md``, ``results.json`` and the plots.

Runs are cached as they finish (:mod:`.run_cache`), so the study can stop at any point
(``max_hours``, ``max_runs``, Ctrl-C) and a later invocation with the same settings
continues where it stopped; the final invocation, with nothing left to run, only
renders.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from tqdm.auto import tqdm

from adadsf_lab.study.aggregate import build_results
from adadsf_lab.study.argv import canonical_command
from adadsf_lab.study.cost import (
    cpu_align_seconds,
    method_seconds,
    model_params,
    per_run_estimates,
    plan_seconds,
    planned_task_n,
)
from adadsf_lab.study.hardware import bfloat16_warning, hardware
from adadsf_lab.study.measure import TokenStreams
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.plan import (
    Context,
    Tuned,
    count_runs,
    main_specs,
    nominal_budget_warning,
    runs_of,
)
from adadsf_lab.study.plots import PLOT_FILES, write_plots
from adadsf_lab.study.render import MARKER, render_markdown
from adadsf_lab.study.run_cache import (
    OLDER_ALGORITHM,
    RunCache,
    weights_mismatch_warning,
)
from adadsf_lab.study.runner import RunEnv, execute_run
from adadsf_lab.study.settings import StudyInputError, StudySettings
from adadsf_lab.study.spec import (
    RunSpec,
    code_versions,
    model_file_digests,
    model_fingerprint,
)
from adadsf_lab.study.stats import resolvable_task_mean_difference
from adadsf_lab.study.tuning import tune_on_validation

# Project APIs used here (one place, so a module move needs one edit).
from adadsf_modifier.algorithm_versions import ALGORITHM_VERSIONS
from adadsf_modifier.atomic import atomic_write_text
from adadsf_modifier.evaluation import calibration_dataset, resolve_model
from adadsf_modifier.utils import json_text

__all__ = ["check_output_dir", "hardware", "run_study"]

OUTPUT_FILES = ("RESULTS.md", "results.json", *PLOT_FILES)


def check_output_dir(path: Path, overwrite: bool, what: str = "output") -> Path:
    """Create ``path`` if needed and prove it writable; refuse to replace files that
    an earlier study did not write (unless ``overwrite``)."""
    if path.exists() and not path.is_dir():
        raise StudyInputError(f"{what} path exists and is not a directory: {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".adadsf_write_test"):
            pass
    except OSError as err:
        raise StudyInputError(
            f"{what} directory {path} is not writable: {err}"
        ) from err
    if what == "output" and not overwrite:
        md, js = path / "RESULTS.md", path / "results.json"
        if md.exists() and not md.read_text(errors="replace").startswith(MARKER):
            raise StudyInputError(
                f"{md} exists and was not written by `adadsf study` (use --overwrite)"
            )
        if js.exists():
            try:
                ours = json.loads(js.read_text()).get("generator") == "adadsf study"
            except (OSError, ValueError, AttributeError):
                ours = False
            if not ours:
                raise StudyInputError(
                    f"{js} exists and was not written by `adadsf study` "
                    "(use --overwrite)"
                )
    return path


def _preflight_data(s: StudySettings, tok: Any) -> None:
    """The calibration split must hold what the largest run asks for: fail now, not
    after hours of other runs."""
    try:
        calibration_dataset(tok, s.calib_samples, s.calib_seq_len, seed=0)
        aligned = any(METHODS[m].align for m in s.methods)
        steps = max([s.align_steps, *s.budget_align_steps.values()])
        if aligned and steps:
            rows = steps * s.align_batch_size
            calibration_dataset(tok, rows, s.align_seq_len, seed=0)
    except ValueError as err:
        raise StudyInputError(f"calibration data: {err}") from err


class _Runner:
    """Runs specs through the cache with one progress bar and a time/run budget."""

    def __init__(
        self, cache, env, total, deadline, max_runs, executor, origin, estimate=None
    ):
        self.cache, self.env, self.executor = cache, env, executor
        # {"command", "hardware", "model_files"}: kept with every computed run
        self.origin = origin
        self.lenient = False  # --render-only: see RunCache.get
        self.deadline, self.max_runs = deadline, max_runs
        # RunSpec -> its estimated seconds: under a deadline no run starts that would
        # not finish before it (an unfinished run is lost, not cached)
        self.estimate: Callable[[RunSpec], float] | None = estimate
        self.stopped = False  # a run was refused: the time or run budget is spent
        self.computed = self.cached = 0
        self.failed: list[str] = []
        self.pending: list[str] = []
        self.bar = tqdm(total=total, desc="study runs", unit="run")

    def _refuses(self, spec: RunSpec) -> bool:
        if self.max_runs is not None and self.computed >= self.max_runs:
            return True
        if self.deadline is None:
            return False
        needed = self.estimate(spec) if self.estimate is not None else 0.0
        return time.time() + needed > self.deadline

    def run(self, spec: RunSpec) -> dict | None:
        record = self.cache.get(spec, lenient=self.lenient)
        if record is not None:
            self.cached += 1
            self.bar.total -= 1  # the bar (and its ETA) counts runs still to compute
            self.bar.refresh()
            return record
        if self.stopped or self._refuses(spec):
            self.stopped = True  # later runs wait too: the plan's order is kept
            self.pending.append(spec.label)
            return None
        self.bar.set_postfix_str(spec.label)
        try:
            record = self.executor(spec, self.env)
        except Exception as err:  # one broken run must not lose the others
            logger.error(f"{spec.label} failed: {err}\n{traceback.format_exc()}")
            self.failed.append(f"{spec.label}: {type(err).__name__}: {err}")
            self.bar.update(1)
            return None
        record.update(self.origin)  # how and where it ran (for --render-only)
        self.cache.put(spec, record)
        record = json.loads(json_text(record))  # exactly what a later resume reads
        self.computed += 1
        self.bar.update(1)
        return record


def _reference(records: list[dict], method: str) -> Callable[[float], dict | None]:
    """The FLOPs layer removal matches at a budget: those of the ``method`` run of the
    lowest finished seed (normally seed 0: the reference runs first in each seed; if
    seed 0's failed, a later one until a resume finishes it). One run, not
    the mean of those finished so far, so every seed of layer removal removes the same
    layers whenever it runs (a moving mean gave seeds different architectures)."""

    def ref(budget: float) -> dict | None:
        rs = [
            r
            for r in records
            if r["method"] == method and r["budget"] == budget and "num_routed" in r
        ]
        if not rs:
            return None
        first = min(rs, key=lambda r: r["seed"])
        return {
            "flops": first["normalized_flops"],
            "seed": first["seed"],
            "num_layers": first["num_layers"],
            "num_routed": first["num_routed"],
        }

    return ref


def _older_algorithm(records: list[dict | None]) -> dict[str, Any]:
    """``{"runs": n, "areas": {area: [versions]}, "now": {area: version}}`` over the
    records an older plug-in computed (:data:`~adadsf_lab.study.run_cache.\
OLDER_ALGORITHM`): how many, which versions of which areas computed them, and the
    current ones; ``{}`` if none."""
    older = [r[OLDER_ALGORITHM] for r in records if r and OLDER_ALGORITHM in r]
    if not older:
        return {}
    areas: dict[str, set[int]] = {}
    for one in older:
        for area, version in one.items():
            areas.setdefault(area, set()).add(int(version))
    return {
        "runs": len(older),
        "areas": {a: sorted(v) for a, v in areas.items()},
        "now": {a: ALGORITHM_VERSIONS[a] for a in areas if a in ALGORITHM_VERSIONS},
    }


def current_supersedes_older(
    runs: list[dict],
) -> tuple[list[dict], list[dict[str, Any]]]:
    """The runs to summarise, and ``{method, budget, seed}`` of those left out: within
    one method and budget, once this plug-in has computed a run, the runs an older one
    computed are left out, so no mean, interval or paired verdict mixes two codes'
    numbers (the cell shows fewer seeds until the rest are recomputed)."""
    current = {(r["method"], r["budget"]) for r in runs if OLDER_ALGORITHM not in r}
    kept, left_out = [], []
    for r in runs:
        if OLDER_ALGORITHM in r and (r["method"], r["budget"]) in current:
            left_out.append({k: r[k] for k in ("method", "budget", "seed")})
        else:
            kept.append(r)
    return kept, left_out


def _walk(
    settings: StudySettings, ctx: Context, runner: _Runner
) -> tuple[Tuned, list, dict | None, list[dict]]:
    """Every run of the study in its order, through ``runner`` (which computes it or
    takes it from the cache): ``(tuned, tuning runs, dense run, other main runs)``."""
    tuned, tuning = tune_on_validation(settings, ctx, runner)
    dense, runs = None, []
    if tuned is None:
        runner.pending.append("all main runs (hyper-parameter tuning not finished)")
        return Tuned.from_settings(settings, "pending"), tuning, dense, runs
    for spec in main_specs(
        settings, ctx, tuned, _reference(runs, settings.flops_reference)
    ):
        record = runner.run(spec)
        if record is None:
            continue
        if spec.method == "dense":
            dense = record
        else:
            runs.append(record)
    return tuned, tuning, dense, runs


def run_study(
    settings: StudySettings,
    model: str | None,
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    **kwargs: Any,
) -> dict[str, Any]:
    """:func:`_run_study`; an output folder it created and left empty (a refused
    input, a failed render) is removed again, so a failure leaves nothing behind."""
    new = [p for p in (Path(output_dir), Path(cache_dir)) if not p.exists()]
    try:
        return _run_study(settings, model, output_dir, cache_dir, **kwargs)
    except BaseException:
        for folder in new:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise


def _run_study(
    settings: StudySettings,
    model: str | None,
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    command: str = "adadsf study",
    overwrite: bool = False,
    max_hours: float | None = None,
    max_runs: int | None = None,
    executor: Callable[[RunSpec, RunEnv], dict] = execute_run,
    plan_only: bool = False,
    render_only: bool = False,
    keep_models: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the study and write its outputs; returns ``results.json``'s
    dict, whose ``"runtime"`` counts the runs computed now and reused from the cache
    (``runs_computed`` is 0 when everything was cached). ``plan_only``: check the
    inputs, print the plan and its estimated cost, run and write nothing.
    ``render_only``: compute nothing; render the cached runs of this plan, taking the
    device and library versions (part of every run's key) from the newest cached run
    of the model, so runs computed on another machine (a GPU) render here.
    ``keep_models``: a folder that keeps each computed routed run's checkpoint
    (:class:`~adadsf_lab.study.runner.RunEnv`); no run's key depends on it."""
    t0 = time.time()
    out = check_output_dir(Path(output_dir), overwrite)
    cache_root = check_output_dir(Path(cache_dir), True, "cache")
    try:
        model_path = resolve_model(model)
    except FileNotFoundError as err:
        raise StudyInputError(str(err)) from err
    if not Path(model_path).is_dir():
        raise StudyInputError(f"model {model!r} is not a local model folder")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    _preflight_data(settings, tok)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    embedded = model is None or str(model).strip().lower() in ("smollm2", "embedded")
    name = "SmolLM2-135M-Instruct (embedded)" if embedded else Path(model_path).name
    fingerprint, versions = model_fingerprint(model_path), code_versions()
    cache = RunCache(cache_root)
    hw = hardware(device)
    if render_only:
        found = cache.computed_context(name, fingerprint)
        if found is None:
            raise StudyInputError(
                f"--render-only: no cached run of {name} in {cache_dir}"
            )
        if found[0] != fingerprint:
            logger.warning(
                f"--render-only: {cache_dir} holds no run of this machine's conversion "
                f"of {name} (fingerprint {fingerprint[:12]}); rendering the runs of "
                f"fingerprint {found[0][:12]}, as they were computed"
            )
        fingerprint, device, versions = found[:3]
        hw = found[3] or {
            "device": device,
            "summary": f"{device} (the computing machine was not recorded)",
        }
        max_runs = 0
    ctx = Context(name, fingerprint, versions, device, settings.dtype)
    counts = count_runs(settings)
    total = counts["tune"] + counts["main"]
    params = model_params(model_path)
    per_run = per_run_estimates(settings, cache, fingerprint, device, params)
    est = plan_seconds(settings, per_run)
    print(
        f"adadsf study: {total} runs ({counts['tune']} tuning on validation, "
        f"{counts['main']} main), model {name}, device {device}; estimated "
        f"{est / 3600:.2f} h of compute for all of them (runs already cached are "
        "reused, not recomputed)"
    )
    files: dict[str, str] = {}
    if not render_only:
        files = model_file_digests(model_path)
        others = cache.other_weights(name, fingerprint)
        for warning in (
            bfloat16_warning(hw, settings.dtype),
            weights_mismatch_warning(others, fingerprint, files),
            nominal_budget_warning(settings),
        ):
            if warning:
                logger.warning(warning)
    task_n = planned_task_n(settings)
    resolvable = resolvable_task_mean_difference(task_n)
    if task_n:
        print(
            f"adadsf study: lm-eval examples per task {task_n}: one comparison of "
            f"two runs resolves a difference of about {resolvable:.3f} in the mean "
            "accuracy (95%, worst case; paired seeds resolve finer)"
        )
    plan = {
        "runs": counts,
        "estimated_s": est,
        "device": device,
        "model": name,
        "task_n": task_n,
        "resolvable_task_mean_difference": resolvable,
    }
    if plan_only:
        # per method: a study spread over sessions is cut into session-sized parts
        for m in settings.methods:
            secs, measured = method_seconds(settings, per_run, m)
            source = (
                f"mean of {measured} finished run{'s' * (measured > 1)}"
                if measured
                else "cost model"
            )
            print(
                f"  {m:20s} {runs_of(settings, m):3d} runs, {secs / 3600:5.2f} h "
                f"each ({source})  ({METHODS[m].description})"
            )
        plan["per_run_s"] = {
            m: method_seconds(settings, per_run, m)[0] for m in settings.methods
        }
        # the same walk as a study's, computing nothing: which runs the cache holds
        dry = _Runner(cache, None, total, None, 0, executor, {})
        _walk(settings, ctx, dry)
        dry.bar.close()
        plan["cached"] = dry.cached
        print(
            f"adadsf study: {dry.cached} of {total} runs cached (reused as they are), "
            f"{total - dry.cached} to compute"
        )
        return {"plan": plan}
    env = RunEnv(
        model_path,
        device,
        tok,
        TokenStreams(tok),
        keep_models=None if keep_models is None else str(keep_models),
    )
    deadline = t0 + max_hours * 3600 if max_hours else None
    origin = {"command": command, "hardware": hw, "model_files": files}
    runner = _Runner(
        cache,
        env,
        total,
        deadline,
        max_runs,
        executor,
        origin,
        estimate=lambda spec: per_run[(spec.phase, spec.method, spec.budget)][0],
    )
    runner.lenient = render_only
    tuned, tuning, dense, runs = _walk(settings, ctx, runner)
    runner.bar.close()
    # what ran (provenance, runtime) counts every run; what is shown, the superseding
    shown, left_out = current_supersedes_older(runs)
    # each option once, with the value it took: wrapper scripts repeat options
    meta = {
        "command": canonical_command(command),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hw,
        "computed_by": sorted(
            {
                canonical_command(r["command"])
                for r in [dense, *runs, *tuning]
                if r and "command" in r
            }
        ),
        # {hardware summary: runs}: which machine ran what, when the study moved
        "computed_on": dict(
            Counter(
                r["hardware"]["summary"]
                for r in [dense, *runs, *tuning]
                if r and "hardware" in r
            )
        ),
        "model": {"name": name, "path": model_path, "fingerprint": ctx.fingerprint},
        "versions": ctx.versions,
        # {area: [versions that computed some shown run]} of the runs computed before
        # a bump of that area (rendered leniently), and how many such runs
        "older_algorithm": _older_algorithm([dense, *shown, *tuning]),
        "superseded": left_out,
        "runtime": {
            "this_invocation_s": time.time() - t0,
            "sum_of_runs_s": sum(
                r.get("seconds", 0.0)
                for r in ([dense] if dense else []) + runs + tuning
            ),
            "runs_total": total,
            "runs_computed": runner.computed,
            "runs_cached": runner.cached,
            "estimated_s": est,
            "align_cpu_estimate_s": cpu_align_seconds(settings, params),
        },
        "pending": runner.pending,
        "failed": runner.failed,
    }
    results = build_results(
        dense,
        shown,
        tuning,
        {k: v for k, v in tuned.__dict__.items()},
        settings.model_dump(mode="json"),
        meta,
    )
    results["runtime"]["this_invocation_s"] = time.time() - t0
    atomic_write_text(out / "results.json", json_text(results))
    write_plots(results, out)
    atomic_write_text(out / "RESULTS.md", render_markdown(results))
    print(
        f"adadsf study: {runner.computed} runs computed, {runner.cached} reused, "
        f"{len(runner.pending)} pending, {len(runner.failed)} failed; wrote "
        f"{out / 'RESULTS.md'}"
    )
    return results
