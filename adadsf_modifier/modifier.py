"""``AdaDSFModifier``: calibration, allocation and routing in llm-compressor's flow.

All the work happens in ``on_initialize``: llm-compressor initialises every modifier
before any pipeline runs, so a later GPTQ or SmoothQuant modifier resolves its targets
on the routed layers and calibrates on the tokens the sparse model feeds them. The
pipeline's passes run without gradients and without the lm_head, so the dense
calibration loops over ``state.data.calib`` itself (as Wanda's OWL option does).
"""

from __future__ import annotations

import math
import traceback
from typing import Any, Literal

import torch
from llmcompressor.core import State
from llmcompressor.modifiers import Modifier
from loguru import logger
from pydantic import Field, PrivateAttr, field_validator, model_validator

from adadsf_modifier import distributed
from adadsf_modifier.alignment import (
    AlignmentConfig,
    AlignmentReport,
    align_model,
    check_alignment_supported,
    check_teacher_cache_fits,
    make_teacher,
    release_memory,
    rows_read_again,
    training_rows,
)
from adadsf_modifier.checkpoint import attach_checkpoint_support
from adadsf_modifier.constraints import (
    InputError,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    drop_retired_fields,
)
from adadsf_modifier.fitting import (
    RouterRefit,
    SkipPathReport,
    ThresholdCalibrationError,
    ThresholdReport,
    check_calibration_rows,
)
from adadsf_modifier.fitting.allocation import (
    Allocation,
    BudgetFields,
    allocate,
    check_allocation,
    lowest_ratio_at_most,
)
from adadsf_modifier.fitting.calibration import (
    SimilarityAccumulator,
    run_calibration_batches,
)
from adadsf_modifier.fitting.skip_fields import (
    SkipPathFields,
    check_skip_path,
    configure_routed_layer,
    fit_configured_skip_paths,
    thresholds_after,
)
from adadsf_modifier.fitting.warm_start import WarmStartResult, warm_start_routers
from adadsf_modifier.recipe_checks import (
    check_recipe_keeps_routers_unquantized,
    session_recipe_of,
)
from adadsf_modifier.routing import (
    TokenRouter,
    decoder_layers,
    refuse_empty_inputs,
    route_layer,
    unroute_layer,
)
from adadsf_modifier.stage_clock import StageClock
from adadsf_modifier.targeting import check_not_routed, targeted_layers
from adadsf_modifier.token_rows import check_token_rows, vocabulary_size

__all__ = ["AdaDSFModifier"]


class AdaDSFModifier(Modifier, BudgetFields, AlignmentConfig, SkipPathFields):
    """
    Adaptive Depth Sparse Framework (arXiv 2607.21291): each decoder layer runs only the
    tokens a small router ranks highest; layers that change their input little get fewer
    tokens.

    Sample yaml:

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        AdaDSFModifier:
          retention: 0.8
          temperature: 0.05
          beta: 10.0
          allocation: similarity
          ignore: ["re:.*layers\\.0$"]
    ```

    :param retention: global token budget ``t`` in (0, 1]: mean fraction of real tokens
        that run each routed layer
    :param temperature: softmax temperature ``tau`` (> 0) of the similarity allocation
    :param beta: steepness (>= 0) of the similarity -> ratio sigmoid (paper: 10); 0
        gives every routed layer the same ratio (as ``allocation: uniform``)
    :param min_retention: lower clip for any routed layer's ratio; defaults to
        ``min(0.1, retention)``; must not exceed ``retention``
    :param allocation: ``similarity`` (AdaDSF), ``uniform`` (MoD), ``reversed``
        (similarity ranking inverted), ``random`` (a seeded permutation of the
        similarity ratios), ``layer_drop`` (ShortGPT: remove whole layers with the
        lowest Block Influence), or an explicit list with one ratio in (0, 1] per routed
        layer
    :param targets: which decoder layers to route, as module names, ``re:`` regexes or
        class names; ``None`` routes every decoder layer
    :param ignore: decoder layers to leave dense (names, ``re:`` regexes or class names)
    :param router_hidden_size: width of each router's hidden layer
    :param seed: seeds router initialisation and the ``random`` allocation
    :param router_init: ``similarity`` (default) fits each router, before alignment, to
        predict how much the dense layer changes each calibration token (``1 - cos``);
        ``skip_error`` (with ``skip_path: ridge``) does that, then refits each router,
        once its layer's skip path is fitted, to predict the relative error that path
        makes on each token, layer by layer on the routed model's inputs, and refits the
        path on the tokens the router then skips (``fitting.skip_fit``)
    :param router_init_steps: full-batch Adam steps of that fit
    :param router_init_tokens: calibration tokens sampled per layer for that fit
    :param skip_path*, skipped_tokens_kv: what skipped tokens get (default: nothing,
        as in the paper), see
        :class:`~adadsf_modifier.fitting.SkipPathFields`
    :param align_*: the alignment fine-tune stage, see
        :class:`~adadsf_modifier.alignment.AlignmentConfig` (``align_steps=0``, the
        default, skips it)
    :param align_dataset: the alignment's training rows (``input_ids`` [+
        ``attention_mask``], e.g. a tokenized ``datasets.Dataset``); ``None`` trains on
        the calibration data. Python API only: not written to the saved ``recipe.yaml``
    """

    temperature: PositiveFloat = 0.05
    beta: NonNegativeFloat = 10.0
    allocation: Allocation = "similarity"
    targets: str | list[str] | None = None
    ignore: list[str] = Field(default_factory=list)
    router_hidden_size: PositiveInt = 64
    seed: int = 0
    router_init: Literal["similarity", "skip_error"] = "similarity"
    router_init_steps: PositiveInt = 100
    router_init_tokens: PositiveInt = 2048
    align_dataset: Any = Field(default=None, exclude=True, repr=False)

    _similarities: list[float] | None = PrivateAttr(default=None)
    _retention_ratios: list[float] | None = PrivateAttr(default=None)
    _threshold_report: ThresholdReport | None = PrivateAttr(default=None)
    _warm_start: list[WarmStartResult] = PrivateAttr(default_factory=list)
    _accumulator: SimilarityAccumulator | None = PrivateAttr(default=None)
    _teacher: torch.nn.Module | None = PrivateAttr(default=None)
    _alignment_report: AlignmentReport | None = PrivateAttr(default=None)
    _clock: StageClock = PrivateAttr(default_factory=StageClock)
    _skip_path_report: SkipPathReport | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        if isinstance(data, dict) and "align_seed" in data:
            data = dict(data)
            if data.pop("align_seed") != data.get("seed", 0):
                raise InputError(
                    "AdaDSFModifier: `align_seed` is no longer supported (the "
                    "alignment is seeded by `seed`): remove it from the recipe"
                )
            logger.warning("AdaDSFModifier: `align_seed` is retired (`seed` seeds "
                           "the alignment); remove it from the recipe")  # fmt: skip
        # booleans given for numbers: AlignmentConfig's validator checks every field
        return drop_retired_fields(data, "AdaDSFModifier")

    @field_validator("align_dataset")
    @classmethod
    def _check_align_dataset(cls, v: Any) -> Any:
        """Refused here, not after calibration and routing."""
        if v is None:
            return v
        columns = getattr(v, "column_names", None)
        if columns is not None and "input_ids" not in columns:
            raise ValueError(
                "align_dataset needs an `input_ids` column (tokenize it first), got "
                f"{columns}"
            )
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError(
                "align_dataset must be an iterable of rows or batches with `input_ids` "
                f"(e.g. a tokenized datasets.Dataset), got {type(v).__name__}"
            )
        if hasattr(v, "__len__") and len(v) == 0:
            raise ValueError(
                "align_dataset is empty: the alignment has no row to train on"
            )
        if columns is not None and "attention_mask" in columns:
            if not any(any(mask) for mask in v["attention_mask"]):
                raise ValueError(
                    "align_dataset holds no real token: every attention_mask is all "
                    "zeros (padding only)"
                )
        return v

    # ------------------------------------------------------------------ results
    def _ready(self, value: Any, name: str) -> Any:
        if value is None:
            raise RuntimeError(
                f"{name} is available after the modifier has initialized"
            )
        return value

    @property
    def similarities(self) -> list[float]:
        """Dense input/output cosine similarity of every decoder layer, in order."""
        return list(self._ready(self._similarities, "similarities"))

    @property
    def retention_ratios(self) -> list[float]:
        """Retention ratio of every decoder layer, in order (1.0: not routed)."""
        return list(self._ready(self._retention_ratios, "retention_ratios"))

    @property
    def alignment_report(self) -> AlignmentReport | None:
        """Losses, time and memory of the alignment stage (``None`` before it ran)."""
        return self._alignment_report

    @property
    def warm_start_report(self) -> list[WarmStartResult]:
        """Per routed layer: the router warm start's fit."""
        return list(self._warm_start)

    @property
    def skip_path_report(self) -> SkipPathReport | None:
        """The last skip-path fit (``None``: identity skip path, or not fitted yet)."""
        return self._skip_path_report

    @property
    def threshold_report(self) -> ThresholdReport:
        """Causal-routing thresholds and the kept fractions they give."""
        return self._ready(self._threshold_report, "threshold_report")

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Wall-clock seconds of each construction stage, in the order they ran."""
        return dict(self._clock.seconds)

    # ------------------------------------------------------------------ lifecycle
    def on_initialize(self, state: State, **kwargs: Any) -> bool:
        model = state.model
        spec, layers = decoder_layers(model)
        targeted, calib = self._check_inputs(model, layers, state)
        clock = self._clock
        with clock.stage("calibration"):
            self._similarities = self._calibrate(model, layers, calib)
        ratios = self._allocate(targeted, len(layers), calib)
        # The alignment stage's dense teacher is the model as it is now, before routing.
        self._teacher = make_teacher(model) if self.needs_teacher else None
        self._route(model, spec.cache_kwarg, targeted, ratios)
        with clock.stage("router warm start"):
            self._warm_start_routers(model)
        aligned = self.align_steps > 0
        with clock.stage("skip paths"):
            # the last walk (nothing trains after it) fits the causal thresholds too
            last_walk = self._fit_skip_paths(
                model, calib, self._router_refit(), fit_thresholds=not aligned
            )
        if aligned:
            with clock.stage("alignment"):
                self._align(model, calib)
            last_walk = None
            # the maps fit the layers' updates: refitted when the layers trained
            if self.align_trainable != "routers":
                with clock.stage("skip paths"):
                    last_walk = self._fit_skip_paths(model, calib, fit_thresholds=True)
        with clock.stage("thresholds"):
            # those the last walk fitted, else a walk of their own
            self._threshold_report = thresholds_after(model, calib, last_walk)
        logger.info(f"AdaDSF construction: {clock.summary()}")
        # Every later save_pretrained (oneshot's output_dir included) writes the AdaDSF
        # sidecar.
        attach_checkpoint_support(model, self)
        refuse_empty_inputs(model)
        return True

    def on_finalize(self, state: State, **kwargs: Any) -> bool:
        self.remove_hooks()
        distributed.restore_logging()
        self._teacher = None
        return True

    # ------------------------------------------------------------------ steps
    def _check_inputs(self, model: torch.nn.Module, layers, state: State):
        """Refuse what can be refused before any heavy work; returns the targeted
        layers and this rank's calibration data."""
        check_not_routed(layers)
        check_alignment_supported(model, self)
        targeted = targeted_layers(layers, self.targets, self.ignore)
        check_allocation(self.allocation, self.retention, len(targeted))
        calib = getattr(state.data, "calib", None) if state.data is not None else None
        if calib is None:
            raise InputError(
                "AdaDSFModifier needs calibration data: pass `dataset=` (and a "
                "tokenizer) to oneshot"
            )
        # Under torchrun: this rank's own partition, and the same model on every rank.
        calib = distributed.setup_rank(model, calib, self.model_dump(), self.seed)
        try:
            n_batches = len(calib)
        except TypeError:
            n_batches = None
        if n_batches == 0:
            raise InputError("AdaDSFModifier: the calibration set is empty (0 batches)")
        self._check_token_rows(model, calib)
        self._check_rows_reach_the_budget(calib)
        self._check_teacher_cache(model, calib)
        recipe = session_recipe_of(self)
        names = [name for _, name, _ in targeted]
        check_recipe_keeps_routers_unquantized(names, recipe)
        check_skip_path(self, model, names, recipe, self.router_init)
        return targeted, calib

    def _allocate(self, targeted, num_layers: int, calib) -> list[float]:
        """The routed layers' ratios (every layer's, 1.0 where not routed, kept as
        ``retention_ratios``)."""
        ratios = allocate(
            self.allocation,
            [self._similarities[i] for i, _, _ in targeted],
            retention=self.retention,
            temperature=self.temperature,
            beta=self.beta,
            min_retention=self.resolved_min_retention,
            seed=self.seed,
        )
        check_calibration_rows(ratios, calib)
        full = [1.0] * num_layers
        for (i, _, _), r in zip(targeted, ratios):
            full[i] = r
        self._retention_ratios = full
        return ratios

    def _fit_skip_paths(
        self,
        model: torch.nn.Module,
        calib,
        refit: RouterRefit | None = None,
        fit_thresholds: bool = False,
    ) -> SkipPathReport | None:
        """Fit the ridge skip paths (``None`` for the identity); with
        ``fit_thresholds``, the causal thresholds in the same walk."""
        report = fit_configured_skip_paths(
            self, model, calib, refit_routers=refit, fit_thresholds=fit_thresholds
        )
        if report is not None:
            self._skip_path_report = report
        return report

    def _calibrate(self, model: torch.nn.Module, layers, calib) -> list[float]:
        acc = SimilarityAccumulator(len(layers), self.router_init_tokens, self.seed)
        self._accumulator = acc
        # The base model skips the lm_head: calibration needs hidden states only. A
        # shuffling DataLoader draws its order from the global RNG: seed it so the
        # router warm start's token sample (and so the routers) depend on `seed` only.
        with acc.capturing([layer for _, layer in layers]):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                run_calibration_batches(model.base_model, calib)
        acc.all_reduce()  # under torchrun: sums and counts over every rank's data
        sims = acc.similarities()
        logger.info(
            f"AdaDSF calibration: {acc.num_tokens} real tokens, similarities "
            f"[{', '.join(f'{s:.3f}' for s in sims)}]"
        )
        return sims

    def _check_token_rows(self, model: torch.nn.Module, calib) -> None:
        """Token ids inside the vocabulary and masks as long as their ids (calibration
        and ``align_dataset``), checked now rather than an ``IndexError`` later; every
        rank agrees to fail."""
        vocab = vocabulary_size(model)
        distributed.agree_on_errors(
            lambda: check_token_rows(calib, vocab, "calibration batch")
        )
        if self.align_steps > 0 and self.align_dataset is not None:
            distributed.agree_on_errors(
                lambda: check_token_rows(self.align_dataset, vocab, "align_dataset row")
            )

    def _check_rows_reach_the_budget(self, calib) -> None:
        """Refuse, before the dense calibration, a budget whose lowest known ratio
        (the allocated ones are checked again after allocation) the rows cannot
        reach."""
        lowest = lowest_ratio_at_most(self.allocation, self.retention)
        if lowest is None:
            return
        try:
            check_calibration_rows([lowest], calib)
        except ThresholdCalibrationError as err:
            raise ThresholdCalibrationError(
                f"AdaDSFModifier: retention={self.retention:g} with allocation "
                f"{self.allocation!r} is too small for this calibration data (refused "
                f"before calibration): {err}"
            ) from None

    def _check_teacher_cache(self, model: torch.nn.Module, calib) -> None:
        """``align_teacher_cache``: its memory, checked before any heavy work."""
        if not (self.align_teacher_cache and self.needs_teacher):
            return
        data = self.align_dataset if self.align_dataset is not None else calib
        # a shuffling loader draws its order from the global RNG: leave it untouched,
        # so a later stage of the recipe sees the order it would without the cache
        with torch.random.fork_rng(devices=[]):
            rows = training_rows(data, self.align_seq_len)
        if not rows_read_again(len(rows), self.align_steps, self.align_batch_size):
            return  # one pass over the rows: the trainer says so and builds no cache
        need_hidden = self.loss_weights.hidden > 0
        device = next(model.parameters()).device
        check_teacher_cache_fits(model, rows, need_hidden, device)

    def _align(self, model: torch.nn.Module, calib) -> None:
        """Alignment fine-tune (``align_steps > 0``); always frees the teacher."""
        try:
            if self.align_steps > 0:
                data = self.align_dataset if self.align_dataset is not None else calib
                self._alignment_report = align_model(
                    model, self._teacher, data, self, seed=self.seed
                )
        except BaseException as err:
            # The traceback's finished frames still reference the teacher: clear their
            # locals so a failed stage does not keep a second copy of the model alive.
            traceback.clear_frames(err.__traceback__)
            raise
        finally:
            if self._teacher is not None:
                self._teacher = None
                release_memory()

    def _warm_start_routers(self, model) -> None:
        acc, self._accumulator = self._accumulator, None
        results = warm_start_routers(
            model, acc.local_sample, self.router_init_steps, self.seed
        )
        self._warm_start = results
        if results:
            # Samples under 8 tokens have no held-out split (NaN correlation).
            corrs = [c for r in results if math.isfinite(c := r.heldout_rank_corr)]
            corr = sum(corrs) / len(corrs) if corrs else float("nan")
            logger.info(
                f"AdaDSF router warm start: {len(results)} routers fit to per-token "
                f"similarity; mean held-out rank correlation {corr:.3f}"
            )

    def _router_refit(self) -> RouterRefit | None:
        """``router_init: skip_error``: how the skip-path fit refits the routers."""
        if self.router_init != "skip_error":
            return None
        return RouterRefit(self.router_init_tokens, self.router_init_steps, self.seed)

    def _route(self, model, cache_kwarg: str, targeted, ratios: list[float]) -> None:
        hidden = model.config.hidden_size
        done: list[torch.nn.Module] = []
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                for (i, name, layer), r in zip(targeted, ratios):
                    router = TokenRouter(hidden, self.router_hidden_size)
                    route_layer(layer, router, r, i, cache_kwarg, model.config)
                    configure_routed_layer(self, layer)
                    done.append(layer)
        except Exception:
            for layer in done:
                unroute_layer(layer)
            raise
        full = self._retention_ratios
        allocation = self.allocation
        logger.info(
            f"AdaDSF: routed {len(targeted)}/{len(full)} decoder layers, allocation="
            f"{allocation if isinstance(allocation, str) else 'explicit'}, mean ratio "
            f"{sum(ratios) / len(ratios):.4f}, ratios "
            f"[{', '.join(f'{r:.3f}' for r in full)}]"
        )
