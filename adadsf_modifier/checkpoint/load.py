"""Loading a checkpoint: :func:`from_pretrained` reloads either kind this package
writes; :func:`load_adadsf` is AdaDSF's loader.

Order matters for the user's time: the sidecar is validated in full, then checked
against ``config.json``, then the (small) router tensors are read and checked, and only
then does the (large) base model load.

Why the dispatch lives here: callers (evaluation, the CLI, users) should not have to
know which modifier produced a folder. The ``ftp`` package builds on this one (its save
reuses :mod:`.save`), so it registers its loader with :func:`.kinds.register_loader`
when imported (``import adadsf_modifier`` imports it) instead of this module importing
it: the dependency runs one way.
"""

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
    base_config_of,
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
    route_layer,
)

__all__ = ["from_pretrained", "load_adadsf", "load_base_model", "read_config"]


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


def read_config(path: Path, kwargs: dict[str, Any]) -> Any:
    """``kwargs["config"]`` (removed from ``kwargs``), else ``PATH/config.json``: read
    before the weights, so that a sidecar is checked against the model it describes
    (layer count, hidden size) before the base model loads.

    A routed config (``model_type: adadsf_routed``, what the save now writes, or what
    ``AutoModelForCausalLM`` passes) gives its base config: the model that loads and is
    routed again is the base architecture's."""
    from transformers import AutoConfig

    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=kwargs.get("trust_remote_code", False)
        )
    return base_config_of(config)


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
    """The checkpoint's plain causal LM, loaded the way both kinds load it.

    ``from_pretrained`` of the config's causal-LM class with ``kwargs`` (a
    compressed-tensors checkpoint goes through transformers' quantizer), the router
    and skip-path tensors matching ``extra_keys`` (regexes) expected instead of
    reported as UNEXPECTED: they are read and checked separately, by the loader of
    each kind.
    """
    path = Path(path)
    config = read_config(path, kwargs)
    base_cls = _causal_lm_class(path, config)
    return load_with_expected_extra_keys(
        base_cls, extra_keys, path, config=config, **kwargs
    )


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


def _tensors_of(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """Reload any checkpoint this package writes, routed, ready for ``generate()``.

    A folder holding ``ftp_routing.json`` (saved after :class:`FTPModifier`) loads with
    :func:`adadsf_modifier.ftp.load_ftp`; one holding ``adadsf_config.json`` (saved
    after :class:`AdaDSFModifier`) with :func:`load_adadsf`. ``kwargs`` go to
    transformers' ``from_pretrained`` either way.

    :raises AdaDSFCheckpointError: a folder with neither sidecar (the message names
        both) or with both; anything :func:`load_adadsf` raises
    """
    path = Path(path)
    sidecar = checkpoint_sidecar(path)
    if sidecar is not None and not declares_routed_architecture(path):
        _warn_dense_depth_config(path)
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


def _warn_dense_depth_config(path: Path) -> None:
    logger.warning(
        f"AdaDSF: {path} was saved before routed checkpoints declared their "
        "architecture: its config.json names the base model, so AutoModelForCausalLM, "
        "pipeline() and lm-eval load it as the DENSE-DEPTH model (every layer on every "
        "token). Loading it routed here; save it again "
        "(adadsf_modifier.from_pretrained(path).save_pretrained(new_path)) to make "
        "every loader build the routed model or refuse"
    )


def load_adadsf(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
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
    and ``skipped_tokens_kv`` settings, and the router and skip-path
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
    n = len(sidecar.routed_layers)
    logger.info(f"AdaDSF: loaded {path} with {n}/{len(layers)} routed decoder layers")
    return model.eval()
