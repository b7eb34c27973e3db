"""Save and reload an FTP-routed model: ``ftp_routing.json`` next to the weights.

AdaDSF's sidecar schema is built around its per-layer ``TokenRouter`` (``fc1``/``fc2``
of ``hidden -> r -> 1``), so it cannot describe FTP's shared router; this module
writes a small FTP sidecar instead. The routed model's ordinary ``save_pretrained``
already writes the router tensors (``<layer>.router.probe``, ``.quantiles``, and the
shared MLP once under the first routed layer's ``router.mlp``) and skip paths
(``<layer>.skip_path.*``); the sidecar adds the scalars and each layer's ratio,
threshold, skip path (``identity`` or ``ridge`` and its rank) and
``skipped_tokens_kv``. Sidecars written before those two existed load as ``identity``
/ ``false``. :func:`load_ftp` loads the dense model, routes it again and restores those
tensors, so the reloaded model gives the same logits.

The save itself is AdaDSF's (:mod:`adadsf_modifier.checkpoint.save`, given the
:data:`FTP` kind): checks first, write into a temporary folder, router tensors read
back, sidecar last, one rename (an interrupted save leaves the previous folder as it
was), the source rank only under ``torchrun``. ``adadsf_modifier.from_pretrained``
reloads FTP folders through :func:`load_ftp`. Not done: schema versioning beyond
``format``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from adadsf_modifier.atomic import write_text_durably
from adadsf_modifier.checkpoint import CheckpointKind, install_save_hook
from adadsf_modifier.checkpoint.kinds import FTP_SIDECAR_NAME, register_loader
from adadsf_modifier.checkpoint.load import load_base_model
from adadsf_modifier.checkpoint.tensors import read_expected_tensors
from adadsf_modifier.ftp.features import LayerFeatureStats
from adadsf_modifier.ftp.router import (
    FTPLayerRouter,
    FTPRouterMLP,
    attach_context_hooks,
)
from adadsf_modifier.routing import SkipPath, decoder_layers, route_layer, routed_layers
from adadsf_modifier.routing.skip_path import skip_path_of

__all__ = ["FTP", "FTP_SIDECAR", "ftp_sidecar", "install_ftp_save_hook", "load_ftp"]

FTP_SIDECAR = FTP_SIDECAR_NAME
_FORMAT = 1


def _ftp_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in routed_layers(model) if isinstance(m.router, FTPLayerRouter)]


def ftp_sidecar(model: nn.Module) -> dict[str, Any]:
    """The JSON-able description of every FTP-routed layer of ``model``."""
    layers = _ftp_layers(model)
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


def _save_record(model: nn.Module) -> dict[str, Any]:
    """The sidecar, and the router and skip-path tensors (``{name: shape}``) the
    weights files must hold for it: FTP's sidecar does not give the shapes itself."""
    sidecar = ftp_sidecar(model)  # raises for a model without FTP routers
    names = {m: n for n, m in model.named_modules()}
    tensors = {}
    for layer in _ftp_layers(model):
        for part in ("router", "skip_path"):
            module = layer._modules.get(part)
            if module is not None:
                prefix = f"{names[layer]}.{part}."
                tensors.update(
                    {prefix + k: list(v.shape) for k, v in module.state_dict().items()}
                )
    return {"sidecar": sidecar, "tensors": tensors}


def _write_sidecar(folder: Path, record: dict[str, Any]) -> None:
    write_text_durably(folder / FTP_SIDECAR, json.dumps(record["sidecar"], indent=2))


FTP = CheckpointKind(
    label="FTP",
    describe=_save_record,
    as_json=lambda record: record,
    verify=lambda folder, record: read_expected_tensors(
        folder, {k: tuple(v) for k, v in record["tensors"].items()}
    ),
    write=_write_sidecar,
    summary=lambda r: f"{len(r['sidecar']['layers'])} FTP-routed layers and the router",
)
"""FTP's checkpoint kind: ``ftp_routing.json`` through AdaDSF's atomic save."""


def install_ftp_save_hook(model: nn.Module) -> None:
    """Make every ``save_pretrained`` of ``model`` (oneshot's included) an atomic FTP
    checkpoint: the package's save hook (``checkpoint.install_save_hook``, which wraps
    llm-compressor's compressed-tensors wrapper once) with the :data:`FTP` kind."""
    install_save_hook(model, FTP)


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
    routers, ratios and thresholds. ``kwargs`` go to ``from_pretrained``.

    ``adadsf_modifier.from_pretrained`` calls this for a folder holding
    ``ftp_routing.json``; the base model loads as AdaDSF's does
    (``checkpoint.load_base_model``: compressed-tensors checkpoints included, the
    router tensors expected rather than reported as unexpected keys)."""
    path = Path(path)
    sidecar_path = path / FTP_SIDECAR
    if not sidecar_path.is_file():
        raise FileNotFoundError(f"{path} has no {FTP_SIDECAR}: not an FTP checkpoint")
    meta = json.loads(sidecar_path.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"unsupported {FTP_SIDECAR} format {meta.get('format')!r}")
    model = load_base_model(path, [r"\.(router|skip_path)\."], **kwargs)
    spec, layers = decoder_layers(model)
    mlp = FTPRouterMLP(int(meta["mlp_hidden"]))
    names = []
    hidden = model.config.hidden_size
    tensors = _router_tensors(path)
    for j, entry in enumerate(meta["layers"]):
        name, layer = layers[int(entry["index"])]
        stats = LayerFeatureStats(
            torch.zeros(hidden),
            entry["probe_bias"],
            entry["norm_eps"],
            entry["score_mean"],
            entry["score_std"],
            torch.zeros(33),
        )
        router = FTPLayerRouter(
            mlp,
            stats,
            hidden,
            int(meta["position_scale"]),
            float(entry["retention"]),
            int(meta["keep_last"]),
            owner=j == 0,
        )
        skip = None
        if entry.get("skip_path", "identity") != "identity":
            skip = SkipPath(hidden, entry.get("skip_path_rank"))
            _load_into(skip, tensors, f"{name}.skip_path.", f"{path}: skip path")
        route_layer(
            layer,
            router,
            float(entry["retention_ratio"]),
            int(entry["index"]),
            spec.cache_kwarg,
            model.config,
            skip,
            bool(entry.get("skipped_tokens_kv", False)),
        )
        router.float()  # saved in float32 (FTPModifier trains it in float32)
        layer.causal_threshold = entry["causal_threshold"]
        attach_context_hooks(layer)
        names.append(name)
    for name in names:
        router = model.get_submodule(name).router
        _load_into(router, tensors, f"{name}.router.", f"{path}: router")
    install_ftp_save_hook(model)
    return model.eval()


register_loader(FTP_SIDECAR_NAME, load_ftp)
