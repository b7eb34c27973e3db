"""Saving and reloading routed (and possibly quantized) checkpoints: an ordinary
compressed-tensors checkpoint plus one sidecar saying how to route it again
(``adadsf_config.json``, or FTP's ``ftp_routing.json``); ``docs/recipes.md``,
"Checkpoint layout", says why it is so."""

from adadsf_modifier.checkpoint.auto_model import (
    AdaDSFRoutedForCausalLM,
    register_auto_classes,
)
from adadsf_modifier.checkpoint.kinds import (
    FTP_SIDECAR_NAME,
    SIDECAR_NAMES,
    CheckpointKind,
    checkpoint_sidecar,
)
from adadsf_modifier.checkpoint.load import from_pretrained
from adadsf_modifier.checkpoint.routed_config import AdaDSFRoutedConfig
from adadsf_modifier.checkpoint.save import attach_checkpoint_support, install_save_hook
from adadsf_modifier.checkpoint.sidecar import SIDECAR_NAME, AdaDSFCheckpointError

__all__ = [
    "AdaDSFCheckpointError",
    "AdaDSFRoutedConfig",
    "AdaDSFRoutedForCausalLM",
    "CheckpointKind",
    "FTP_SIDECAR_NAME",
    "SIDECAR_NAME",
    "SIDECAR_NAMES",
    "attach_checkpoint_support",
    "checkpoint_sidecar",
    "from_pretrained",
    "install_save_hook",
    "register_auto_classes",
]
