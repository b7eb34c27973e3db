"""What the alignment stage is told and what it reports: settings, loss weights, errors.

Every setting's constraint is declared once, as an annotated type below, and used by
both the recipe fields (:class:`~adadsf_modifier.alignment.fields.AlignmentFields`,
``align_`` prefix) and the Python API (:class:`AlignmentConfig`,
:class:`AlignmentLossWeights`), so the two can never disagree and their messages are
the same. Pydantic runs the checks; the validators only word the messages (the field's
name, the rule and the value given).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from adadsf_modifier.constraints import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    constrained,
    one_of,
)

__all__ = [
    "PARALLEL_MODES",
    "TRAINABLE_SETS",
    "AlignmentConfig",
    "AlignmentDivergedError",
    "AlignmentLossWeights",
    "AlignmentReport",
    "GradClip",
    "LearningRate",
    "NonNegativeInt",
    "NonNegativeFloat",
    "Parallel",
    "PositiveInt",
    "Steps",
    "Trainable",
    "TRAINING_ROUTING",
    "TrainingRouting",
]

TRAINABLE_SETS = ("routers", "routers_and_layers")
"""``routers``: router parameters only. ``routers_and_layers``: plus the routed layers'
weights."""

PARALLEL_MODES = ("ddp", "fsdp")
"""Under ``torchrun``: ``ddp`` (DistributedDataParallel, a whole student and teacher per
rank) or ``fsdp`` (FSDP2 ``fully_shard``: both sharded over the ranks); see
:mod:`~adadsf_modifier.alignment.parallel`. One process ignores it."""


TRAINING_ROUTING = ("topk", "quantile", "rank")
"""Which tokens run each routed layer while the alignment trains. ``topk``: each row's
``K`` highest-scoring tokens (the paper). ``quantile``: the rule causal routing uses at
inference (a token runs iff its score exceeds the layer's threshold), with the threshold
re-fitted on every batch so that the layer's ratio of the batch's tokens runs; rows
then keep different counts, as they do at inference. ``rank``: rank routing's own rule
(each token against its row's earlier scores, within the band), for a model that will
be served in rank mode: training sees exactly the decisions ``generate()`` will make."""


Steps = Annotated[
    int, constrained(lambda v: v >= 0, "an integer >= 0 (0 skips the alignment stage)")
]
"""Optimizer steps, ``>= 0`` (0 skips the stage)."""
LearningRate = Annotated[
    float,
    constrained(lambda v: math.isfinite(v) and v > 0, "a finite learning rate > 0"),
]
GradClip = Annotated[
    float,
    constrained(
        lambda v: math.isfinite(v) and v >= 0,
        "a finite max gradient norm > 0, or 0 to disable clipping",
    ),
]
"""Max global gradient norm; 0 disables clipping."""
Trainable = Annotated[Literal["routers", "routers_and_layers"], one_of(TRAINABLE_SETS)]
Parallel = Annotated[Literal["ddp", "fsdp"], one_of(PARALLEL_MODES)]
TrainingRouting = Annotated[
    Literal["topk", "quantile", "rank"], one_of(TRAINING_ROUTING)
]


@dataclass(frozen=True)
class AlignmentLossWeights:
    """Weights of the three loss terms; a weight of 0 means the term is not computed.

    ``kl`` and ``hidden`` need the dense teacher, ``lm`` does not: with ``kl == hidden
    == 0`` (the paper's "LM loss only" ablation) the trainer skips the teacher's forward
    pass entirely. The one place that refuses all-zero weights (the recipe fields build
    their weights through this class).
    """

    kl: NonNegativeFloat = 1.0
    hidden: NonNegativeFloat = 1.0
    lm: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _not_all_zero(self) -> AlignmentLossWeights:
        if self.kl == 0 and self.hidden == 0 and self.lm == 0:
            raise ValueError(
                "all alignment loss weights are zero (kl = hidden = lm = 0; in a "
                "recipe: align_w_kl, align_w_hidden and align_w_lm are all 0): nothing "
                "to train; set at least one of them > 0"
            )
        return self

    @property
    def needs_teacher(self) -> bool:
        """True when a term compares against the dense teacher (KL or hidden
        alignment)."""
        return self.kl > 0 or self.hidden > 0


class AlignmentConfig(BaseModel):
    """Everything the loop needs; the modifier builds it from its ``align_*`` fields.

    :param steps: optimizer steps (0: nothing happens)
    :param lr: AdamW learning rate of the parameters routing added (routers, skip
        paths), and of the layers' own weights unless ``layer_lr`` is given
    :param layer_lr: learning rate of the decoder layers' pre-trained weights under
        ``routers_and_layers`` (``None``: ``lr``). Routers start from scratch, the
        layers are already trained: one rate rarely suits both
    :param routing: one of :data:`TRAINING_ROUTING`: which tokens run each routed layer
        while training (``quantile``: causal routing's rule, thresholds fitted per
        batch; ``rank``: rank routing's rule)
    :param batch_size: rows per step (capped at the number of rows available)
    :param seq_len: rows are truncated to their first ``seq_len`` real tokens
    :param weights: loss weights (KL, hidden alignment, causal LM)
    :param trainable: one of :data:`TRAINABLE_SETS`
    :param grad_clip: max global gradient norm; 0 or ``None``: no clipping
    :param weight_decay: AdamW weight decay
    :param seed: data order and any other randomness of the loop
    :param bf16: run forward passes under bf16 autocast (losses stay float32)
    :param gradient_checkpointing: recompute decoder layers in backward to save
        activation memory
    :param teacher_cache: compute the teacher's outputs once per row and reuse them in
        later epochs (:mod:`~adadsf_modifier.alignment.teacher_cache`)
    :param show_progress: show a tqdm bar with the running loss (on the source rank)
    :param parallel: under ``torchrun``, ``ddp`` or ``fsdp`` (:data:`PARALLEL_MODES`);
        ``batch_size`` is then per rank
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: Steps = 0
    lr: LearningRate = 3e-3
    layer_lr: LearningRate | None = None
    routing: TrainingRouting = "topk"
    batch_size: PositiveInt = 4
    seq_len: PositiveInt = 512
    weights: AlignmentLossWeights = Field(default_factory=AlignmentLossWeights)
    trainable: Trainable = "routers"
    grad_clip: GradClip | None = 1.0
    weight_decay: NonNegativeFloat = 0.0
    seed: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    teacher_cache: bool = False
    show_progress: bool = True
    parallel: Parallel = "ddp"

    @model_validator(mode="after")
    def _consistent(self) -> AlignmentConfig:
        if self.layer_lr is not None and self.trainable != "routers_and_layers":
            raise ValueError(
                f"layer_lr is set but trainable is {self.trainable!r}: the layers do "
                "not train; use routers_and_layers or drop layer_lr (in a recipe: "
                "align_layer_lr, align_trainable)"
            )
        if self.teacher_cache and self.parallel == "fsdp":
            raise ValueError(
                "teacher_cache cannot be used with parallel='fsdp' (the sharded "
                "teacher's output embedding is not called on its own); use ddp or turn "
                "it off (in a recipe: align_teacher_cache, align_parallel)"
            )
        return self


@dataclasses.dataclass
class AlignmentReport:
    """What the stage did: per-step losses (weighted total and unweighted terms), time,
    memory."""

    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)
    terms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    num_trainable: int = 0
    trainable: str = "routers"
    num_rows: int = 0
    peak_memory_mb: float = 0.0
    memory_kind: str = "peak RSS"
    teacher_batches: int | None = None  # batches the teacher ran on; None: every step

    @property
    def first_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


class AlignmentDivergedError(FloatingPointError):
    """A non-finite loss, gradient or parameter; the trainable parameters were
    restored."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
