"""The routed architecture in transformers' Auto classes: with ``adadsf_modifier``
imported, ``AutoConfig`` / ``AutoModelForCausalLM`` (and what is built on them: a
``pipeline``, lm-eval's ``hf`` model, llm-compressor's ``oneshot(model=PATH)``) load a
routed checkpoint as the routed model.

``import adadsf_modifier`` calls :func:`register_auto_classes`; a process that does
not import it reaches the same classes through the checkpoint's ``auto_map`` with
``trust_remote_code=True`` (:mod:`.routed_config` says why both).

:class:`AdaDSFRoutedForCausalLM` is a loader, not a model class of its own: its
``from_pretrained`` is :func:`~adadsf_modifier.checkpoint.load.from_pretrained`, which
validates the sidecar, loads the *base* causal LM (``LlamaForCausalLM``, ...) and
routes it again. So every caller gets exactly the model that
``adadsf_modifier.from_pretrained`` gives (same class, same state-dict names, same
save hook): llm-compressor's sequential pipeline, compressed-tensors, ``generate()`` and
lm-eval see an ordinary causal LM, and the sidecar stays the one source of routing
data. A wrapping ``PreTrainedModel`` would
have renamed every weight and hidden the decoder layers from llm-compressor.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from adadsf_modifier.checkpoint.load import from_pretrained
from adadsf_modifier.checkpoint.routed_config import (
    ROUTED_ARCHITECTURE,
    ROUTED_MODEL_TYPE,
    AdaDSFRoutedConfig,
)
from adadsf_modifier.checkpoint.sidecar import AdaDSFCheckpointError

__all__ = ["AdaDSFRoutedForCausalLM", "register_auto_classes"]


class AdaDSFRoutedForCausalLM:
    """``AutoModelForCausalLM``'s class for ``model_type: adadsf_routed``: loads the
    routed model of a checkpoint folder (AdaDSF or FTP, quantized or not)."""

    config_class = AdaDSFRoutedConfig

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *args: Any,
        **kwargs: Any,
    ) -> nn.Module:
        """``adadsf_modifier.from_pretrained(path, **kwargs)``: the routed model
        (an instance of the base architecture's class with routed decoder layers).
        ``kwargs`` go to transformers' ``from_pretrained`` of the base class, as
        ``AutoModelForCausalLM`` would pass them (``dtype``, ``device_map``,
        ``quantization_config``, ...)."""
        if args:
            raise TypeError(
                f"{ROUTED_ARCHITECTURE}.from_pretrained takes no positional model "
                "arguments; pass keyword arguments"
            )
        return from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> nn.Module:
        raise AdaDSFCheckpointError(
            f"a {ROUTED_MODEL_TYPE} model cannot be built from its config alone: its "
            "routers and thresholds live in the checkpoint's sidecar; load the folder "
            "with AutoModelForCausalLM.from_pretrained(path)"
        )

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModelForCausalLM") -> None:
        """Nothing: transformers calls this after importing the checkpoint's remote
        code; the package registered itself when that code imported it."""


def register_auto_classes() -> None:
    """Make ``AutoConfig`` and ``AutoModelForCausalLM`` know the routed architecture
    (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(ROUTED_MODEL_TYPE, AdaDSFRoutedConfig, exist_ok=True)
    AutoModelForCausalLM.register(
        AdaDSFRoutedConfig, AdaDSFRoutedForCausalLM, exist_ok=True
    )
