"""Loading an AdaDSF checkpoint: :func:`from_pretrained`.

Order matters for the user's time: the sidecar is validated in full, then checked
against ``config.json``, then the (small) router tensors are read and checked, and only
then does the (large) base model load.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from loguru import logger
from torch import nn

from adadsf_modifier.checkpoint._compat import load_with_expected_extra_keys
from adadsf_modifier.checkpoint.save import install_save_hook
from adadsf_modifier.checkpoint.sidecar import (
    METADATA_ATTR,
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    AdaDSFSidecar,
    read_sidecar,
)
from adadsf_modifier.checkpoint.tensors import read_router_tensors
from adadsf_modifier.routing import (
    RoutedLayer,
    SkipPath,
    TokenRouter,
    decoder_layers,
    route_layer,
)

__all__ = ["from_pretrained"]


def _any_topk_at_inference(layers: list[tuple[str, nn.Module]]) -> bool:
    """True if some routed layer (0 < r < 1) would route top-k in eval mode (no KV
    cache then)."""
    for _, layer in layers:
        if isinstance(layer, RoutedLayer) and 0.0 < float(layer.retention_ratio) < 1.0:
            resolve = getattr(layer, "resolved_routing_mode", None)
            if resolve is None or resolve() == "topk":
                return True
    return False


def _check_config(path: Path, sidecar: AdaDSFSidecar, config: Any) -> None:
    """The sidecar must describe the model ``config.json`` builds."""
    if config.model_type != sidecar.model_type:
        raise AdaDSFCheckpointError(
            f"{path}: {SIDECAR_NAME} was written for model_type "
            f"{sidecar.model_type!r} but config.json says {config.model_type!r}"
        )
    for key in ("num_hidden_layers", "hidden_size"):
        value = getattr(config, key, None)
        if value is not None and int(value) != getattr(sidecar, key):
            raise AdaDSFCheckpointError(
                f"{path}: config.json says {key}={value} but {SIDECAR_NAME} says "
                f"{getattr(sidecar, key)}"
            )


def _causal_lm_class(path: Path, config: Any) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        base_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as e:
        raise AdaDSFCheckpointError(
            f"{path}: no causal-LM class for {type(config).__name__}"
        ) from e
    return base_cls[0] if isinstance(base_cls, (list, tuple)) else base_cls


def _route(model: nn.Module, path: Path, sidecar: AdaDSFSidecar, tensors: dict) -> list:
    """Route the layers the sidecar lists, with their saved routers and settings."""
    spec, layers = decoder_layers(model)
    if len(layers) != sidecar.num_hidden_layers:
        raise AdaDSFCheckpointError(
            f"{path}: the model has {len(layers)} decoder layers, {SIDECAR_NAME} lists "
            f"{sidecar.num_hidden_layers}"
        )
    dtype = model.get_input_embeddings().weight.dtype
    for entry, (name, layer) in zip(sidecar.layers, layers):
        if not entry.routed:
            continue
        if entry.name != name:
            raise AdaDSFCheckpointError(
                f"{path}: {SIDECAR_NAME} names layer {entry.index} `{entry.name}`, "
                f"the model calls it `{name}`"
            )
        router = TokenRouter(
            model.config.hidden_size,
            int(entry.router_hidden_size),
            eps=entry.router_eps or 1e-6,
        )
        router.load_state_dict(_tensors_of(tensors, f"{entry.name}.router."))
        skip = None
        if entry.skip_path != "identity":
            skip = SkipPath(model.config.hidden_size, entry.skip_path_rank)
            skip.load_state_dict(_tensors_of(tensors, f"{entry.name}.skip_path."))
        route_layer(layer, router, entry.retention_ratio, entry.index,
                    spec.cache_kwarg, model.config, skip,
                    entry.skipped_tokens_kv, entry.route_target)  # fmt: skip
        layer.router.to(dtype=dtype)
        if skip is not None:
            skip.to(dtype=dtype)
        if entry.causal_threshold is not None:
            layer.causal_threshold = entry.causal_threshold
        if entry.routing_mode is not None:
            layer.routing_mode = entry.routing_mode
    return layers


def _tensors_of(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """Reload a checkpoint saved after :class:`AdaDSFModifier`, ready for
    ``generate()``.

    The base model loads with ``AutoModelForCausalLM.from_pretrained(path, **kwargs)``:
    a compressed-tensors checkpoint (GPTQ W8A8 / W4A16) goes through transformers'
    compressed-tensors quantizer, so its Linear layers keep their quantization scheme
    and load *compressed* (int8 / packed int4 weights plus scales); compressed-tensors
    decompresses them on the first forward pass (pass
    ``quantization_config=CompressedTensorsConfig(dequantize=True)`` to dequantize at
    load time instead). The decoder layers listed as routed in ``adadsf_config.json``
    are then routed again with their saved retention ratios, router sizes, skip paths,
    ``skipped_tokens_kv`` and ``route_target`` settings, and the router and skip-path
    tensors (which transformers does not know about) are read from the safetensors files
    with shape checks.

    Top-k routing chooses over the whole sequence and cannot continue from a KV cache:
    if any routed layer would route top-k in eval mode (no causal-mode threshold saved),
    the returned model's ``generation_config.use_cache`` is False, so ``generate()``
    re-runs the full sequence per new token. Checkpoints with causal-mode thresholds
    keep the cache.

    :raises AdaDSFCheckpointError: no/unknown/malformed AdaDSF data (any sidecar field
        out of range, checked before any weight loads), ``model_type`` or size
        mismatch with ``config.json``, a missing, mis-shaped or quantized router tensor
    """
    from transformers import AutoConfig

    path = Path(path)
    sidecar = read_sidecar(path)
    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=kwargs.get("trust_remote_code", False)
        )
    _check_config(path, sidecar, config)
    base_cls = _causal_lm_class(path, config)
    router_tensors = read_router_tensors(path, sidecar)  # fail before the big load

    names = "|".join(re.escape(e.name) for e in sidecar.routed_layers)
    model = load_with_expected_extra_keys(
        base_cls, [rf"^({names})\.(router|skip_path)\."], path, config=config, **kwargs
    )
    layers = _route(model, path, sidecar, router_tensors)
    model.eval()
    if (
        _any_topk_at_inference(layers)
        and getattr(model, "generation_config", None) is not None
    ):
        model.generation_config.use_cache = False
    meta = {
        "modifier": sidecar.to_json_dict()["modifier"],
        "similarities": [e.similarity for e in sidecar.layers],
    }
    object.__setattr__(model, METADATA_ATTR, meta)
    install_save_hook(model)
    n = len(sidecar.routed_layers)
    logger.info(f"AdaDSF: loaded {path} with {n}/{len(layers)} routed decoder layers")
    return model.eval()
