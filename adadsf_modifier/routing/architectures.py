"""Every per-architecture fact AdaDSF uses, one :class:`ArchitectureSpec` per model
type: adding an architecture is one entry in :data:`SUPPORTED_ARCHITECTURES`. Routing
calls the original layer, so it needs only where the layers are and their cache
keyword; the FLOPs model the MLP kind and key/value heads; skipped tokens'
keys/values and the kv-keeping prefill the names of the layer's submodules."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from adadsf_modifier.constraints import InputError

__all__ = [
    "ArchitectureSpec",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "apply_named",
    "architecture_for_config",
    "architecture_of",
    "decoder_layers",
    "original_class",
    "sliding_windows",
]

#: Set on the routing mixin: classes carrying it were made by routing, not the model.
ROUTED_CLASS_MARKER = "_adadsf_routed_class"


class UnsupportedArchitectureError(InputError):
    """The model is not one whose decoder layers AdaDSF knows how to route."""


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where an architecture keeps its decoder layers and what they compute.

    ``layers_path``: from the ``*ForCausalLM`` to the layers' ``ModuleList``;
    ``layer_class``: their class name; ``cache_kwarg``: their KV-cache keyword;
    ``gated_mlp``: SwiGLU/GeGLU (three matmuls, fused or not) rather than two;
    ``kv_heads_attr``: the config's key/value head count (``None``: as many as query
    heads).

    A skipped token's keys/values go through the layer's own modules: ``input_norm``
    (``None``: a post-norm layer, none), the ``attention``'s ``kv_projections`` or
    ``fused_qkv`` (GPT-NeoX: per head ``[q, k, v]``; with ``fused_qkv_blocks``, Phi-3:
    ``[all q | all k | all v]``), the per-head key norm ``key_norm`` before RoPE
    (over all heads at once where not ``key_norm_per_head``, OLMo 2), ``head_dim_attr``.

    The kv-keeping prefill (``run_kept_mlp``) splits a sequential layer into
    ``x + o_a(attention(input_norm(x)))`` then ``h + o_m(mlp(mlp_norm(h)))``, each
    norm optional: ``output_norms = (o_a, o_m)`` where the sub-blocks' outputs are
    normalised (Gemma, OLMo 2); ``parallel_residual`` (GPT-NeoX) has no such split."""

    model_type: str
    layers_path: str
    layer_class: str
    cache_kwarg: str
    gated_mlp: bool = True
    kv_heads_attr: str | None = "num_key_value_heads"
    input_norm: str | None = "input_layernorm"
    attention: str = "self_attn"
    kv_projections: tuple[str, str] | None = ("k_proj", "v_proj")
    fused_qkv: str | None = None
    fused_qkv_blocks: bool = False
    key_norm: str | None = None
    key_norm_per_head: bool = True
    head_dim_attr: str = "head_dim"
    mlp_norm: str | None = "post_attention_layernorm"
    output_norms: tuple[str, str] | None = None
    parallel_residual: bool = False
    mlp: str = "mlp"

    @property
    def mlp_matmuls(self) -> int:
        """Matrix multiplications of one MLP: 3 when gated, 2 otherwise."""
        return 3 if self.gated_mlp else 2

    def num_kv_heads(self, config: Any) -> int:
        """Key/value heads of ``config`` (query heads when the architecture has no
        GQA)."""
        heads = int(config.num_attention_heads)
        if self.kv_heads_attr is None:
            return heads
        return int(getattr(config, self.kv_heads_attr, None) or heads)


_GEMMA = dict(
    mlp_norm="pre_feedforward_layernorm",
    output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
)

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
    # GPT-NeoX: fused qkv of width 3h (full multi-head attention), MLP h -> 4h -> h
    "gpt_neox": ArchitectureSpec(
        "gpt_neox",
        "gpt_neox.layers",
        "GPTNeoXLayer",
        "layer_past",
        gated_mlp=False,
        kv_heads_attr=None,
        attention="attention",
        kv_projections=None,
        fused_qkv="query_key_value",
        head_dim_attr="head_size",
        parallel_residual=True,
    ),
    "qwen3": ArchitectureSpec(
        "qwen3",
        "model.layers",
        "Qwen3DecoderLayer",
        "past_key_values",
        key_norm="k_norm",
    ),
    # OLMo 2: post-norm, the attention and MLP outputs normalised, no input norm
    "olmo2": ArchitectureSpec(
        "olmo2",
        "model.layers",
        "Olmo2DecoderLayer",
        "past_key_values",
        input_norm=None,
        key_norm="k_norm",
        key_norm_per_head=False,
        mlp_norm=None,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    ),
    # Phi-3: fused qkv_proj ([q | k | v]) and gate_up_proj (still three matmuls' FLOPs)
    "phi3": ArchitectureSpec(
        "phi3",
        "model.layers",
        "Phi3DecoderLayer",
        "past_key_values",
        kv_projections=None,
        fused_qkv="qkv_proj",
        fused_qkv_blocks=True,
    ),
    # Gemma 2/3: sandwich norms around attention and MLP; windows from layer_types
    "gemma2": ArchitectureSpec(
        "gemma2", "model.layers", "Gemma2DecoderLayer", "past_key_values", **_GEMMA
    ),
    "gemma3_text": ArchitectureSpec(
        "gemma3_text",
        "model.layers",
        "Gemma3DecoderLayer",
        "past_key_values",
        key_norm="k_norm",
        **_GEMMA,
    ),
}

_REQUIRED_LAYER_ARGS = ("attention_mask", "position_ids", "position_embeddings")


def architecture_for_config(config: Any) -> ArchitectureSpec:
    """The spec of a config (or a model carrying one), or an error naming what is
    missing."""
    config = getattr(config, "config", config)  # accept a model as well
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedArchitectureError(
            f"AdaDSF could not find `model_type` on {type(config).__name__}; "
            "pass a Hugging Face causal LM or its config (supported model types: "
            f"{sorted(SUPPORTED_ARCHITECTURES)})"
        )
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"AdaDSF does not support model_type {model_type!r}: could not find a "
            "decoder-layer spec for it; supported model types: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return spec


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """The spec for ``model``, or an error naming what was missing."""
    if getattr(model, "config", None) is None:
        raise UnsupportedArchitectureError(
            f"AdaDSF could not find `config.model_type` on {type(model).__name__}; "
            "pass a Hugging Face causal LM (supported model types: "
            f"{sorted(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        return architecture_for_config(model.config)
    except UnsupportedArchitectureError as err:
        raise UnsupportedArchitectureError(f"{err} ({type(model).__name__})") from None


def sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's attention window (``None``: full causal), read as
    transformers builds its masks: per-layer ``layer_types`` when present, else
    ``sliding_window`` for every layer (Mistral)."""
    config = getattr(config, "config", config)
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(
            int(window) if (t == "sliding_attention" and window) else None
            for t in list(layer_types)[:num_layers]
        )
    if getattr(config, "use_sliding_window", None) is False:
        window = None
    return tuple(int(window) if window else None for _ in range(num_layers))


def apply_named(layer: nn.Module, name: str | None, x: Any) -> Any:
    """``layer``'s submodule ``name`` applied to ``x``; ``None`` (a norm the
    architecture does not have): ``x`` itself."""
    return x if name is None else getattr(layer, name)(x)


def original_class(layer_class: type) -> type:
    """The model's own class behind a (possibly routed) decoder-layer class: the MRO
    past every class routing made."""
    return next(
        c for c in layer_class.__mro__ if not getattr(c, ROUTED_CLASS_MARKER, False)
    )


def decoder_layers(
    model: nn.Module,
) -> tuple[ArchitectureSpec, list[tuple[str, nn.Module]]]:
    """``(spec, [(qualified_name, layer), ...])`` in layer order."""
    spec = architecture_of(model)
    if getattr(model.config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            f"AdaDSF routes causal decoders; this {spec.model_type} model attends "
            "bidirectionally (use_bidirectional_attention: an embedding model)"
        )
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
        original = original_class(type(layer))
        if not any(c.__name__ == spec.layer_class for c in original.__mro__):
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
                f"{original.__name__}.forward; this transformers version is not "
                "supported"
            )
        layers.append((f"{spec.layers_path}.{i}", layer))
    return spec, layers
