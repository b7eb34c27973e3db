"""``FTPModifier``: FTP token-wise pruning (arXiv 2412.11494) on AdaDSF's routing
machinery. Everything happens in ``on_initialize`` (as for ``AdaDSFModifier``, so that
a later GPTQ stage calibrates the routed model); the LLM's own weights are never
written."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from llmcompressor.core import State
from llmcompressor.modifiers import Modifier
from loguru import logger
from pydantic import Field, PrivateAttr, model_validator

from adadsf_modifier.checkpoint import install_save_hook
from adadsf_modifier.constraints import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
    drop_retired_fields,
    one_of,
    refuse_booleans_as_numbers,
)
from adadsf_modifier.fitting import (
    SkipPathReport,
    ThresholdReport,
    check_calibration_rows,
)
from adadsf_modifier.fitting.allocation import BudgetFields
from adadsf_modifier.fitting.skip_fields import (
    SkipPathFields,
    check_skip_path,
    configure_routed_layer,
    fit_configured_skip_paths,
    thresholds_after,
)
from adadsf_modifier.ftp.checkpoint import FTP
from adadsf_modifier.ftp.features import calibrate_features, check_probe_supported
from adadsf_modifier.ftp.router import (
    FTPLayerRouter,
    FTPRouterMLP,
    attach_context_hooks,
)
from adadsf_modifier.ftp.scheduler import (
    genetic_schedule,
    validation_loss,
)
from adadsf_modifier.ftp.trainer import (
    TRAIN_ROUTINGS,
    FTPTrainConfig,
    FTPTrainReport,
    TrainRouting,
    train_router,
)
from adadsf_modifier.recipe_checks import (
    check_recipe_keeps_routers_unquantized,
    session_recipe_of,
)
from adadsf_modifier.routing import (
    decoder_layers,
    refuse_empty_inputs,
    route_layer,
    unroute_layer,
)
from adadsf_modifier.routing.skip_path import skip_path_of
from adadsf_modifier.targeting import check_not_routed, targeted_layers
from adadsf_modifier.token_rows import check_token_rows, vocabulary_size


class FTPModifier(Modifier, BudgetFields, SkipPathFields):
    """
    FTP: each routed decoder layer runs only the tokens a shared four-feature router
    gates in; per-layer ratios come from a genetic search under the global budget.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        FTPModifier:
          retention: 0.75
          ignore: ["re:.*layers\\.0$"]
    ```

    :param retention: mean fraction of real tokens that run each routed layer
    :param min_retention: lowest ratio the scheduler may give a layer (default
        ``min(0.1, retention)``)
    :param schedule: ``genetic`` (FTP), ``uniform``, or one ratio per routed layer
    :param targets, ignore: which decoder layers to route (names, ``re:`` or classes)
    :param router_hidden_size: width of the shared MLP's hidden layer
    :param keep_last_tokens: tokens at the end of a sequence the static router keeps
    :param validation_batches: calibration batches held out (from the end) to score
        the scheduler's candidates; never used for features, training or thresholds
    :param ga_population, ga_generations, ga_mutation: the genetic search's size
    :param train_steps, lr: router training (0 steps: the router keeps its init)
    :param train_routing: which tokens run while the router trains: ``threshold``
        (FTP's gate ``s > 0``) or ``quantile`` (each layer's ratio of the batch), see
        :mod:`~adadsf_modifier.ftp.trainer`
    :param distill_weight, sparsity_weight, guide_weight, guide_steps: loss weights;
        the guide weight decays to 0 over ``guide_steps``
    :param seed: seeds the MLP's initialisation and the genetic search
    :param skip_path, skip_path_rank, skip_path_ridge, skipped_tokens_kv: what a
        skipped token gets, as for ``AdaDSFModifier``; a ``ridge`` skip path is fitted
        once the schedule is final (the router trains with it in place) and again
        after router training, never by gradient
    """

    schedule: Literal["genetic", "uniform"] | list[UnitInterval] = "genetic"
    targets: str | list[str] | None = None
    ignore: list[str] = Field(default_factory=list)
    router_hidden_size: PositiveInt = 16
    keep_last_tokens: NonNegativeInt = 4
    validation_batches: PositiveInt = 1
    ga_population: PositiveInt = 8
    ga_generations: NonNegativeInt = 4
    ga_mutation: PositiveFloat = 0.25
    train_steps: NonNegativeInt = 50
    lr: PositiveFloat = 1e-3
    train_routing: Annotated[TrainRouting, one_of(TRAIN_ROUTINGS)] = "threshold"
    distill_weight: NonNegativeFloat = 1.0
    sparsity_weight: NonNegativeFloat = 1.0
    guide_weight: NonNegativeFloat = 1.0
    guide_steps: NonNegativeInt = 10
    seed: int = 0

    _ratios: list[float] | None = PrivateAttr(default=None)
    _train: FTPTrainReport | None = PrivateAttr(default=None)
    _thresholds: ThresholdReport | None = PrivateAttr(default=None)
    _skip_path_report: SkipPathReport | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        data = refuse_booleans_as_numbers(cls, data, "FTPModifier")
        return drop_retired_fields(data, "FTPModifier")

    @model_validator(mode="after")
    def _check_fields(self) -> "FTPModifier":
        if self.schedule == "genetic" and self.ga_population < 2:
            raise ValueError(f"ga_population must be >= 2, got {self.ga_population}")
        return self

    @property
    def retention_ratios(self) -> list[float]:
        """Ratio of every decoder layer, in order (1.0: not routed)."""
        if self._ratios is None:
            raise RuntimeError("retention_ratios is available after initialization")
        return list(self._ratios)

    @property
    def train_report(self) -> FTPTrainReport | None:
        return self._train

    @property
    def threshold_report(self) -> ThresholdReport | None:
        return self._thresholds

    @property
    def skip_path_report(self) -> SkipPathReport | None:
        return self._skip_path_report

    def on_initialize(self, state: State, **kwargs: Any) -> bool:
        calib = getattr(state.data, "calib", None) if state.data is not None else None
        if calib is None:
            raise ValueError(
                "FTPModifier needs calibration data: pass `dataset=` to oneshot"
            )
        self.apply_to(state.model, list(calib))
        return True

    def apply_to(self, model: torch.nn.Module, batches: list[dict]) -> None:
        """Everything ``oneshot`` does, on ``model`` and calibration ``batches``,
        without an llm-compressor session."""
        spec, layers = decoder_layers(model)
        check_not_routed(layers, "FTPModifier")
        targeted = targeted_layers(layers, self.targets, self.ignore, "FTPModifier")
        for _, name, layer in targeted:
            check_probe_supported(layer, name)
        if isinstance(self.schedule, list) and len(self.schedule) != len(targeted):
            raise ValueError(
                f"FTPModifier: schedule lists {len(self.schedule)} ratios for "
                f"{len(targeted)} routed layers"
            )
        if not batches:
            raise ValueError("FTPModifier: the calibration set is empty (0 batches)")
        check_token_rows(batches, vocabulary_size(model), "calibration batch")
        held = self.validation_batches if self.schedule == "genetic" else 0
        if len(batches) <= held:
            raise ValueError(
                f"FTPModifier: {len(batches)} calibration batches; the genetic "
                f"schedule holds out validation_batches={held} and needs at least one "
                "more for training (more samples or a smaller batch size)"
            )
        train, val = batches[: len(batches) - held], batches[len(batches) - held :]
        recipe = session_recipe_of(self)
        check_recipe_keeps_routers_unquantized([n for _, n, _ in targeted], recipe)
        check_skip_path(self, model, [name for _, name, _ in targeted], recipe)
        check_calibration_rows([self.retention] * len(targeted), train)

        stats, max_len = calibrate_features(
            model, [m for _, _, m in targeted], train, self.seed
        )
        self._route(model, spec.cache_kwarg, targeted, stats, max_len)
        try:
            ratios = self._schedule_ratios(model, targeted, val)
            check_calibration_rows(ratios, train)
            full = [1.0] * len(layers)
            for (i, _, layer), r in zip(targeted, ratios):
                layer.retention_ratio = full[i] = float(r)
                if r >= 1.0 and skip_path_of(layer) is not None:
                    del layer.skip_path  # never used at ratio 1: none saved either
            self._ratios = full
            logger.info(
                f"FTP: routed {len(targeted)}/{len(layers)} layers, ratios "
                f"[{', '.join(f'{r:.3f}' for r in full)}]"
            )
            # the router trains with the skip paths in place
            self._skip_path_report = fit_configured_skip_paths(self, model, train)
            self._train = train_router(
                model,
                train,
                FTPTrainConfig(
                    steps=self.train_steps,
                    lr=self.lr,
                    distill_weight=self.distill_weight,
                    sparsity_weight=self.sparsity_weight,
                    guide_weight=self.guide_weight,
                    guide_steps=self.guide_steps,
                    keep_last=self.keep_last_tokens,
                    routing=self.train_routing,
                ),
            )
            # on what the trained router skips; nothing trains after this walk, so it
            # fits the causal thresholds as it goes (a walk of their own without one)
            last = fit_configured_skip_paths(self, model, train, fit_thresholds=True)
            if last is not None:
                self._skip_path_report = last
            self._thresholds = thresholds_after(model, train, last)
            # every later save_pretrained (oneshot's output_dir too) writes the sidecar
            install_save_hook(model, FTP)
            refuse_empty_inputs(model)
        except BaseException:
            self._unroute(targeted)
            raise

    def on_finalize(self, state: State, **kwargs: Any) -> bool:
        self.remove_hooks()
        return True

    def _route(self, model, cache_kwarg, targeted, stats, max_len) -> None:
        done = []
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                mlp = FTPRouterMLP(self.router_hidden_size)
            for j, ((i, _, layer), st) in enumerate(zip(targeted, stats)):
                router = FTPLayerRouter(
                    mlp,
                    st,
                    model.config.hidden_size,
                    max_len,
                    self.retention,
                    self.keep_last_tokens,
                    owner=j == 0,
                )
                route_layer(layer, router, self.retention, i, cache_kwarg, model.config)
                done.append((i, None, layer))
                configure_routed_layer(self, layer)  # skip path, skipped_tokens_kv
                attach_context_hooks(layer)
            for _, _, layer in done:
                layer.router.float()  # trained with Adam: float32 whatever the dtype
        except Exception:
            self._unroute(done)
            raise

    @staticmethod
    def _unroute(targeted) -> None:
        for _, _, layer in targeted:
            unroute_layer(layer)  # its FTP context hooks too

    def _schedule_ratios(self, model, targeted, val) -> list[float]:
        n = len(targeted)
        if isinstance(self.schedule, list):
            return [float(r) for r in self.schedule]
        if self.schedule == "uniform":
            return [self.retention] * n
        layers = [m for _, _, m in targeted]

        def evaluate(ratios: list[float]) -> float:
            for layer, r in zip(layers, ratios):
                layer.retention_ratio = float(r)
            return validation_loss(model, val)

        for layer in layers:
            layer.router.mode = "static"
        try:
            result = genetic_schedule(
                evaluate,
                n,
                self.retention,
                self.resolved_min_retention,
                population=self.ga_population,
                generations=self.ga_generations,
                mutation=self.ga_mutation,
                seed=self.seed,
            )
        finally:
            for layer in layers:
                layer.router.mode = "learned"
        logger.info(
            f"FTP scheduler: validation loss {result.uniform_loss:.4f} (uniform) -> "
            f"{result.loss:.4f} after {result.evaluations} evaluations"
        )
        return result.ratios
