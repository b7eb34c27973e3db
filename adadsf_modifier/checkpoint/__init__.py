"""Saving and reloading routed (and possibly quantized) checkpoints.

A checkpoint is an ordinary compressed-tensors checkpoint (the router weights are plain
tensors in its safetensors files) plus one sidecar: ``adadsf_config.json``, a typed,
versioned file saying which layers AdaDSF routed and how, or FTP's
``ftp_routing.json`` (:mod:`adadsf_modifier.ftp.checkpoint`). One concern per module:

* :mod:`.kinds` -- the two kinds, their sidecar names, telling them apart on disk;
* :mod:`.sidecar` -- the AdaDSF sidecar's pydantic schema; building, reading, writing;
  the one reader of both kinds' sidecars (:func:`.sidecar.read_sidecar_file`);
* :mod:`.tensors` -- reading and checking the router tensors from safetensors files;
* :mod:`.save` -- the ``save_pretrained`` hook of both kinds: checks, atomic write,
  sidecar last, source rank only under ``torchrun``;
* :mod:`.load` -- :func:`from_pretrained` (either kind) and :func:`load_adadsf`;
* :mod:`.routed_config` -- the routed architecture a checkpoint's ``config.json``
  declares (``model_type: adadsf_routed``), so that no loader builds the dense-depth
  model from it; the remote-code files its ``auto_map`` names;
* :mod:`.auto_model` -- that architecture in transformers' Auto classes
  (``AutoConfig`` / ``AutoModelForCausalLM`` load the routed model);
* :mod:`._compat` -- workarounds for upstream behaviour, tagged with their versions.

The atomic-directory work itself is shared with the evaluation asset cache, in
:mod:`adadsf_modifier.atomic`; the recipe check that keeps routers out of quantization
lives next to the modifier, in :mod:`adadsf_modifier.recipe_checks` (re-exported here).
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
from adadsf_modifier.checkpoint.routed_config import (
    ROUTED_MODEL_TYPE,
    AdaDSFRoutedConfig,
)
from adadsf_modifier.checkpoint.save import attach_checkpoint_support, install_save_hook
from adadsf_modifier.checkpoint.sidecar import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_ATTR,
    SIDECAR_NAME,
    SUPPORTED_FORMAT_VERSIONS,
    AdaDSFCheckpointError,
    AdaDSFSidecar,
    LayerEntry,
    ModifierRecord,
    adadsf_config,
    read_adadsf_config,
    read_sidecar,
    sidecar_for_model,
    write_sidecar,
)
from adadsf_modifier.recipe_checks import check_recipe_keeps_routers_unquantized

__all__ = [
    "AdaDSFCheckpointError",
    "AdaDSFRoutedConfig",
    "AdaDSFRoutedForCausalLM",
    "AdaDSFSidecar",
    "CheckpointKind",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FTP_SIDECAR_NAME",
    "LayerEntry",
    "METADATA_ATTR",
    "ModifierRecord",
    "ROUTED_MODEL_TYPE",
    "SIDECAR_NAME",
    "SIDECAR_NAMES",
    "SUPPORTED_FORMAT_VERSIONS",
    "adadsf_config",
    "attach_checkpoint_support",
    "check_recipe_keeps_routers_unquantized",
    "checkpoint_sidecar",
    "from_pretrained",
    "install_save_hook",
    "load_adadsf",
    "read_adadsf_config",
    "read_sidecar",
    "register_auto_classes",
    "sidecar_for_model",
    "write_sidecar",
]
