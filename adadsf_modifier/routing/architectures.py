"""Where each supported architecture keeps its decoder layers and how they take the KV
cache.

Routing itself is architecture-agnostic (it calls the original layer on a compacted
batch); all it needs to know is which modules are the decoder layers, that they take
rotary ``position_embeddings`` plus a 4D attention mask, and the keyword of the cache
argument.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = [
    "ArchitectureSpec",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "architecture_of",
    "decoder_layers",
]


class UnsupportedArchitectureError(ValueError):
    """The model is not one whose decoder layers AdaDSF knows how to route."""


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str
    layers_path: (
        str  # dotted attribute path from the *ForCausalLM model to the ModuleList
    )
    layer_class: str
    cache_kwarg: str  # keyword under which the decoder layer receives the KV cache


SUPPORTED_ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(
        "llama", "model.layers", "LlamaDecoderLayer", "past_key_values"
    ),
    "qwen2": ArchitectureSpec(
        "qwen2", "model.layers", "Qwen2DecoderLayer", "past_key_values"
    ),
    "mistral": ArchitectureSpec(
        "mistral", "model.layers", "MistralDecoderLayer", "past_key_values"
    ),
    "gpt_neox": ArchitectureSpec(
        "gpt_neox", "gpt_neox.layers", "GPTNeoXLayer", "layer_past"
    ),
}

_REQUIRED_LAYER_ARGS = ("attention_mask", "position_ids", "position_embeddings")


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """The spec for ``model``, or an error naming what was missing."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedArchitectureError(
            f"AdaDSF could not find `config.model_type` on {type(model).__name__}; "
            "pass a Hugging Face causal LM (supported model types: "
            f"{sorted(SUPPORTED_ARCHITECTURES)})"
        )
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"AdaDSF does not support model_type {model_type!r} ({type(model).__name__}): "
            f"could not find a decoder-layer spec for it; supported model types: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return spec


def decoder_layers(
    model: nn.Module,
) -> tuple[ArchitectureSpec, list[tuple[str, nn.Module]]]:
    """``(spec, [(qualified_name, layer), ...])`` in layer order."""
    spec = architecture_of(model)
    obj: object = model
    for part in spec.layers_path.split("."):
        if not hasattr(obj, part):
            raise UnsupportedArchitectureError(
                f"AdaDSF could not find `{spec.layers_path}` (missing `{part}`) on "
                f"{type(model).__name__} with model_type {spec.model_type!r}"
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.ModuleList) or len(obj) == 0:
        raise UnsupportedArchitectureError(
            f"AdaDSF expected `{spec.layers_path}` to be a non-empty ModuleList of "
            f"{spec.layer_class}, found {type(obj).__name__}"
        )
    layers = []
    for i, layer in enumerate(obj):
        original = next(
            (c for c in type(layer).__mro__ if c.__name__ == spec.layer_class), None
        )
        if original is None:
            raise UnsupportedArchitectureError(
                f"AdaDSF expected {spec.layer_class} at `{spec.layers_path}.{i}`, "
                f"found {type(layer).__name__}"
            )
        params = inspect.signature(original.forward).parameters
        missing = [
            a for a in (*_REQUIRED_LAYER_ARGS, spec.cache_kwarg) if a not in params
        ]
        if missing:
            raise UnsupportedArchitectureError(
                f"AdaDSF could not find argument(s) {missing} in "
                f"{original.__name__}.forward; this transformers version is not supported"
            )
        layers.append((f"{spec.layers_path}.{i}", layer))
    return spec, layers
