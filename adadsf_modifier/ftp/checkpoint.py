"""Save and reload an FTP-routed model: ``ftp_routing.json`` next to the weights.

AdaDSF's checkpoint package (sidecar schema, atomic save) is built around its
per-layer ``TokenRouter`` (``fc1``/``fc2`` of ``hidden -> r -> 1``), so its schema
cannot describe FTP's shared router; this module writes a small FTP sidecar instead.
The routed model's ordinary ``save_pretrained`` already writes the router tensors
(``<layer>.router.probe``, ``.quantiles``, and the shared MLP once under the first
routed layer's ``router.mlp``) and skip paths (``<layer>.skip_path.*``); the sidecar
adds the scalars and each layer's ratio, threshold, skip path (``identity`` or
``ridge`` and its rank) and ``skipped_tokens_kv``. Sidecars written before those two
existed load as ``identity`` / ``false``. :func:`load_ftp` loads the dense model, routes
it again and restores those tensors, so the reloaded model gives the same logits.

What this does not do (AdaDSF's checkpoint does): an atomic write through a temporary
folder, multi-rank saves, and schema versioning beyond ``format``.
"""

from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from adadsf_modifier.ftp.features import LayerFeatureStats
from adadsf_modifier.ftp.router import (
    FTPLayerRouter,
    FTPRouterMLP,
    attach_context_hooks,
)
from adadsf_modifier.routing import SkipPath, decoder_layers, route_layer, routed_layers
from adadsf_modifier.routing.skip_path import skip_path_of

__all__ = ["FTP_SIDECAR", "ftp_sidecar", "install_ftp_save_hook", "load_ftp"]

FTP_SIDECAR = "ftp_routing.json"
_FORMAT = 1


def ftp_sidecar(model: nn.Module) -> dict[str, Any]:
    """The JSON-able description of every FTP-routed layer of ``model``."""
    layers = [m for m in routed_layers(model) if isinstance(m.router, FTPLayerRouter)]
    if not layers:
        raise ValueError("the model has no FTP-routed layers")
    first = layers[0].router
    return {
        "format": _FORMAT,
        "mlp_hidden": first.router_hidden_size,
        "position_scale": first.position_scale,
        "keep_last": first.keep_last,
        "layers": [
            {
                "index": m.layer_index,
                "retention_ratio": float(m.retention_ratio),
                "causal_threshold": m.causal_threshold,
                "retention": m.router.retention,
                "probe_bias": m.router.probe_bias,
                "norm_eps": m.router.norm_eps,
                "score_mean": m.router.score_mean,
                "score_std": m.router.score_std,
                **_skip_entry(m),
            }
            for m in layers
        ],
    }


def _skip_entry(layer: nn.Module) -> dict[str, Any]:
    skip = skip_path_of(layer)
    return {
        "skip_path": "identity" if skip is None else "ridge",
        "skip_path_rank": None if skip is None else skip.rank,
        "skipped_tokens_kv": bool(layer.skipped_tokens_kv),
    }


def install_ftp_save_hook(model: nn.Module) -> None:
    """Make every ``save_pretrained`` of ``model`` (oneshot's included) also write the
    FTP sidecar; wraps llm-compressor's compressed-tensors wrapper, once."""
    if getattr(model.save_pretrained, "_ftp_save_hook", False):
        return
    from llmcompressor.transformers.compression.compressed_tensors_utils import (
        modify_save_pretrained,
    )

    modify_save_pretrained(model)
    inner = model.save_pretrained
    ref = weakref.ref(model)

    @functools.wraps(inner)
    def save_pretrained(save_directory, *args, **kwargs):
        sidecar = ftp_sidecar(ref())  # fails before writing anything
        out = inner(save_directory, *args, **kwargs)
        path = Path(save_directory) / FTP_SIDECAR
        path.write_text(json.dumps(sidecar, indent=2))
        return out

    save_pretrained._ftp_save_hook = True
    save_pretrained._overridden = True
    model.save_pretrained = save_pretrained


def _router_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Router and skip-path tensors (the ones transformers does not know about)."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if ".router." in key or ".skip_path." in key:
                    out[key] = f.get_tensor(key)
    return out


def _load_into(module: nn.Module, tensors: dict, prefix: str, what: str) -> None:
    own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as err:
        raise ValueError(
            f"{what} tensors of `{prefix[:-1]}` do not match: "
            f"{str(err).splitlines()[-1].strip()}"
        ) from None


def load_ftp(path: str | Path, **kwargs: Any) -> nn.Module:
    """Reload a model saved after :class:`FTPModifier`: dense weights, then the FTP
    routers, ratios and thresholds. ``kwargs`` go to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    sidecar_path = path / FTP_SIDECAR
    if not sidecar_path.is_file():
        raise FileNotFoundError(f"{path} has no {FTP_SIDECAR}: not an FTP checkpoint")
    meta = json.loads(sidecar_path.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"unsupported {FTP_SIDECAR} format {meta.get('format')!r}")
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    spec, layers = decoder_layers(model)
    mlp = FTPRouterMLP(int(meta["mlp_hidden"]))
    names = []
    hidden = model.config.hidden_size
    tensors = _router_tensors(path)
    for j, entry in enumerate(meta["layers"]):
        name, layer = layers[int(entry["index"])]
        stats = LayerFeatureStats(
            torch.zeros(hidden), entry["probe_bias"], entry["norm_eps"],
            entry["score_mean"], entry["score_std"], torch.zeros(33),
        )  # fmt: skip
        router = FTPLayerRouter(mlp, stats, hidden, int(meta["position_scale"]),
                                float(entry["retention"]), int(meta["keep_last"]),
                                owner=j == 0)  # fmt: skip
        skip = None
        if entry.get("skip_path", "identity") != "identity":
            skip = SkipPath(hidden, entry.get("skip_path_rank"))
            _load_into(skip, tensors, f"{name}.skip_path.", f"{path}: skip path")
        route_layer(layer, router, float(entry["retention_ratio"]), int(entry["index"]),
                    spec.cache_kwarg, model.config, skip,
                    bool(entry.get("skipped_tokens_kv", False)))  # fmt: skip
        router.float()  # saved in float32 (FTPModifier trains it in float32)
        layer.causal_threshold = entry["causal_threshold"]
        attach_context_hooks(layer)
        names.append(name)
    for name in names:
        router = model.get_submodule(name).router
        _load_into(router, tensors, f"{name}.router.", f"{path}: router")
    install_ftp_save_hook(model)
    return model.eval()
