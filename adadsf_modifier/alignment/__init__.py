"""Feature-preserving alignment: fine-tune the routed model against its frozen dense
teacher.

* :mod:`~adadsf_modifier.alignment.config` - the ``align_*`` recipe fields
  (:class:`AlignmentConfig`, which ``AdaDSFModifier`` inherits), report, error.
* :mod:`~adadsf_modifier.alignment.losses` - the loss terms (KL, hidden alignment,
  causal LM).
* :mod:`~adadsf_modifier.alignment.data` - training rows and their seeded re-batching.
* :mod:`~adadsf_modifier.alignment.teacher` - the frozen dense teacher.
* :mod:`~adadsf_modifier.alignment.teacher_cache` - its outputs kept per row
  (``align_teacher_cache``).
* :mod:`~adadsf_modifier.alignment.params` - what trains, fp32 master copies, and
  :func:`check_alignment_supported`.
* :mod:`~adadsf_modifier.alignment.parallel` - data parallelism under ``torchrun``
  (DDP or FSDP2).
* :mod:`~adadsf_modifier.alignment.trainer` - the training loop (:func:`align_model`).
"""

from adadsf_modifier.alignment.config import (
    PARALLEL_MODES,
    TRAINABLE_SETS,
    AlignmentConfig,
    AlignmentDivergedError,
    AlignmentReport,
)
from adadsf_modifier.alignment.data import RowBatcher, training_rows
from adadsf_modifier.alignment.losses import (
    LOSS_WEIGHTS,
    AlignmentLossTerms,
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
    "PARALLEL_MODES",
    "TRAINABLE_SETS",
    "AlignmentConfig",
    "AlignmentDivergedError",
    "AlignmentLossTerms",
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
