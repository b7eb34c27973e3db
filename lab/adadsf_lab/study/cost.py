"""Up-front cost estimate of a study, so a heavy study can be planned over sessions.

Two sources, best first: the measured seconds of finished runs of the same study (the
cache), and otherwise a simple model whose per-token constants were measured on this
project's CPU machine the way studies run there (2 threads, SmolLM2-135M), scaled by
the model's parameter count. Alignment dominates an aligned run and its speed differs
most between hosts (by more than a factor of two between the project's 2-core
machines), so once any aligned run of this model on this device is cached, its
measured seconds per aligned token replace the model's rate for the methods that have
no finished run yet. The GPU factor is a guess until a GPU run is cached; the estimate
is printed as such.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from adadsf_lab.study.arms import Tuned, modifier_fields
from adadsf_lab.study.measure import (
    BUDGET_MODES,
    BUDGET_TEXTS,
    OTHER_TEXTS,
    budget_sizes,
)
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.plan import runs_at, runs_of, tune_runs_of
from adadsf_lab.study.settings import StudySettings

__all__ = [
    "TASK_SIZES",
    "bench_seconds",
    "cpu_align_seconds",
    "estimate_run_seconds",
    "main_job_seconds",
    "measured_align_rate",
    "method_seconds",
    "model_params",
    "per_run_estimates",
    "plan_seconds",
    "planned_task_n",
    "task_requests",
]

PerRun = dict[tuple[str, str, float], tuple[float, int]]
"""``(phase, method, budget) -> (seconds of one run there, finished runs of the method
that is the mean of)``: a budget's own alignment steps (``budget_align_steps``) price
its runs."""

# Fitted to runs on the project's 2-core CPU machine with both threads
# (OMP_NUM_THREADS=2, how the studies run there): the study caches of lab/NOTEBOOK.md
# sections 8-10 and the results study's bfloat16 runs (docs/results/runs).
_CPU_FORWARD_S_PER_TOKEN = 1.5e-3  # SmolLM2-135M prefill, fp32
_CPU_ALIGN_S_PER_TOKEN = 5.4e-3  # routers_and_layers, fp32, with the dense teacher
_CPU_ALIGN_S_PER_STEP = 3.0  # AdamW update and clipping over ~100M parameters
# A bfloat16 model's alignment against float32's: 100 steps of 8 x 512 tokens with the
# KL in chunks (829b1cc) took 2,219 s (lab/NOTEBOOK.md §26, the shipped variant) and
# 2,363 / 2,266 / 2,031 s (docs/results/runs, adadsf_w8a8's three seeds) on the 2-core
# AVX512-BF16 EPYC: 22.2 s a step, 0.87 of float32's rate here. (0.6 priced a step at
# 16.3 s, near an AMX host's 15 s of §15; AMX hosts have aligned the cheaper arms at
# 12-18 s a step, so there the estimate runs long.)
_BF16_ALIGN_FACTOR = 0.87
# Those steps are an identity skip path's. Fitted skip paths with the skipped tokens'
# keys/values (the shipped recipe) cost 1.31x as much a step: 15.6-16.5 s on an AMX
# host (lab/NOTEBOOK.md §37) against 11.9-12.9 s for the random and reversed arms there
# (docs/results/runs, budget 0.81, seeds 0-2).
_FITTED_SKIP_ALIGN_FACTOR = 1.31
_CPU_LM_EVAL_S_PER_REQUEST = 0.08  # one request per forward
_CPU_LM_EVAL_BATCHED = 0.4  # its share in batches of 8 (lab/NOTEBOOK.md §13)
_CPU_DECODE_STEP_S = {1: 0.04, 8: 0.07}
_LM_EVAL_OVERHEAD_S = 20.0
_RUN_OVERHEAD_S = 15.0  # load model, text, warm start, bookkeeping
# GPTQ W8A8 over SmolLM2 with 128 x 512 calibration tokens: adadsf_w8a8's construction
# without its alignment (777 / 723 / 677 s) less that of an arm built the same way
# without GPTQ (adadsf_lm_only: 322 / 353 / 409 s), same host and settings
# (docs/results/runs; 150 s before, a guess for 8 x 128 tokens)
_GPTQ_S = 370.0
_GPU_SPEEDUP_GUESS = 30.0
# SmolLM2-135M-Instruct, the model every constant here was measured on, as
# ``model_params`` counts it (K/V projections at full width): 147.75M, so it scales 1
_REFERENCE_PARAMS = 147_750_912.0

# The main job (``adadsf run``) beyond the constants above, measured on the same 2-core
# AVX512-BF16 EPYC in bfloat16 (lab/NOTEBOOK.md; see ``main_job_seconds``):
# a dense forward: 31-35 s over 64 x 512 tokens (benchmarks/compress_cost.py, §30, §32)
_BF16_FORWARD_S_PER_TOKEN = 1.05e-3
# building the routed model, alignment aside, per calibration token (§30.1, 128 x 512
# tokens): the calibration pass and router warm start 129 + 12 s; the skip-path walks
# 386 s, one before the alignment and one after it (its maps refitted to the trained
# layers, the thresholds fitted in it); an identity skip path fits its thresholds in
# one walk of 1.38 dense forwards (§30)
_CALIBRATION_S_PER_TOKEN = (129.0 + 12.0) / 65536
_SKIP_WALK_S_PER_TOKEN = 386.0 / 2 / 65536
_THRESHOLD_WALK_S_PER_TOKEN = 1.38 * _BF16_FORWARD_S_PER_TOKEN
# the routed model's evaluation against the dense one's: lm-eval one request a
# forward took 22.8 s against 15.7 s (§13); its perplexity and FLOPs are priced alike
_ROUTED_EVAL_FACTOR = 1.45
# evaluating a W8A8 model against the same model unquantized: adadsf_w8a8's runs spent
# 798 / 793 s after compression against adadsf_lm_only's 459 / 432 (seeds 1, 2, no
# speed benchmark in either; docs/results/runs)
_W8A8_EVAL_FACTOR = 1.8

# Validation examples shipped per task, and lm-eval requests (choices) per example.
TASK_SIZES = {
    "piqa": 1838,
    "arc_easy": 570,
    "arc_challenge": 299,
    "hellaswag": 10042,
    "winogrande": 1267,
    "openbookqa": 500,
    "boolq": 3270,
}
_TASK_CHOICES = {
    "piqa": 2,
    "arc_easy": 4,
    "arc_challenge": 4,
    "hellaswag": 4,
    "winogrande": 2,
    "openbookqa": 4,
    "boolq": 2,
}


def planned_task_n(s: StudySettings) -> dict[str, int]:
    """Examples each task will score under ``task_limit``."""
    return {t: min(s.task_limit or TASK_SIZES[t], TASK_SIZES[t]) for t in s.tasks}


def task_requests(tasks: Iterable[str], limit: int | None) -> int:
    """lm-eval requests (one per choice of each example) of ``tasks`` under ``limit``
    examples a task."""
    return sum(
        min(limit or TASK_SIZES[t], TASK_SIZES[t]) * _TASK_CHOICES[t] for t in tasks
    )


def model_params(model_path: str) -> float:
    """Approximate parameter count from ``config.json`` (the reference size if it is
    unreadable)."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
        h, n = c["hidden_size"], c["num_hidden_layers"]
        inter = c.get("intermediate_size", 4 * h)
        return float(n * (4 * h * h + 3 * h * inter) + c["vocab_size"] * h)
    except (OSError, KeyError, ValueError, TypeError):
        return _REFERENCE_PARAMS


def _cpu_align_s_per_token(s: StudySettings) -> float:
    """The model's seconds per token of an alignment step (SmolLM2-135M)."""
    bf16 = s.dtype == "bfloat16" or s.align_bf16
    return _CPU_ALIGN_S_PER_TOKEN * (_BF16_ALIGN_FACTOR if bf16 else 1.0)


def _align_tokens(s: StudySettings) -> int:
    """Tokens one aligned run trains on under ``s``."""
    return s.align_steps * s.align_batch_size * s.align_seq_len


def cpu_align_seconds(s: StudySettings, params: float) -> float:
    """The alignment budget of one run in seconds of the project's 2-core CPU (the cost
    model's rates), whatever device ran it: RESULTS.md states the budget in those
    units, so studies computed on different devices read alike."""
    scale = params / _REFERENCE_PARAMS
    tokens = _align_tokens(s)
    per_token = _cpu_align_s_per_token(s)
    return (tokens * per_token + s.align_steps * _CPU_ALIGN_S_PER_STEP) * scale


def measured_align_rate(
    cached: Iterable[dict], fingerprint: str, device: str, dtype: str
) -> float | None:
    """Seconds per aligned token (the step's optimizer update included) over the
    cached AdaDSF alignments of this model on this device in ``dtype``, or ``None``
    when there are none: the alignment rate of the host that ran them."""
    secs = tokens = 0.0
    for entry in cached:
        cfg, rec = entry.get("config", {}), entry.get("record", {})
        m = METHODS.get(cfg.get("method", ""), METHODS["dense"])
        if (
            cfg.get("model", {}).get("fingerprint") == fingerprint
            and cfg.get("device") == device
            and cfg.get("dtype") == dtype
            # routed alignments only: a dense control trains without a teacher
            and m.align
            and not m.dense_control
            and (rec.get("align_tokens") or 0) > 0
            and (rec.get("align_seconds") or 0) > 0
        ):
            secs += rec["align_seconds"]
            tokens += rec["align_tokens"]
    return secs / tokens if tokens else None


def _ftp_work(s: StudySettings, method: str, fwd: float) -> tuple[int, float]:
    """FTP's own work beyond calibration and thresholds: its router training's tokens
    (a teacher forward and a routed forward and backward per step, priced like an
    alignment's), and the seconds of a second feature pass over the calibration rows
    (probes, then scores) and of the genetic search's candidate evaluations on its
    held-out batches."""
    f = modifier_fields(s, method, s.budgets[0], 0, Tuned.from_settings(s, "cost"))
    batch = (s.calib_batch_size or 1) * s.calib_seq_len
    secs = s.calib_samples * s.calib_seq_len * fwd
    if f["schedule"] == "genetic":
        evaluations = f["ga_population"] * (f["ga_generations"] + 1)
        secs += evaluations * f["validation_batches"] * batch * fwd
    return f["train_steps"] * batch, secs


def estimate_run_seconds(
    s: StudySettings,
    phase: str,
    method: str,
    params: float,
    device: str,
    align_s_per_token: float | None = None,
) -> float:
    """Estimated wall-clock seconds of one run (see the module docstring);
    ``align_s_per_token``: a measured alignment rate on ``device`` (from
    :func:`measured_align_rate`) in place of the CPU model's."""
    scale = params / _REFERENCE_PARAMS
    fwd = _CPU_FORWARD_S_PER_TOKEN * scale
    m = METHODS[method]
    secs = _RUN_OVERHEAD_S
    window = s.ppl_max_length / max(s.ppl_stride, 1)
    # seconds of training (alignment, FTP's router training): measured on ``device``
    # where a rate is given, else the CPU model's (scaled by the GPU guess below)
    train = 0.0
    rate = align_s_per_token
    if m.allocation is not None:
        # the dense calibration pass and one layer walk (the last skip-path walk,
        # which fits the thresholds too, or the thresholds' own)
        secs += s.calib_samples * s.calib_seq_len * fwd * 2
        per_token = _cpu_align_s_per_token(s) * scale if rate is None else rate
        if m.modifier == "ftp":
            tokens, other = _ftp_work(s, method, fwd)
            secs += other
            train += tokens * per_token
        if m.quantize:
            secs += _GPTQ_S * scale
    if m.align:  # a dense control is priced like an alignment (an over-estimate)
        train += (
            cpu_align_seconds(s, params) if rate is None else _align_tokens(s) * rate
        )
    secs += s.ppl_val_tokens * window * fwd
    # FLOPs are counted over the perplexity's tokens: main runs of a routed method in
    # both routing modes, the rest in one
    flops_tokens = s.ppl_tokens if phase == "main" else s.ppl_val_tokens
    modes = 2 if phase == "main" and m.allocation is not None else 1
    secs += modes * flops_tokens * fwd
    if phase == "main":
        secs += 2 * s.ppl_tokens * window * fwd
        # perplexity and FLOPs on each text outside the calibration corpus
        secs += len(OTHER_TEXTS) * s.ppl_val_tokens * (window + 1) * fwd
        if m.allocation not in (None, "layer_drop"):  # tokens routed: the kept share
            # on each offline text, prefill and decoding (replayed to count it)
            z = budget_sizes(s.flops_seq_len)
            decode = 2 * z["prompts"] * (z["prompt_len"] + z["new_tokens"])
            secs += len(BUDGET_MODES) * len(BUDGET_TEXTS) * (z["tokens"] + decode) * fwd
        if s.tasks:
            reqs = sum(n * _TASK_CHOICES[t] for t, n in planned_task_n(s).items())
            batched = (s.task_batch_size or 8) > 1
            per_request = _CPU_LM_EVAL_S_PER_REQUEST * (
                _CPU_LM_EVAL_BATCHED if batched else 1.0
            )
            secs += _LM_EVAL_OVERHEAD_S + reqs * per_request * scale
        if s.speed and m.allocation is not None and not m.quantize:
            share = min(s.speed_seeds, s.seeds) / s.seeds
            secs += share * bench_seconds(
                params,
                (s.speed_seq_len,),
                s.speed_batch_sizes,
                s.speed_repeats,
                s.decode_prompt,
                s.decode_tokens,
                decode_repeats=max(7, s.speed_repeats),
            )
    if device == "cuda":
        secs = _RUN_OVERHEAD_S + (secs - _RUN_OVERHEAD_S) / _GPU_SPEEDUP_GUESS
        train = train if rate is not None else train / _GPU_SPEEDUP_GUESS
    return secs + train


def bench_seconds(
    params: float,
    seq_lens: Iterable[int],
    batch_sizes: Iterable[int],
    repeats: int,
    decode_prompt: int,
    decode_tokens: int,
    decode_repeats: int | None = None,
) -> float:
    """Estimated CPU seconds of timing a routed model against its dense twin (both
    run ``repeats + 1`` times, a warm-up included): a prefill per sequence length and
    batch size, and greedy decoding after a ``decode_prompt``-token prompt per batch
    size (``decode_repeats`` times, default ``repeats``)."""
    scale = params / _REFERENCE_PARAMS
    fwd = _CPU_FORWARD_S_PER_TOKEN * scale
    reps = (repeats if decode_repeats is None else decode_repeats) + 1
    secs = 10.0 * scale
    for b in batch_sizes:
        for n in seq_lens:
            secs += (repeats + 1) * 2 * b * n * fwd
        step = _CPU_DECODE_STEP_S.get(b, 0.04 + 0.005 * b) * scale
        secs += reps * 2 * (decode_prompt * b * fwd + decode_tokens * step)
    return secs


def main_job_seconds(
    params: float,
    *,
    dtype: str,
    calib_tokens: int,
    align_steps: int,
    align_tokens: int,
    fitted_skip_path: bool,
    quantized: bool,
    ppl_tokens: int,
    task_requests: int,
    bench_seq_lens: Iterable[int],
    bench_repeats: int,
    decode_tokens: int,
    ppl_window: float = 2.0,
) -> dict[str, float]:
    """Estimated seconds of each stage of ``adadsf run`` (``build``, ``alignment``,
    ``quantization``, ``eval_dense``, ``eval_compressed``, ``bench``, in the order it
    runs them) on the project's 2-core CPU, quiet, at its rates for
    ``dtype``: building the routed model from ``calib_tokens`` calibration tokens
    (``fitted_skip_path``: ridge maps, fitted again after an alignment), the
    alignment, GPTQ (``quantized``), evaluating the dense model and the compressed one
    (``ppl_tokens`` of perplexity in windows that score each token ``ppl_window``
    times, the FLOPs pass over the same tokens, ``task_requests`` lm-eval requests one
    a forward) and the speed benchmark (a quantized model's twins both quantized).

    The default job (SmolLM2, bfloat16, recipes/adadsf_w8a8.yaml) comes to about 73
    min, the alignment 47 of them; ``make main`` took 70.1 min on the quiet 2-core
    AVX512-BF16 EPYC (lab/NOTEBOOK.md §38; the alignment 44.5 of them)."""
    scale = params / _REFERENCE_PARAMS
    bf16 = dtype == "bfloat16"
    fwd = (_BF16_FORWARD_S_PER_TOKEN if bf16 else _CPU_FORWARD_S_PER_TOKEN) * scale
    # the builds were measured in bfloat16: float32's at its slower forwards
    slower = fwd / (_BF16_FORWARD_S_PER_TOKEN * scale)
    walks = (
        (2 if align_steps else 1) * _SKIP_WALK_S_PER_TOKEN
        if fitted_skip_path
        else _THRESHOLD_WALK_S_PER_TOKEN
    )
    per_token = _CALIBRATION_S_PER_TOKEN + walks
    align = _CPU_ALIGN_S_PER_TOKEN * (_BF16_ALIGN_FACTOR if bf16 else 1.0)
    align *= _FITTED_SKIP_ALIGN_FACTOR if fitted_skip_path else 1.0
    quant = _W8A8_EVAL_FACTOR if quantized else 1.0

    def evaluation(factor: float) -> float:
        work = ppl_tokens * (ppl_window + 1) * fwd  # perplexity, then the FLOPs pass
        if task_requests:
            work += task_requests * _CPU_LM_EVAL_S_PER_REQUEST * scale
        lm_eval = _LM_EVAL_OVERHEAD_S if task_requests else 0.0
        return _RUN_OVERHEAD_S + lm_eval + factor * work

    return {
        "build": _RUN_OVERHEAD_S + calib_tokens * per_token * scale * slower,
        "alignment": (align_tokens * align + align_steps * _CPU_ALIGN_S_PER_STEP)
        * scale,
        "quantization": _GPTQ_S * calib_tokens / 65536 * scale * slower
        if quantized
        else 0.0,
        "eval_dense": evaluation(1.0),
        "eval_compressed": evaluation(_ROUTED_EVAL_FACTOR * quant),
        "bench": quant
        * bench_seconds(
            params, bench_seq_lens, (1,), bench_repeats, 128, decode_tokens
        ),
    }


def _rescaled(record: dict, tokens: int) -> float:
    """A finished run's seconds with its alignment rescaled, at the rate it measured,
    to ``tokens`` aligned tokens: a method's runs of 100 steps price its 50-step ones
    (and the reverse) instead of counting as 100-step runs."""
    secs = record.get("seconds", 0.0)
    done, align = record.get("align_tokens") or 0, record.get("align_seconds") or 0.0
    return secs + align * (tokens / done - 1) if done > 0 and align > 0 else secs


def _planned(s: StudySettings) -> list[tuple[str, str, float]]:
    """Every ``(phase, method, budget)`` of the plan: the tuned methods at
    ``tune_budget``, each method at each of its main budgets."""
    tune = [("tune", m, s.tune_budget) for m in s.tune_methods]
    return tune + [("main", m, b) for m in s.methods for b in s.budgets_of(m)]


def per_run_estimates(
    s: StudySettings,
    cached: Iterable[dict],
    fingerprint: str,
    device: str,
    params: float,
) -> PerRun:
    """Seconds of one run per ``(phase, method, budget)`` of the plan, and how many
    finished runs that is the mean of: this model's finished runs of the method on
    this device in the study's dtype among the ``cached`` entries where there are any,
    each rescaled to the budget's alignment tokens (:func:`_rescaled`); 0: the cost
    model's estimate, with the alignment rate measured on this device where any
    aligned run is cached."""
    cached = list(cached)
    rate = measured_align_rate(cached, fingerprint, device, s.dtype)
    seen: dict[tuple[str, str], list[dict]] = {}
    for entry in cached:
        cfg = entry.get("config", {})
        if cfg.get("model", {}).get("fingerprint") == fingerprint and (
            (cfg.get("device"), cfg.get("dtype")) == (device, s.dtype)
        ):
            key = (cfg.get("phase"), cfg.get("method"))
            seen.setdefault(key, []).append(entry["record"])
    out = {}
    for phase, m, budget in _planned(s):
        at, done = s.at_budget(budget), seen.get((phase, m))
        tokens = _align_tokens(at) if METHODS[m].align else 0
        out[(phase, m, budget)] = (
            (sum(_rescaled(r, tokens) for r in done) / len(done), len(done))
            if done
            else (estimate_run_seconds(at, phase, m, params, device, rate), 0)
        )
    return out


def method_seconds(s: StudySettings, per_run: PerRun, method: str) -> tuple[float, int]:
    """Mean seconds of one main run of ``method`` over its budgets, weighted by their
    runs, and the finished runs that is the mean of (the plan's line per method)."""
    budgets = s.budgets_of(method)
    if not budgets:
        return 0.0, 0
    n = sum(runs_at(s, method, b) for b in budgets)
    secs = sum(runs_at(s, method, b) * per_run[("main", method, b)][0] for b in budgets)
    return secs / max(n, 1), per_run[("main", method, budgets[0])][1]


def plan_seconds(s: StudySettings, per_run: PerRun) -> float:
    """Seconds for the whole plan (cached runs included), from
    :func:`per_run_estimates`."""
    tune = [
        tune_runs_of(s, m) * per_run[("tune", m, s.tune_budget)][0]
        for m in s.tune_methods
    ]
    main = [runs_of(s, m) * method_seconds(s, per_run, m)[0] for m in s.methods]
    return sum(tune) + sum(main)
