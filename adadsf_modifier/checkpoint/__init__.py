"""Saving and reloading routed (and possibly quantized) checkpoints: an ordinary
compressed-tensors checkpoint plus one sidecar saying how to route it again
(``adadsf_config.json``, or FTP's ``ftp_routing.json``). The layout and why it is so:
``docs/recipes.md``, "Checkpoint layout".

:mod:`.kinds` tells the kinds apart on disk; :mod:`.sidecar` is the AdaDSF sidecar's
schema and the reader of both kinds; :mod:`.tensors` reads and checks the router
tensors; :mod:`.save` is the atomic ``save_pretrained`` hook; :mod:`.load` the loaders;
:mod:`.routed_config` / :mod:`.auto_model` the routed architecture ``config.json``
declares; :mod:`._compat` the workarounds for upstream behaviour.
"""

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
from adadsf_modifier.checkpoint.load import from_pretrained, load_adadsf
from adadsf_modifier.checkpoint.routed_config import AdaDSFRoutedConfig
from adadsf_modifier.checkpoint.save import attach_checkpoint_support, install_save_hook
from adadsf_modifier.checkpoint.sidecar import (
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    AdaDSFSidecar,
    LayerEntry,
    read_sidecar,
    sidecar_for_model,
    write_sidecar,
)

__all__ = [
    "AdaDSFCheckpointError",
    "AdaDSFRoutedConfig",
    "AdaDSFRoutedForCausalLM",
    "AdaDSFSidecar",
    "CheckpointKind",
    "FTP_SIDECAR_NAME",
    "LayerEntry",
    "SIDECAR_NAME",
    "SIDECAR_NAMES",
    "attach_checkpoint_support",
    "checkpoint_sidecar",
    "from_pretrained",
    "install_save_hook",
    "load_adadsf",
    "read_sidecar",
    "register_auto_classes",
    "sidecar_for_model",
    "write_sidecar",
]
