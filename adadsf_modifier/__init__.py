"""AdaDSF depth-sparse routing as an llm-compressor modifier.

``import adadsf_modifier`` registers :class:`AdaDSFModifier` with llm-compressor's
``ModifierFactory`` so YAML recipes (including the ``recipe.yaml`` saved next to a
checkpoint) can name it, guards llm-compressor's recipe parser against recipes that
name AdaDSFModifier but would silently apply none (see ``recipe_guard``), makes
``oneshot`` refuse an ``output_dir`` it could not write before any work (see
``destinations``), and makes ranks under ``torchrun`` wait for each other's
quantization parameters after GPTQ (see ``qparam_sync``). It also registers the
routed architecture that saved checkpoints declare with transformers' ``AutoConfig``
and ``AutoModelForCausalLM``, so that they (and ``pipeline``, lm-eval,
``oneshot(model=PATH)``) load a routed checkpoint as the routed model
(``checkpoint.routed_config``, ``checkpoint.auto_model``).
"""

from llmcompressor.modifiers.factory import ModifierFactory

from adadsf_modifier import destinations, qparam_sync, recipe_guard
from adadsf_modifier.checkpoint import (
    AdaDSFCheckpointError,
    AdaDSFRoutedConfig,
    AdaDSFRoutedForCausalLM,
    from_pretrained,
    register_auto_classes,
)
from adadsf_modifier.ftp import FTPModifier
from adadsf_modifier.modifier import AdaDSFModifier
from adadsf_modifier.routing import RoutedLayer, TokenRouter, routed_layers

__all__ = [
    "AdaDSFCheckpointError",
    "AdaDSFModifier",
    "AdaDSFRoutedConfig",
    "AdaDSFRoutedForCausalLM",
    "FTPModifier",
    "from_pretrained",
    "RoutedLayer",
    "TokenRouter",
    "routed_layers",
]
__version__ = "0.1.0"

ModifierFactory.register("AdaDSFModifier", AdaDSFModifier)
ModifierFactory.register("FTPModifier", FTPModifier)
recipe_guard.install()
destinations.install()
qparam_sync.install()
register_auto_classes()
