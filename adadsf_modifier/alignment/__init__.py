"""Feature-preserving alignment: fine-tune the routed model against its frozen dense
teacher (:func:`align_model`, configured by :class:`AlignmentConfig`, whose ``align_*``
fields ``AdaDSFModifier`` inherits)."""

from adadsf_modifier.alignment.config import (
    AlignmentConfig,
    AlignmentDivergedError,
    AlignmentReport,
)
from adadsf_modifier.alignment.data import RowBatcher, training_rows
from adadsf_modifier.alignment.losses import (
    LOSS_WEIGHTS,
    AlignmentLossWeights,
    alignment_loss,
    causal_lm_loss,
    hidden_alignment_loss,
    kl_divergence_loss,
)
from adadsf_modifier.alignment.params import (
    check_alignment_supported,
    select_trainable,
)
from adadsf_modifier.alignment.teacher import make_teacher, release_memory
from adadsf_modifier.alignment.teacher_cache import (
    check_teacher_cache_fits,
    rows_read_again,
)
from adadsf_modifier.alignment.trainer import align_model

__all__ = [
    "LOSS_WEIGHTS",
    "AlignmentConfig",
    "AlignmentDivergedError",
    "AlignmentLossWeights",
    "AlignmentReport",
    "RowBatcher",
    "align_model",
    "alignment_loss",
    "causal_lm_loss",
    "check_alignment_supported",
    "check_teacher_cache_fits",
    "hidden_alignment_loss",
    "kl_divergence_loss",
    "make_teacher",
    "release_memory",
    "rows_read_again",
    "select_trainable",
    "training_rows",
]
