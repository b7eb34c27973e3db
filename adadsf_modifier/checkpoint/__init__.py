"""Saving and reloading routed (and possibly quantized) AdaDSF checkpoints.

A checkpoint is an ordinary compressed-tensors checkpoint (the router weights are plain
tensors in its safetensors files) plus ``adadsf_config.json``, a typed, versioned
sidecar saying which layers are routed and how. One concern per module:

* :mod:`.sidecar` -- the sidecar's pydantic schema; building, reading, writing it;
* :mod:`.tensors` -- reading and checking the router tensors from safetensors files;
* :mod:`.save` -- the ``save_pretrained`` hook: checks, atomic write, sidecar last;
* :mod:`.load` -- :func:`from_pretrained`;
* :mod:`._compat` -- workarounds for upstream behaviour, tagged with their versions.

The atomic-directory work itself is shared with the evaluation asset cache, in
:mod:`adadsf_modifier.atomic`; the recipe check that keeps routers out of quantization
lives next to the modifier, in :mod:`adadsf_modifier.recipe_checks` (re-exported here).
"""

from adadsf_modifier.checkpoint.load import from_pretrained
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
    "AdaDSFSidecar",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LayerEntry",
    "METADATA_ATTR",
    "ModifierRecord",
    "SIDECAR_NAME",
    "SUPPORTED_FORMAT_VERSIONS",
    "adadsf_config",
    "attach_checkpoint_support",
    "check_recipe_keeps_routers_unquantized",
    "from_pretrained",
    "install_save_hook",
    "read_adadsf_config",
    "read_sidecar",
    "sidecar_for_model",
    "write_sidecar",
]
