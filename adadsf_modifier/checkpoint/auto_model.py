"""The routed architecture in transformers' Auto classes, so that ``pipeline``,
lm-eval and ``oneshot(model=PATH)`` load a routed checkpoint as the routed model.

:class:`AdaDSFRoutedForCausalLM` is a loader, not a model class: it returns what
:func:`~adadsf_modifier.checkpoint.load.from_pretrained` returns, the *base* causal LM
with routed decoder layers, so every caller gets the same model and llm-compressor
still sees ordinary decoder layers.
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
        """Nothing: the package registered itself when the remote code imported it."""


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know the routed architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(ROUTED_MODEL_TYPE, AdaDSFRoutedConfig, exist_ok=True)
    AutoModelForCausalLM.register(
        AdaDSFRoutedConfig, AdaDSFRoutedForCausalLM, exist_ok=True
    )
