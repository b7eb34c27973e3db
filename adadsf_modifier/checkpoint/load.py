"""Loading a checkpoint of either kind (FTP's loader is registered by
:mod:`adadsf_modifier.ftp.checkpoint`). The sidecar is validated and checked against
``config.json``, and the small router tensors are read, before the large base model
loads: a bad checkpoint fails fast."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from loguru import logger
from torch import nn

from adadsf_modifier.checkpoint._compat import load_with_expected_extra_keys
from adadsf_modifier.checkpoint.kinds import (
    FTP_SIDECAR_NAME,
    LOADERS,
    checkpoint_sidecar,
)
from adadsf_modifier.checkpoint.routed_config import (
    AdaDSFRoutedConfig,
    declares_routed_architecture,
)
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
    refuse_empty_inputs,
    route_layer,
)


def _any_topk_at_inference(layers: list[tuple[str, nn.Module]]) -> bool:
    """Some routed layer (0 < r < 1) would route top-k in eval mode (no KV cache)."""
    return any(
        isinstance(layer, RoutedLayer)
        and 0.0 < float(layer.retention_ratio) < 1.0
        and layer.resolved_routing_mode() == "topk"
        for _, layer in layers
    )


def _check_config(path: Path, sidecar: AdaDSFSidecar, config: Any) -> None:
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


def read_config(path: Path, kwargs: dict[str, Any]) -> Any:
    """``kwargs.pop("config")``, else ``PATH/config.json``; a routed config gives its
    base config (the model that loads and is routed again)."""
    from transformers import AutoConfig

    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=kwargs.get("trust_remote_code", False)
        )
    return config.base_config() if isinstance(config, AdaDSFRoutedConfig) else config


def _causal_lm_class(path: Path, config: Any) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        base_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as e:
        raise AdaDSFCheckpointError(
            f"{path}: no causal-LM class for {type(config).__name__}"
        ) from e
    return base_cls[0] if isinstance(base_cls, (list, tuple)) else base_cls


def load_base_model(
    path: str | os.PathLike[str], extra_keys: list[str], **kwargs: Any
) -> nn.Module:
    """The checkpoint's plain causal LM, the tensors matching ``extra_keys`` (regexes,
    read by the kind's loader) expected."""
    path = Path(path)
    config = read_config(path, kwargs)
    base_cls = _causal_lm_class(path, config)
    return load_with_expected_extra_keys(
        base_cls, extra_keys, path, config=config, **kwargs
    )


def _route(model: nn.Module, path: Path, sidecar: AdaDSFSidecar, tensors: dict) -> list:
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
        router.load_state_dict(tensors_of(tensors, f"{entry.name}.router."))
        skip = None
        if entry.skip_path != "identity":
            skip = SkipPath(model.config.hidden_size, entry.skip_path_rank)
            skip.load_state_dict(tensors_of(tensors, f"{entry.name}.skip_path."))
        route_layer(
            layer,
            router,
            entry.retention_ratio,
            entry.index,
            spec.cache_kwarg,
            model.config,
            skip,
            entry.skipped_tokens_kv,
        )
        layer.router.to(dtype=dtype)
        if skip is not None:
            skip.to(dtype=dtype)
        if entry.causal_threshold is not None:
            layer.causal_threshold = entry.causal_threshold
        if entry.routing_mode is not None:
            layer.routing_mode = entry.routing_mode
    return layers


def tensors_of(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """Reload any checkpoint this package writes (AdaDSF's or FTP's), routed, ready
    for ``generate()``; ``kwargs`` go to transformers' ``from_pretrained``."""
    path = Path(path)
    sidecar = checkpoint_sidecar(path)
    if sidecar is not None and not declares_routed_architecture(path):
        logger.warning(
            f"AdaDSF: {path} was saved before routed checkpoints declared their "
            "architecture: its config.json names the base model, so "
            "AutoModelForCausalLM, pipeline() and lm-eval load it as the DENSE-DEPTH "
            "model (every layer on every token). Loading it routed here; save it again "
            "(adadsf_modifier.from_pretrained(path).save_pretrained(new_path)) to make "
            "every loader build the routed model or refuse"
        )
    if sidecar in LOADERS:
        return LOADERS[sidecar](path, **kwargs)
    if sidecar is None and path.is_dir():
        raise AdaDSFCheckpointError(
            f"no AdaDSF data in {path}: neither {SIDECAR_NAME} (AdaDSFModifier) nor "
            f"{FTP_SIDECAR_NAME} (FTPModifier) found; save the routed model with "
            "oneshot(..., output_dir=...) or model.save_pretrained(...) after the "
            "modifier ran"
        )
    return load_adadsf(path, **kwargs)


def load_adadsf(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """Reload a checkpoint saved after :class:`AdaDSFModifier`. Top-k routing cannot
    continue from a KV cache: if a routed layer would route top-k in eval mode (no
    causal threshold saved), ``generation_config.use_cache`` is False."""
    path = Path(path)
    sidecar = read_sidecar(path)
    config = read_config(path, kwargs)
    _check_config(path, sidecar, config)
    _causal_lm_class(path, config)  # an unsupported model type fails before any read
    router_tensors = read_router_tensors(path, sidecar)

    names = "|".join(re.escape(e.name) for e in sidecar.routed_layers)
    keys = [rf"^({names})\.(router|skip_path)\."]
    model = load_base_model(path, keys, config=config, **kwargs)
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
    refuse_empty_inputs(model)
    n = len(sidecar.routed_layers)
    logger.info(f"AdaDSF: loaded {path} with {n}/{len(layers)} routed decoder layers")
    return model
