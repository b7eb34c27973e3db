"""The alignment stage's settings (the ``align_*`` recipe fields, declared once here:
``AdaDSFModifier`` inherits them and :func:`align_model` takes them), its report and its
error."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

from loguru import logger
from pydantic import BaseModel, ConfigDict, model_validator

from adadsf_modifier.alignment.losses import LOSS_WEIGHTS, AlignmentLossWeights
from adadsf_modifier.constraints import (
    InputError,
    PositiveInt,
    constrained,
    one_of,
    refuse_booleans_as_numbers,
)


def _choice(*names: str) -> Any:
    return Annotated[Literal[names], one_of(names)]  # type: ignore[valid-type]


Steps = Annotated[
    int, constrained(lambda v: v >= 0, "an integer >= 0 (0 skips the alignment stage)")
]
LearningRate = Annotated[
    float,
    constrained(lambda v: math.isfinite(v) and v > 0, "a finite learning rate > 0"),
]
Trainable = _choice("routers", "routers_and_layers")
TrainingRouting = _choice("topk", "quantile")
AlignmentLoss = _choice(*LOSS_WEIGHTS)
Parallel = _choice("ddp", "fsdp")


#: the retired loss-weight fields and their defaults
_WEIGHT_FIELDS = {"align_w_kl": 1.0, "align_w_hidden": 1.0, "align_w_lm": 0.0}


class AlignmentConfig(BaseModel):
    """Feature-preserving alignment fine-tune, run after routing.

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      align_steps: 200        # 0 (default) skips the stage
      align_lr: 3.0e-3        # routers; ~3e-4 with routers_and_layers
      align_batch_size: 4
      align_seq_len: 256
      align_loss: kl_hidden   # or lm
      align_trainable: routers
    ```

    :param align_steps: optimizer steps; 0 skips the stage (no teacher is built)
    :param align_lr: AdamW learning rate of what routing added (routers, skip paths),
        and of the layers' own weights unless ``align_layer_lr`` is given
    :param align_layer_lr: learning rate of the decoder layers' pre-trained weights
        under ``routers_and_layers`` (fresh routers and trained layers rarely suit one
        rate)
    :param align_routing: which tokens run each routed layer while training: ``topk``
        (each row's best tokens, the paper) or ``quantile`` (a threshold re-fitted on
        each batch to the layer's ratio: the decisions ``generate()`` makes)
    :param align_batch_size: rows per step (per rank under ``torchrun``)
    :param align_seq_len: each row is cut to its first ``align_seq_len`` real tokens
    :param align_loss: ``kl_hidden`` (``KL(P_dense || P_sparse)`` plus per-layer
        hidden-state alignment against the dense teacher) or ``lm`` (the causal-LM loss
        alone, no teacher)
    :param align_trainable: ``routers`` (the pre-trained weights cannot be damaged) or
        ``routers_and_layers`` (the routed layers' weights too)
    :param align_bf16: forward passes under bf16 autocast (losses stay float32)
    :param align_gradient_checkpointing: recompute decoder layers in backward
    :param align_teacher_cache: keep the teacher's outputs per row for later epochs
        (faster steps for memory; later epochs differ from a fresh forward in the last
        bits)
    :param align_parallel: under ``torchrun``: ``ddp`` (a whole student and teacher per
        rank) or ``fsdp`` (FSDP2, both sharded); see ``docs/distributed.md``
    """

    # a misspelt field is an error, here as in the modifiers that inherit the fields
    model_config = ConfigDict(extra="forbid")

    align_steps: Steps = 0
    align_lr: LearningRate = 3e-3
    align_layer_lr: LearningRate | None = None
    align_routing: TrainingRouting = "topk"
    align_batch_size: PositiveInt = 4
    align_seq_len: PositiveInt = 512
    align_loss: AlignmentLoss = "kl_hidden"
    align_trainable: Trainable = "routers"
    align_bf16: bool = False
    align_gradient_checkpointing: bool = False
    align_teacher_cache: bool = False
    align_parallel: Parallel = "ddp"

    @model_validator(mode="before")
    @classmethod
    def _loss_from_weights(cls, data: Any) -> Any:
        """Older recipes (and older checkpoints' ``recipe.yaml``) give the loss as three
        weights: read them as the ``align_loss`` they name, refuse any other mix."""
        data = refuse_booleans_as_numbers(cls, data, cls.__name__)
        if not isinstance(data, dict) or not data.keys() & set(_WEIGHT_FIELDS):
            return data
        data = dict(data)
        given = tuple(data.pop(name, w) for name, w in _WEIGHT_FIELDS.items())
        found = [k for k, w in LOSS_WEIGHTS.items() if (w.kl, w.hidden, w.lm) == given]
        if not found or data.setdefault("align_loss", found[0]) != found[0]:
            raise InputError(
                f"align_w_kl, align_w_hidden, align_w_lm = {given} is no longer "
                "supported: the alignment loss is `align_loss: kl_hidden` (1, 1, 0) or "
                "`align_loss: lm` (0, 0, 1)"
            )
        logger.warning(
            f"align_w_kl/align_w_hidden/align_w_lm are retired: read as `align_loss: "
            f"{found[0]}`; write that in the recipe instead"
        )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlignmentConfig:
        if self.align_layer_lr is not None and self.align_trainable == "routers":
            raise ValueError(
                "align_layer_lr is set but align_trainable is 'routers': the layers do "
                "not train; use routers_and_layers or drop align_layer_lr"
            )
        if self.align_teacher_cache and self.align_parallel == "fsdp":
            raise ValueError(
                "align_teacher_cache cannot be used with align_parallel 'fsdp' (the "
                "sharded teacher's output embedding is not called on its own); use "
                "ddp or turn the cache off"
            )
        return self

    @property
    def loss_weights(self) -> AlignmentLossWeights:
        return LOSS_WEIGHTS[self.align_loss]

    @property
    def needs_teacher(self) -> bool:
        return self.align_steps > 0 and self.loss_weights.needs_teacher


@dataclasses.dataclass
class AlignmentReport:
    """What the stage did: per-step losses (weighted total, unweighted terms), time,
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
