"""Which runs a study consists of, in which order, and what each one's configuration is.

Order matters twice: the main runs use the hyper-parameters the *tune* runs chose on
the validation split, and the layer-removal runs keep as many layers as matches the
*measured* FLOPs of the AdaDSF runs at the same budget. So the main runs are produced
lazily (:func:`main_specs` is a generator that reads finished records as it goes),
while their number is known up front (:func:`count_runs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from adadsf_lab.study.arms import (
    Tuned,
    finetune_fields,
    modifier_fields,
    quantization_fields,
)
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.settings import StudySettings
from adadsf_lab.study.spec import RunSpec, algorithm_versions

__all__ = [
    "Context",
    "Tuned",
    "choose_best",
    "count_runs",
    "layer_drop_retention",
    "main_specs",
    "modifier_fields",
    "nominal_budget_warning",
    "quantization_fields",
    "runs_at",
    "runs_of",
    "single_candidate",
    "tune_specs",
]


@dataclass(frozen=True)
class Context:
    """What every run of one study shares (identity only; no loaded objects)."""

    model_name: str
    fingerprint: str
    versions: dict[str, str]
    device: str  # "cpu" or "cuda"
    dtype: str = "float32"


def _batch_size(key: str, value: int | None, ctx: Context) -> dict[str, int]:
    """``{key: n}`` for a rows-per-forward setting (None: 16 on a GPU, 1 on CPU), and
    nothing when ``n`` is 1: runs of one row per forward keep the keys they had before
    batching was configurable."""
    n = value or (16 if ctx.device == "cuda" else 1)
    return {key: n} if n != 1 else {}


def _data(s: StudySettings, seed: int, aligned: bool, ctx: Context) -> dict[str, Any]:
    return {
        "calib_samples": s.calib_samples,
        "calib_seq_len": s.calib_seq_len,
        "text_seed": seed,
        # one pass over fresh rows: steps x batch rows of align_seq_len tokens
        "align_rows": s.align_steps * s.align_batch_size if aligned else 0,
        "align_seq_len": s.align_seq_len if aligned else 0,
        **_batch_size("calib_batch_size", s.calib_batch_size, ctx),
    }


def _eval_main(s: StudySettings, ctx: Context, speed: bool) -> dict[str, Any]:
    return {
        "ppl_tokens": s.ppl_tokens,
        "ppl_val_tokens": s.ppl_val_tokens,
        "ppl_max_length": s.ppl_max_length,
        "ppl_stride": s.ppl_stride,
        "tasks": list(s.tasks),
        "task_limit": s.task_limit,
        "task_batch_size": s.task_batch_size or (16 if ctx.device == "cuda" else 8),
        "flops_batch": s.flops_batch,
        "flops_seq_len": s.flops_seq_len,
        "speed": (
            {
                "seq_len": s.speed_seq_len,
                "batch_sizes": list(s.speed_batch_sizes),
                "repeats": s.speed_repeats,
                "decode_prompt": s.decode_prompt,
                "decode_tokens": s.decode_tokens,
            }
            if speed
            else None
        ),
        **_batch_size("ppl_batch_size", s.ppl_batch_size, ctx),
    }


def _eval_tune(s: StudySettings, ctx: Context) -> dict[str, Any]:
    return {
        "ppl_val_tokens": s.ppl_val_tokens,
        "ppl_max_length": s.ppl_max_length,
        "ppl_stride": s.ppl_stride,
        "flops_batch": s.flops_batch,
        "flops_seq_len": s.flops_seq_len,
        "validation_only": True,
        **_batch_size("ppl_batch_size", s.ppl_batch_size, ctx),
    }


def _spec(
    ctx: Context,
    phase: str,
    method: str,
    budget: float,
    seed: int,
    modifier: dict | None,
    s: StudySettings,
    eval_cfg: dict,
    notes: dict | None = None,
    finetune: dict | None = None,
) -> RunSpec:
    """``finetune``: a dense control's fine-tune (:func:`finetune_fields`), in place
    of a modifier."""
    aligned = bool(modifier and modifier.get("align_steps", 0) > 0) or bool(finetune)
    trained = modifier is not None or finetune is not None
    config = {
        "model": {"name": ctx.model_name, "fingerprint": ctx.fingerprint},
        "device": ctx.device,
        "dtype": ctx.dtype,
        "versions": {
            **ctx.versions,
            "algorithm": algorithm_versions(METHODS[method].algorithm_areas),
        },
        "modifier": modifier,
        "quantization": quantization_fields() if METHODS[method].quantize else None,
        "data": _data(s, seed, aligned, ctx) if trained else None,
        "eval": eval_cfg,
    }
    if finetune is not None:  # only then: other runs' configs keep their shape
        config["finetune"] = finetune
    return RunSpec.create(phase, method, budget, seed, config, notes)


# --------------------------------------------------------------------------------------
# tuning (validation split)


def tune_specs(
    s: StudySettings,
    ctx: Context,
    best_lrs: tuple[float, float | None] | None = None,
    method: str | None = None,
    base: Tuned | None = None,
) -> list[RunSpec]:
    """Tuning runs of ``method`` (default: the first of ``tune_methods``) at
    ``tune_budget`` on the validation split.

    The first method: stage 1 (``best_lrs is None``) tries each learning rate (each
    pair of ``tune_lrs`` x ``tune_layer_lrs`` when the layers' rate is tuned) with the
    default ``temperature``/``beta``; stage 2 each (temperature, beta) with the best
    rates. A stage-2 run equal to a stage-1 run has the same key and is therefore not
    run twice. Any later method: the same rate grid with the first one's choice of
    tau and beta (``base``), one stage."""
    if not s.tune:
        return []
    s = s.at_budget(s.tune_budget)
    method = method or s.tune_methods[0]
    if best_lrs is None:
        tau, beta = (base.temperature, base.beta) if base else (s.temperature, s.beta)
        grid = [(lr, layer_lr, tau, beta) for lr, layer_lr in rate_grid(s, method)]
    else:
        grid = [(*best_lrs, t, b) for t in s.tune_temperatures for b in s.tune_betas]
    out = []
    for lr, layer_lr, tau, beta in grid:
        tuned = Tuned(lr, tau, beta, "tuning", layer_lr)
        mod = modifier_fields(s, method, s.tune_budget, s.tune_seed, tuned)
        out.append(
            _spec(
                ctx,
                "tune",
                method,
                s.tune_budget,
                s.tune_seed,
                mod,
                s,
                _eval_tune(s, ctx),
            )
        )
    return out


def rate_grid(s: StudySettings, method: str) -> list[tuple[float, float | None]]:
    """The (learning rate, layer learning rate) pairs ``method``'s tuning tries:
    its ``tune_rates`` entry, else ``tune_lrs`` x ``tune_layer_lrs``."""
    pairs = s.tune_rates.get(method)
    if pairs:
        return [tuple(p) for p in pairs]
    layer_lrs = s.tune_layer_lrs or (s.align_layer_lr,)
    return [(lr, layer_lr) for lr in s.tune_lrs for layer_lr in layer_lrs]


def fixed_rates(s: StudySettings, method: str) -> dict[str, Any] | None:
    """The rates of a later tuned method whose ``tune_rates`` entry has a single pair
    (``Tuned.per_method``'s form): it trains at them, with no tuning run (None
    otherwise)."""
    if method == s.tune_methods[0] or len(s.tune_rates.get(method, ())) != 1:
        return None
    lr, layer_lr = rate_grid(s, method)[0]
    return {"align_lr": lr, "align_layer_lr": layer_lr, "source": "fixed by tune_rates"}


def single_candidate(s: StudySettings) -> Tuned | None:
    """The first tuned method's hyper-parameters when its grids hold one candidate
    each (one rate pair, one tau, one beta): nothing to choose, so no tuning run is
    spent on it (None otherwise)."""
    grid = rate_grid(s, s.tune_methods[0])
    if len(grid) != 1 or len(s.tune_temperatures) * len(s.tune_betas) != 1:
        return None
    (lr, layer_lr), tau, beta = grid[0], s.tune_temperatures[0], s.tune_betas[0]
    return Tuned(lr, tau, beta, "the only candidate (no tuning run)", layer_lr)


def choose_best(records: list[dict]) -> dict:
    """The tune record with the lowest validation perplexity (ties: first)."""
    finite = [r for r in records if math.isfinite(r.get("ppl_val") or math.inf)]
    if not finite:
        raise RuntimeError("no tuning run finished with a finite validation perplexity")
    return min(finite, key=lambda r: r["ppl_val"])


def tune_runs_of(s: StudySettings, method: str) -> int:
    """Tuning runs of ``method``: both stages for the first of ``tune_methods``, the
    rate grid for each later one (none for a later one with fixed rates)."""
    if not s.tune or method not in s.tune_methods:
        return 0
    if method != s.tune_methods[0]:
        return 0 if fixed_rates(s, method) else len(rate_grid(s, method))
    if single_candidate(s) is not None:
        return 0
    stage2 = len(s.tune_temperatures) * len(s.tune_betas)
    default_in_grid = s.temperature in s.tune_temperatures and s.beta in s.tune_betas
    return len(rate_grid(s, method)) + stage2 - (1 if default_in_grid else 0)


def tune_count(s: StudySettings) -> int:
    """Tuning runs of the whole plan (:func:`tune_runs_of` each tuned method)."""
    return sum(tune_runs_of(s, m) for m in s.tune_methods)


# --------------------------------------------------------------------------------------
# main runs (test split)


def runs_at(s: StudySettings, method: str, budget: float) -> int:
    """Main runs of ``method`` at ``budget``: one per seed (one for dense)."""
    return 1 if method == "dense" else len(s.seeds_at(method, budget))


def runs_of(s: StudySettings, method: str) -> int:
    """Main runs of ``method``: one per budget and seed (one for dense)."""
    return sum(runs_at(s, method, b) for b in s.budgets_of(method))


def count_runs(s: StudySettings) -> dict[str, int]:
    """``{"tune": n, "main": n}`` for the whole plan (cached runs included)."""
    return {"tune": tune_count(s), "main": sum(runs_of(s, m) for m in s.methods)}


def nominal_budget_warning(s: StudySettings) -> str | None:
    """Why some layer-removal runs will keep the layers of the nominal budget, or None:
    their ``flops_reference`` does not run at that budget in this plan, so they have
    no measured FLOPs to match. Such a run is a different run (its key holds the
    retention) from the matched one a plan with the reference computes later, which
    therefore does not reuse it: say so before the hours go into it."""
    ref = s.flops_reference
    matched = s.budgets_of(ref) if ref in s.methods else []
    unmatched = sorted(
        {
            (b, m)
            for m in s.methods
            if METHODS[m].match_flops
            for b in s.budgets_of(m)
            if b not in matched
        }
    )
    if not unmatched:
        return None
    runs = ", ".join(f"{m}@{b}" for b, m in unmatched)
    return (
        f"{runs} keep the layers of the nominal budget: flops_reference "
        f"{ref} does not run at that budget in this plan, so there are "
        "no measured FLOPs to match; a study that includes it matches them and does "
        "not reuse these runs (add it to --methods to match)"
    )


def layer_drop_retention(
    target_flops: float, num_layers: int, num_routed: int
) -> tuple[float, int]:
    """Retention for ``allocation: layer_drop`` keeping the number of layers whose
    FLOPs come closest to ``target_flops`` (a fraction of the dense decoder stack).

    Layers not routed always stay; ``layer_drop`` keeps ``floor(retention *
    num_routed)`` routed layers, so ``retention = k / num_routed`` keeps exactly
    ``k``. Returns ``(retention, k)``.
    """
    fixed = num_layers - num_routed
    k = round(target_flops * num_layers) - fixed
    k = min(max(k, 1), num_routed)
    return k / num_routed, k


def main_specs(
    s: StudySettings,
    ctx: Context,
    tuned: Tuned,
    reference: Callable[[float], dict | None],
) -> Iterator[RunSpec]:
    """Main runs in priority and dependency order, so that a study stopped by its time
    budget has the most useful runs: dense; then the ``tune_budget`` comparison before
    the other budgets (descending); within a budget one seed at a time (every method of
    seed 0, then of seed 1, ...: the paired comparisons fill up evenly),
    ``flops_reference`` (AdaDSF) first in each seed (layer removal matches its
    measured FLOPs), the others in the settings' order, the ablations
    (``ablation_methods``) after the main methods' seeds.

    ``reference(budget)`` returns ``{"flops": measured normalized FLOPs of the
    lowest-seed finished ``flops_reference`` run at that budget, "seed": its seed,
    "num_layers": L, "num_routed": n}`` or None;
    without it layer removal uses the nominal budget.
    """
    methods = list(s.methods)
    if "dense" in methods:
        yield _spec(ctx, "main", "dense", 1.0, 0, None, s, _eval_main(s, ctx, False))
    order = sorted(
        (m for m in methods if m != "dense"), key=lambda m: m != s.flops_reference
    )
    budgets = sorted(
        {b for m in order for b in s.budgets_of(m)},
        key=lambda b: (b != s.tune_budget, -b),
    )
    groups = [
        [m for m in order if m not in s.ablation_methods],
        [m for m in order if m in s.ablation_methods],
    ]
    for budget in budgets:
        at = s.at_budget(budget)  # its own alignment steps (budget_align_steps)
        for group in groups:
            for i, seed in enumerate(s.seed_list):
                for method in group:
                    if budget in s.budgets_of(method) and seed in s.seeds_at(
                        method, budget
                    ):
                        yield _main_spec(
                            at, ctx, tuned, reference, method, budget, i, seed
                        )


def _main_spec(
    s: StudySettings,
    ctx: Context,
    tuned: Tuned,
    reference: Callable[[float], dict | None],
    method: str,
    budget: float,
    i: int,
    seed: int,
) -> RunSpec:
    m = METHODS[method]
    if m.dense_control:
        fields = finetune_fields(s, method, seed, tuned)
        eval_cfg = _eval_main(s, ctx, False)
        return _spec(
            ctx, "main", method, budget, seed, None, s, eval_cfg, finetune=fields
        )
    retention, notes = budget, {}
    if m.match_flops:
        ref = reference(budget)
        if ref is not None:
            retention, _ = layer_drop_retention(
                ref["flops"], ref["num_layers"], ref["num_routed"]
            )
            notes["flops_target"] = ref["flops"]
        reference = METHODS[s.flops_reference].short_label
        notes["matched_to"] = (
            f"{reference} measured FLOPs (seed {ref['seed']})"
            if ref
            else "nominal budget"
        )
    mod = modifier_fields(s, method, retention, seed, tuned)
    speed = s.speed and i < s.speed_seeds and not m.quantize
    return _spec(
        ctx, "main", method, budget, seed, mod, s, _eval_main(s, ctx, speed), notes
    )
