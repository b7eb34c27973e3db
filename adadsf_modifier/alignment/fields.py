"""``align_*`` recipe fields: a pydantic mixin that
:class:`~adadsf_modifier.AdaDSFModifier` inherits.

Kept out of the modifier so the alignment stage's knobs, defaults and validation live
next to the code that uses them; the modifier only adds ``AlignmentFields`` to its
bases. The mixin declares no ``model_config``, so the modifier keeps llm-compressor's
``extra="forbid"`` (unknown YAML keys such as a misspelt ``align_step`` still raise).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from adadsf_modifier.alignment.config import (
    AlignmentConfig,
    AlignmentLossWeights,
    GradClip,
    LearningRate,
    NonNegativeFloat,
    Parallel,
    PositiveInt,
    Steps,
    Trainable,
    TrainingRouting,
)

__all__ = ["AlignmentFields"]


class AlignmentFields(BaseModel):
    """Feature-preserving alignment fine-tune, run after routing.

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      align_steps: 200        # 0 (default) skips the stage
      align_lr: 3.0e-3        # routers; ~3e-4 with routers_and_layers
      align_batch_size: 4
      align_seq_len: 256
      align_w_kl: 1.0         # KL(P_dense || P_sparse)
      align_w_hidden: 1.0     # per-layer softmax(h) L2 alignment
      align_w_lm: 0.0         # causal LM ("LM loss only": w_kl=0, w_hidden=0, w_lm=1)
      align_trainable: routers
    ```

    :param align_steps: optimizer steps; 0 skips the stage (no teacher is built)
    :param align_lr: AdamW learning rate. The default suits ``routers``;
        ``routers_and_layers`` wants about 10x less (SmolLM2-135M sweep: 3e-4), or
        ``align_layer_lr``
    :param align_layer_lr: learning rate of the decoder layers' pre-trained weights
        under ``routers_and_layers`` (routers and skip paths keep ``align_lr``); unset:
        ``align_lr`` for both
    :param align_routing: which tokens run each routed layer while training: ``topk``
        (each row's highest-scoring tokens, the paper), ``quantile`` (the rule
        causal routing uses, a score threshold, re-fitted on each batch to the layer's
        ratio: training sees the decisions ``generate()`` makes) or ``rank`` (rank
        routing's rule, for a model served in rank mode)
    :param align_batch_size: rows per step, re-batched from the training data
    :param align_seq_len: each row is cut to its first ``align_seq_len`` real tokens
    :param align_w_kl: weight of ``KL(P_dense || P_sparse)`` on the next-token
        distributions
    :param align_w_hidden: weight of the per-layer hidden-state alignment term
    :param align_w_lm: weight of the causal-LM (next-token cross-entropy) term
    :param align_trainable: ``routers`` (only the routers train) or
        ``routers_and_layers`` (the routed decoder layers' weights train too)
    :param align_grad_clip: max global gradient norm; 0 disables clipping (not ``null``:
        llm-compressor drops ``None`` values when it writes ``recipe.yaml``)
    :param align_weight_decay: AdamW weight decay
    :param align_seed: seeds the data order of the stage (same seed -> same weights)
    :param align_bf16: forward passes under bf16 autocast (less memory, faster on bf16
        hardware)
    :param align_gradient_checkpointing: recompute decoder layers in backward to save
        memory
    :param align_teacher_cache: compute the dense teacher's outputs once per training
        row (its last hidden state, and every layer's with the hidden term; logits
        recomputed through its lm_head) and reuse them in later epochs instead of
        running the teacher every step: faster steps for memory (checked before the
        first step). Later epochs then differ from a fresh forward only in the last
        bits
    :param align_parallel: under ``torchrun``, how the stage is data-parallel: ``ddp``
        (a whole student and teacher per rank) or ``fsdp`` (FSDP2: both sharded over
        the ranks, for when they do not fit one device together); see
        ``docs/distributed.md``. ``align_batch_size`` is then per rank. One process
        ignores it
    :param align_dataset: training rows (``input_ids`` [+ ``attention_mask``]), e.g. a
        ``datasets.Dataset``; ``None`` trains on the calibration data. Python API only:
        not serialised into the saved ``recipe.yaml``
    """

    align_steps: Steps = 0
    align_lr: LearningRate = 3e-3
    align_layer_lr: LearningRate | None = None
    align_routing: TrainingRouting = "topk"
    align_batch_size: PositiveInt = 4
    align_seq_len: PositiveInt = 512
    align_w_kl: NonNegativeFloat = 1.0
    align_w_hidden: NonNegativeFloat = 1.0
    align_w_lm: NonNegativeFloat = 0.0
    align_trainable: Trainable = "routers"
    align_grad_clip: GradClip = 1.0
    align_weight_decay: NonNegativeFloat = 0.0
    align_seed: int = 0
    align_bf16: bool = False
    align_gradient_checkpointing: bool = False
    align_teacher_cache: bool = False
    align_parallel: Parallel = "ddp"
    align_dataset: Any = Field(default=None, exclude=True, repr=False)

    @field_validator("align_dataset")
    @classmethod
    def _check_align_dataset(cls, v: Any) -> Any:
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
        # refused here, not after the minutes of calibration and routing before the
        # alignment first reads it
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

    @model_validator(mode="after")
    def _check_align_weights(self) -> AlignmentFields:
        self.alignment_weights()  # the weights refuse all-zero values
        self.alignment_config(show_progress=False)  # and the config, a long warm-up
        return self

    # ------------------------------------------------------------------ helpers for the
    # modifier
    @property
    def align_enabled(self) -> bool:
        """True when the alignment stage runs (``align_steps > 0``)."""
        return self.align_steps > 0

    @property
    def align_needs_teacher(self) -> bool:
        """True when the stage runs and a loss term compares against the dense
        teacher."""
        return self.align_enabled and self.alignment_weights().needs_teacher

    def alignment_weights(self) -> AlignmentLossWeights:
        """The loss weights ``align_w_kl``, ``align_w_hidden``, ``align_w_lm``."""
        return AlignmentLossWeights(
            kl=self.align_w_kl, hidden=self.align_w_hidden, lm=self.align_w_lm
        )

    def alignment_config(self, show_progress: bool = True) -> AlignmentConfig:
        """The trainer's :class:`AlignmentConfig` built from these fields."""
        return AlignmentConfig(
            steps=self.align_steps,
            lr=self.align_lr,
            layer_lr=self.align_layer_lr,
            routing=self.align_routing,
            batch_size=self.align_batch_size,
            seq_len=self.align_seq_len,
            weights=self.alignment_weights(),
            trainable=self.align_trainable,
            grad_clip=self.align_grad_clip,
            weight_decay=self.align_weight_decay,
            seed=self.align_seed,
            bf16=self.align_bf16,
            gradient_checkpointing=self.align_gradient_checkpointing,
            teacher_cache=self.align_teacher_cache,
            show_progress=show_progress,
            parallel=self.align_parallel,
        )
