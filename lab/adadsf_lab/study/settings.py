"""The study's settings: every knob of how the methods (`methods.py`) are compared.

``StudySettings`` holds everything a study can vary (methods, budgets, seeds, data and
alignment sizes, tuning grids, evaluation limits); ``adadsf study --set KEY=VALUE``
overrides any field, and pydantic validation turns bad values into one-line errors
(:class:`StudyInputError`) before any work starts.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from adadsf_lab.study.methods import METHODS
from adadsf_modifier.alignment.config import (
    Trainable,
    TrainingRouting,
)
from adadsf_modifier.cli.checks import CLIError
from adadsf_modifier.constraints import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

# The 7 lm-eval tasks (the project's offline copies; each task's validation split).
from adadsf_modifier.evaluation.lm_eval_tasks import SUPPORTED_TASKS as ALL_TASKS

__all__ = [
    "ALL_TASKS",
    "StudyInputError",
    "StudySettings",
]


class StudyInputError(CLIError, ValueError):
    """Bad study input: reported as one line before any heavy work."""


def _check_budget(b: float, what: str = "budget") -> float:
    if not (math.isfinite(b) and 0.0 < b <= 1.0):
        raise ValueError(f"{what} {b} is outside (0, 1]")
    return round(float(b), 6)


class StudySettings(BaseModel):
    """Every knob of the study. Defaults are the full study (sized for a GPU);
    :func:`~adadsf_lab.study.quick.quick_settings` shrinks them for a CPU smoke
    test. ``adadsf study --set KEY=VALUE`` overrides any field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- what runs
    methods: tuple[str, ...] = tuple(METHODS)
    budgets: tuple[float, ...] = (0.9, 0.8, 0.7)
    seeds: PositiveInt = (
        3  # seeds 0 .. seeds-1 (calibration sample, router init, data order)
    )
    w8a8_budgets: tuple[float, ...] = (0.8,)
    # A budget studied for fewer questions than the main one, with its own alignment
    # length: per budget, the methods that run there (default: every method; dense and
    # its controls run at 1.0 whatever this says) and the alignment steps every method
    # there trains for (default: align_steps). Every method at one budget still trains
    # alike, so that budget's paired comparisons stay fair; RESULTS.md gives each
    # budget's steps. E.g. {0.71: [adadsf_ridge_kv_err, uniform, layer_drop_healed]}
    # and {0.71: 50}. budget_seeds: at most this many seeds there, for every method
    # (an int) or per method (a dict; the others keep theirs), e.g. {0.91: 1} or
    # {0.71: {adadsf: 1}}: the main budget's comparisons get every seed, a secondary
    # budget fewer.
    budget_methods: dict[float, tuple[str, ...]] = Field(default_factory=dict)
    budget_align_steps: dict[float, NonNegativeInt] = Field(default_factory=dict)
    budget_seeds: dict[float, PositiveInt | dict[str, PositiveInt]] = Field(
        default_factory=dict
    )
    # Ablations answer secondary questions; with ablation_seeds they run on fewer
    # seeds (the first ones) and after the main methods, so a time-limited study
    # spends its budget on the main comparisons first.
    ablation_methods: tuple[str, ...] = (
        "adadsf_no_align",
        "adadsf_lm_only",
        "adadsf_ridge_kv_err_lm_only",
        "dense_lm",
        "dense_lm_ridge_kv_err",
        "adadsf_w8a8",
        "adadsf_ridge_kv_err_w8a8",
        "adadsf_ridge_kv_no_align",
    )
    ablation_seeds: PositiveInt | None = None  # None: every seed
    # Precision every run loads the model in (compressing, training masters stay
    # float32, evaluating, timing). bfloat16 runs forwards several times faster than
    # float32 on a CPU with bfloat16 instructions (AMX, AVX512-BF16) and much slower on
    # one without (adadsf_modifier.precision; lab/NOTEBOOK.md section 14).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # ---- calibration and AdaDSF fields (the same for every method)
    calib_samples: PositiveInt = 128
    calib_seq_len: PositiveInt = 512
    ignore: tuple[str, ...] = ("re:.*layers\\.0$",)
    temperature: PositiveFloat = (
        0.05  # replaced by the validation-split choice when tune
    )
    beta: NonNegativeFloat = 10.0
    router_hidden_size: PositiveInt = 64
    router_init_steps: PositiveInt = 100
    router_init_tokens: PositiveInt = 2048
    # ---- alignment (the same budget for every aligned method)
    align_steps: NonNegativeInt = 200
    align_batch_size: PositiveInt = 8
    align_seq_len: PositiveInt = 512
    align_lr: PositiveFloat = 3e-4  # replaced by the validation-split choice when tune
    align_trainable: Trainable = "routers_and_layers"
    # the layers' pre-trained weights at their own rate (None: align_lr)
    align_layer_lr: PositiveFloat | None = None
    align_routing: TrainingRouting = "topk"  # quantile / rank: inference's rule
    align_bf16: bool = False
    # ---- hyper-parameters chosen on the validation split (AdaDSF, tune_budget)
    tune: bool = True
    tune_budget: float = 0.8
    tune_seed: int = 0
    tune_lrs: Annotated[tuple[PositiveFloat, ...], Field(min_length=1)] = (
        1e-4,
        3e-4,
        1e-3,
    )
    tune_temperatures: Annotated[tuple[PositiveFloat, ...], Field(min_length=1)] = (
        0.25,
        0.1,
        0.05,
    )
    tune_betas: tuple[float, ...] = (10.0,)
    # learning rates of the layers' pre-trained weights tried with each of tune_lrs
    # (empty: not tuned, align_layer_lr is used)
    tune_layer_lrs: tuple[PositiveFloat, ...] = ()
    # Aligned methods whose learning rates are chosen on the validation split, each
    # for itself. The first also chooses tau and beta, and every aligned method not
    # listed trains at its rates: the same rates for every compared method (the
    # study's default rule); list a variant (e.g. adadsf_ridge_kv, whose pre-trained
    # layers want a lower rate, lab/NOTEBOOK.md section 9) to tune it on its own.
    tune_methods: Annotated[tuple[str, ...], Field(min_length=1)] = ("adadsf",)
    # Per method of tune_methods: the (align_lr, align_layer_lr) pairs its tuning tries
    # instead of tune_lrs x tune_layer_lrs (a null layer rate: align_layer_lr), e.g.
    # {adadsf_ridge_kv_err: [[1e-4, 1e-4], [1e-3, 1e-4]], uniform: [[1e-3, 1e-3]]}.
    # A later method given a single pair is not tuned: it trains at that pair, a choice
    # made on the validation split before (the doc says where). Neither is the first
    # when its pair, tune_temperatures and tune_betas all hold one value each: nothing
    # is left to choose, so no tuning run is spent.
    tune_rates: dict[str, tuple[tuple[PositiveFloat, PositiveFloat | None], ...]] = (
        Field(default_factory=dict)
    )
    # The routed method whose measured FLOPs (its lowest finished seed's run) layer
    # removal matches at each budget (when it is not among the methods: the nominal
    # budget).
    flops_reference: str = "adadsf"
    # ---- evaluation
    ppl_tokens: PositiveInt = 32768  # test split
    ppl_val_tokens: PositiveInt = 16384  # validation split
    ppl_max_length: int = 512
    ppl_stride: int = 256
    tasks: tuple[str, ...] = ALL_TASKS
    task_limit: PositiveInt | None = 1000  # examples per task (None: the whole split)
    # None: 16 on a GPU, 8 on a CPU (faster than one request per forward there, with
    # the same accuracies: lab/NOTEBOOK.md section 13)
    task_batch_size: PositiveInt | None = None
    # Rows per forward of AdaDSF's calibration passes (similarities, warm start, skip
    # paths, thresholds) and windows per forward of perplexity. None: 1 on CPU (where
    # batching gains nothing), 16 on a GPU (one row per forward leaves it mostly idle).
    calib_batch_size: PositiveInt | None = None
    ppl_batch_size: PositiveInt | None = None
    flops_batch: PositiveInt = 4
    flops_seq_len: PositiveInt = 512
    speed: bool = True
    speed_seeds: NonNegativeInt = 1  # speed is measured for the first speed_seeds seeds
    speed_seq_len: PositiveInt = 1024
    speed_batch_sizes: Annotated[tuple[PositiveInt, ...], Field(min_length=1)] = (1, 8)
    speed_repeats: PositiveInt = 3
    decode_prompt: PositiveInt = 128
    decode_tokens: PositiveInt = 32

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in v if m not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown method(s) {unknown}; known: {', '.join(METHODS)}"
            )
        if not v:
            raise ValueError(f"no method given; known: {', '.join(METHODS)}")
        return tuple(dict.fromkeys(v))

    @field_validator("ablation_methods")
    @classmethod
    def _ablations(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in v if m not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown method(s) {unknown}; known: {', '.join(METHODS)}"
            )
        return tuple(dict.fromkeys(v))

    @field_validator("tune_methods")
    @classmethod
    def _tune_methods(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        tunable = [
            k
            for k, m in METHODS.items()
            if m.align and m.modifier == "adadsf" and not m.dense_control
        ]
        for name in v:
            if name in METHODS and METHODS[name].dense_control:
                raise ValueError(
                    f"{name!r} is a dense control: it trains at the rates of the arm "
                    f"it controls ({METHODS[name].base}); tune that one"
                )
            if name not in tunable:
                raise ValueError(
                    f"{name!r} is not an aligned method; tunable: {', '.join(tunable)}"
                )
        if METHODS[v[0]].allocation == "layer_drop":
            raise ValueError(
                f"the first of tune_methods chooses tau and beta, which {v[0]!r} (no "
                "routers) does not use; put a routed method first"
            )
        return tuple(dict.fromkeys(v))

    @field_validator("flops_reference")
    @classmethod
    def _flops_reference(cls, v: str) -> str:
        routed = [
            k
            for k, m in METHODS.items()
            if m.allocation not in (None, "layer_drop") and not m.quantize
        ]
        if v not in routed:
            raise ValueError(
                f"{v!r} is not a routed method; routed: {', '.join(routed)}"
            )
        return v

    @field_validator("budgets", "w8a8_budgets")
    @classmethod
    def _budgets(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(dict.fromkeys(_check_budget(b) for b in v))

    @field_validator("budget_methods", "budget_align_steps", "budget_seeds")
    @classmethod
    def _per_budget(cls, v: dict[float, Any]) -> dict[float, Any]:
        return {_check_budget(b): x for b, x in v.items()}

    @field_validator("tune_budget")
    @classmethod
    def _tune_budget(cls, v: float) -> float:
        return _check_budget(v, "tune_budget")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in v if t not in ALL_TASKS]
        if unknown:
            raise ValueError(
                f"unknown task(s) {unknown}; known: {', '.join(ALL_TASKS)}"
            )
        return tuple(dict.fromkeys(v))

    @model_validator(mode="after")
    def _consistent(self) -> "StudySettings":
        if self.ppl_stride > self.ppl_max_length:
            raise ValueError(
                f"ppl_stride ({self.ppl_stride}) must not exceed ppl_max_length "
                f"({self.ppl_max_length})"
            )
        if self.ppl_max_length < 2:
            raise ValueError("ppl_max_length must be >= 2")
        stray = [m for m in self.tune_rates if m not in self.tune_methods]
        empty = [m for m, pairs in self.tune_rates.items() if not pairs]
        if stray or empty:
            raise ValueError(
                f"tune_rates: {stray or empty} "
                + ("are not among tune_methods" if stray else "give no rate pair")
            )
        self._check_per_budget()
        missing = [m for m in self.tune_methods[1:] if m not in self.methods]
        if self.tune and missing:
            raise ValueError(
                f"tune_methods {missing} are not among the methods: their tuning "
                "would choose rates no run uses"
            )
        return self

    def _check_per_budget(self) -> None:
        known = set(self.budgets) | set(self.w8a8_budgets)
        for name in ("budget_methods", "budget_align_steps", "budget_seeds"):
            stray = sorted(set(getattr(self, name)) - known)
            if stray:
                raise ValueError(
                    f"{name}: budget(s) {stray} are not among the budgets "
                    f"{sorted(known)}"
                )
        seeds = {
            b: list(n) for b, n in self.budget_seeds.items() if isinstance(n, dict)
        }
        for name, named in (
            ("budget_methods", self.budget_methods),
            ("budget_seeds", seeds),
        ):
            for b, methods in named.items():
                stray_m = [m for m in methods if m not in self.methods]
                if stray_m:
                    raise ValueError(
                        f"{name} at {b:g}: {stray_m} are not among the methods"
                    )
        for b, methods in seeds.items():
            idle = [m for m in methods if b not in self.budgets_of(m)]
            if idle or not methods:
                what = f"{idle} have no run there" if idle else "names no method"
                raise ValueError(f"budget_seeds at {b:g}: {what}")
        controls = [m for m in self.methods if METHODS[m].dense_control]
        if self.budget_align_steps and controls:
            raise ValueError(
                f"budget_align_steps with the dense control(s) {controls}: a control "
                "runs once, at align_steps, so it would not pair with an arm trained "
                "for other steps at those budgets"
            )

    def at_budget(self, budget: float) -> "StudySettings":
        """These settings as every run at ``budget`` uses them (its own alignment
        steps, ``budget_align_steps``)."""
        steps = self.budget_align_steps.get(round(budget, 6), self.align_steps)
        return self.model_copy(update={"align_steps": steps})

    def seeds_at(self, method: str, budget: float) -> list[int]:
        """The seeds ``method`` runs with at ``budget``: :meth:`seeds_of`, cut to
        ``budget_seeds`` there."""
        seeds, n = self.seeds_of(method), self.budget_seeds.get(round(budget, 6))
        n = n.get(method) if isinstance(n, dict) else n
        return seeds if n is None else seeds[:n]

    def budgets_of(self, method: str) -> list[float]:
        """The budgets ``method`` has main runs at: 1.0 for dense and its controls,
        else the (W8A8) budgets that ``budget_methods`` lets it run at."""
        m = METHODS[method]
        if m.allocation is None:
            return [1.0]
        budgets = self.w8a8_budgets if m.quantize else self.budgets
        return [b for b in budgets if method in self.budget_methods.get(b, (method,))]

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds))

    def seeds_of(self, method: str) -> list[int]:
        """The seeds ``method`` runs with (fewer for ablations, see
        ``ablation_seeds``)."""
        if method in self.ablation_methods and self.ablation_seeds is not None:
            return self.seed_list[: self.ablation_seeds]
        return self.seed_list
