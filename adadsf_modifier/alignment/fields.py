"""``align_*`` recipe fields: a pydantic mixin that
:class:`~adadsf_modifier.AdaDSFModifier` inherits.

Kept out of the modifier so the alignment stage's knobs, defaults and validation live
next to the code that uses them; the modifier only adds ``AlignmentFields`` to its
bases. The mixin declares no ``model_config``, so the modifier keeps llm-compressor's
``extra="forbid"`` (unknown YAML keys such as a misspelt ``align_step`` still raise).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from adadsf_modifier.alignment.losses import AlignmentLossWeights
from adadsf_modifier.alignment.trainer import (
    AlignmentConfig,
    check_grad_clip,
    check_lr,
    check_non_negative,
    check_positive_int,
    check_steps,
)

__all__ = ["AlignmentFields"]


class AlignmentFields(BaseModel):
    """Feature-preserving alignment fine-tune, run after routing (METHOD.md §1 step 4).

    ```yaml
    AdaDSFModifier:
      retention: 0.8
      align_steps: 200        # 0 (default) skips the stage
      align_lr: 3.0e-3        # routers only; ~3e-4 with align_trainable:
      routers_and_layers align_batch_size: 4
      align_seq_len: 256
      align_w_kl: 1.0         # KL(P_dense || P_sparse)
      align_w_hidden: 1.0     # per-layer softmax(h) L2 alignment
      align_w_lm: 0.0         # causal-LM loss ("LM loss only": w_kl=0, w_hidden=0,
      w_lm=1) align_trainable: routers
    ```

    :param align_steps: optimizer steps; 0 skips the stage (no teacher is built)
    :param align_lr: AdamW learning rate, constant over the run. The default suits
        ``routers``; ``routers_and_layers`` wants about 10x less (SmolLM2-135M sweep:
        3e-4)
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
    :param align_dataset: training rows (``input_ids`` [+ ``attention_mask``]), e.g. a
        ``datasets.Dataset``; ``None`` trains on the calibration data. Python API only:
        not serialised into the saved ``recipe.yaml``
    """

    align_steps: int = 0
    align_lr: float = 3e-3
    align_batch_size: int = 4
    align_seq_len: int = 512
    align_w_kl: float = 1.0
    align_w_hidden: float = 1.0
    align_w_lm: float = 0.0
    align_trainable: Literal["routers", "routers_and_layers"] = "routers"
    align_grad_clip: float = 1.0
    align_weight_decay: float = 0.0
    align_seed: int = 0
    align_bf16: bool = False
    align_gradient_checkpointing: bool = False
    align_dataset: Any = Field(default=None, exclude=True, repr=False)

    @field_validator("align_steps")
    @classmethod
    def _check_align_steps(cls, v: int) -> int:
        return check_steps(v, "align_steps")

    @field_validator("align_lr")
    @classmethod
    def _check_align_lr(cls, v: float) -> float:
        return check_lr(v, "align_lr")

    @field_validator("align_batch_size", "align_seq_len")
    @classmethod
    def _check_align_positive(cls, v: int, info) -> int:
        return check_positive_int(v, info.field_name)

    @field_validator("align_w_kl", "align_w_hidden", "align_w_lm", "align_weight_decay")
    @classmethod
    def _check_align_non_negative(cls, v: float, info) -> float:
        return check_non_negative(v, info.field_name)

    @field_validator("align_grad_clip")
    @classmethod
    def _check_align_grad_clip(cls, v: float) -> float:
        return check_grad_clip(v, "align_grad_clip")

    @field_validator("align_dataset")
    @classmethod
    def _check_align_dataset(cls, v: Any) -> Any:
        if v is None:
            return v
        columns = getattr(v, "column_names", None)
        if columns is not None and "input_ids" not in columns:
            raise ValueError(
                f"align_dataset needs an `input_ids` column (tokenize it first), got {columns}"
            )
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError(
                "align_dataset must be an iterable of rows or batches with `input_ids` (e.g. a "
                f"tokenized datasets.Dataset), got {type(v).__name__}"
            )
        return v

    @model_validator(mode="after")
    def _check_align_weights(self):
        if self.align_w_kl == 0 and self.align_w_hidden == 0 and self.align_w_lm == 0:
            raise ValueError(
                "align_w_kl, align_w_hidden and align_w_lm are all 0: the alignment loss would be "
                "empty; set at least one of them > 0"
            )
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
        return self.align_enabled and (self.align_w_kl > 0 or self.align_w_hidden > 0)

    def alignment_config(self, show_progress: bool = True) -> AlignmentConfig:
        """The trainer's :class:`AlignmentConfig` built from these fields."""
        return AlignmentConfig(
            steps=self.align_steps,
            lr=self.align_lr,
            batch_size=self.align_batch_size,
            seq_len=self.align_seq_len,
            weights=AlignmentLossWeights(
                kl=self.align_w_kl, hidden=self.align_w_hidden, lm=self.align_w_lm
            ),
            trainable=self.align_trainable,
            grad_clip=self.align_grad_clip,
            weight_decay=self.align_weight_decay,
            seed=self.align_seed,
            bf16=self.align_bf16,
            gradient_checkpointing=self.align_gradient_checkpointing,
            show_progress=show_progress,
        )
