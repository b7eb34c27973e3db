"""Feature-preserving alignment: fine-tune the routed model against its frozen dense
teacher.

* :mod:`~adadsf_modifier.alignment.losses` - the loss terms (KL, hidden alignment,
  causal LM).
* :mod:`~adadsf_modifier.alignment.trainer` - the training loop (:func:`align_model`).
* :mod:`~adadsf_modifier.alignment.fields` - the ``align_*`` recipe fields of
  ``AdaDSFModifier``.
"""

from adadsf_modifier.alignment.fields import AlignmentFields
from adadsf_modifier.alignment.losses import (
    AlignmentLossTerms,
    AlignmentLossWeights,
    alignment_loss,
    causal_lm_loss,
    hidden_alignment_loss,
    kl_divergence_loss,
)
from adadsf_modifier.alignment.trainer import (
    TRAINABLE_SETS,
    AlignmentConfig,
    AlignmentDivergedError,
    AlignmentReport,
    RowBatcher,
    align_model,
    make_teacher,
    release_memory,
    select_trainable,
    training_rows,
)

__all__ = [
    "TRAINABLE_SETS",
    "AlignmentConfig",
    "AlignmentDivergedError",
    "AlignmentFields",
    "AlignmentLossTerms",
    "AlignmentLossWeights",
    "AlignmentReport",
    "RowBatcher",
    "align_model",
    "alignment_loss",
    "causal_lm_loss",
    "hidden_alignment_loss",
    "kl_divergence_loss",
    "make_teacher",
    "release_memory",
    "select_trainable",
    "training_rows",
]
