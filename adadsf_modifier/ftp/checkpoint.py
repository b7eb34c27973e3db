"""Save and reload an FTP-routed model: ``ftp_routing.json`` next to the weights.

AdaDSF's sidecar describes per-layer ``TokenRouter``s, not FTP's shared router, so FTP
has its own (:class:`FTPSidecar`): scalars and each layer's ratio, threshold and skip
path; the weights hold the tensors (the shared MLP once, under the first routed layer).
The save is AdaDSF's atomic one, given the :data:`FTP` kind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from adadsf_modifier.atomic import write_text_durably
from adadsf_modifier.checkpoint import CheckpointKind, install_save_hook
from adadsf_modifier.checkpoint.kinds import FTP_SIDECAR_NAME as FTP_SIDECAR
from adadsf_modifier.checkpoint.kinds import register_loader
from adadsf_modifier.checkpoint.load import load_base_model, read_config, tensors_of
from adadsf_modifier.checkpoint.sidecar import (
    AdaDSFCheckpointError,
    FiniteFloat,
    PositiveFloat,
    PositiveInt,
    Ratio,
    SidecarSchema,
    SkipPathKind,
    Threshold,
    package_version,
    read_sidecar_file,
    validated_for_save,
)
from adadsf_modifier.checkpoint.tensors import read_expected_tensors, safetensors_files
from adadsf_modifier.ftp.features import NUM_QUANTILES, LayerFeatureStats
from adadsf_modifier.ftp.router import (
    FTPLayerRouter,
    FTPRouterMLP,
    attach_context_hooks,
    ftp_layers,
)
from adadsf_modifier.routing import (
    SkipPath,
    architecture_for_config,
    decoder_layers,
    refuse_empty_inputs,
    route_layer,
)
from adadsf_modifier.routing.skip_path import skip_path_of

_FORMAT = 1


class FTPLayerEntry(SidecarSchema):
    index: Annotated[int, Field(ge=0)]
    retention_ratio: Ratio
    causal_threshold: Threshold
    retention: Ratio
    probe_bias: FiniteFloat
    norm_eps: PositiveFloat
    score_mean: FiniteFloat
    # standardises the probe score: zero would make every feature infinite or clamped
    score_std: PositiveFloat
    skip_path: SkipPathKind = "identity"
    skip_path_rank: PositiveInt | None = None
    skipped_tokens_kv: bool = False

    @model_validator(mode="after")
    def _rank_needs_ridge(self) -> FTPLayerEntry:
        if self.skip_path == "identity" and self.skip_path_rank is not None:
            raise ValueError("skip_path_rank needs skip_path 'ridge'")
        return self


class FTPSidecar(SidecarSchema):
    """``ftp_routing.json``: one entry per routed layer, in model order (the first
    owns the shared MLP's tensors)."""

    format: Literal[_FORMAT]  # type: ignore[valid-type]
    mlp_hidden: PositiveInt
    position_scale: PositiveInt
    keep_last: Annotated[int, Field(ge=0)]
    layers: list[FTPLayerEntry]

    @model_validator(mode="after")
    def _layers_in_model_order(self) -> FTPSidecar:
        if not self.layers:
            raise ValueError("it lists no routed layer")
        for j in range(1, len(self.layers)):
            index, previous = self.layers[j].index, self.layers[j - 1].index
            if index <= previous:
                raise ValueError(
                    f"layers[{j}] has index {index}, not above layers[{j - 1}]'s "
                    f"{previous}: each routed layer is listed once, in model order"
                )
        return self


def _check_ftp_format(file: Path, data: dict[str, Any]) -> None:
    version = data.get("format")
    if version != _FORMAT or isinstance(version, bool):
        raise AdaDSFCheckpointError(
            f"unsupported FTP sidecar format {version!r} in {file}; this "
            f"adadsf_modifier ({package_version()}) reads format {_FORMAT}"
        )


def read_ftp_sidecar(path: str | Path) -> FTPSidecar:
    """Read and validate ``PATH/ftp_routing.json``, without touching any weight."""
    return read_sidecar_file(
        Path(path) / FTP_SIDECAR, FTPSidecar, "FTP", _check_ftp_format
    )


def _save_record(model: nn.Module) -> dict[str, Any]:
    """The sidecar, validated as a file being read, and the router and skip-path
    tensors (``{name: shape}``) the weights must hold for it."""
    layers = ftp_layers(model)
    if not layers:
        raise ValueError("the model has no FTP-routed layers")
    names = {m: n for n, m in model.named_modules()}
    entries, tensors = [], {}
    for m in layers:
        router, skip, threshold = m.router, skip_path_of(m), m.causal_threshold
        entries.append(
            {
                "index": m.layer_index,
                "retention_ratio": float(m.retention_ratio),
                "causal_threshold": None if threshold is None else float(threshold),
                "retention": router.retention,
                "probe_bias": router.probe_bias,
                "norm_eps": router.norm_eps,
                "score_mean": router.score_mean,
                "score_std": router.score_std,
                "skip_path": "identity" if skip is None else "ridge",
                "skip_path_rank": None if skip is None else skip.rank,
                "skipped_tokens_kv": bool(m.skipped_tokens_kv),
            }
        )
        for part in ("router", "skip_path"):
            module = m._modules.get(part)
            if module is not None:
                prefix = f"{names[m]}.{part}."
                tensors.update(
                    {prefix + k: list(v.shape) for k, v in module.state_dict().items()}
                )
    first = layers[0].router
    data = {
        "format": _FORMAT,
        "mlp_hidden": first.router_hidden_size,
        "position_scale": first.position_scale,
        "keep_last": first.keep_last,
        "layers": entries,
    }
    sidecar = validated_for_save(FTPSidecar, data, model, "FTP")
    return {"sidecar": sidecar.model_dump(mode="json"), "tensors": tensors}


def _write_sidecar(folder: Path, record: dict[str, Any]) -> None:
    text = json.dumps(record["sidecar"], indent=2, allow_nan=False) + "\n"
    write_text_durably(folder / FTP_SIDECAR, text)


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


def _layer_names(path: Path, sidecar: FTPSidecar, config: Any) -> list[str]:
    """Each listed layer's module name, its index checked against ``config.json``."""
    spec = architecture_for_config(config)
    count = int(config.num_hidden_layers)
    for j, entry in enumerate(sidecar.layers):
        if entry.index >= count:
            raise AdaDSFCheckpointError(
                f"{path / FTP_SIDECAR}: layers[{j}] has index {entry.index}, but "
                f"config.json gives the model {count} decoder layers"
            )
    return [f"{spec.layers_path}.{entry.index}" for entry in sidecar.layers]


def _new_router(
    mlp: FTPRouterMLP, sidecar: FTPSidecar, j: int, hidden: int
) -> FTPLayerRouter:
    """Layer ``j``'s router as the sidecar describes it (its tensors zero until
    loaded)."""
    entry = sidecar.layers[j]
    stats = LayerFeatureStats(
        torch.zeros(hidden),
        entry.probe_bias,
        entry.norm_eps,
        entry.score_mean,
        entry.score_std,
        torch.zeros(NUM_QUANTILES),
    )
    return FTPLayerRouter(
        mlp,
        stats,
        hidden,
        sidecar.position_scale,
        entry.retention,
        sidecar.keep_last,
        owner=j == 0,
    )


def _new_skip_path(entry: FTPLayerEntry, hidden: int) -> SkipPath | None:
    if entry.skip_path == "identity":
        return None
    return SkipPath(hidden, entry.skip_path_rank)


def _read_router_tensors(
    path: Path, sidecar: FTPSidecar, names: list[str], hidden: int
) -> dict[str, torch.Tensor]:
    """The router and skip-path tensors the sidecar implies, read and checked (none
    may be missing, mis-shaped, not finite, or not described by the sidecar)."""
    expected: dict[str, tuple[int, ...]] = {}
    with torch.device("meta"):
        mlp = FTPRouterMLP(sidecar.mlp_hidden)
        for j, (entry, name) in enumerate(zip(sidecar.layers, names)):
            parts = {"router": _new_router(mlp, sidecar, j, hidden)}
            skip = _new_skip_path(entry, hidden)
            if skip is not None:
                parts["skip_path"] = skip
            for part, module in parts.items():
                for key, value in module.state_dict().items():
                    expected[f"{name}.{part}.{key}"] = tuple(value.shape)
    tensors = read_expected_tensors(path, expected)
    extra = sorted(
        key
        for key in safetensors_files(path)
        if re.search(r"\.(router|skip_path)\.", key) and key not in expected
    )
    if extra:
        what = "skip path" if ".skip_path." in extra[0] else "router"
        raise AdaDSFCheckpointError(
            f"{path} holds {what} tensor `{extra[0]}` (and {len(extra) - 1} more) "
            f"that {FTP_SIDECAR} does not describe: the sidecar and the weights come "
            "from different saves"
        )
    return tensors


def load_ftp(path: str | Path, **kwargs: Any) -> nn.Module:
    """Reload a model saved after :class:`FTPModifier` (``kwargs`` go to
    ``from_pretrained``); the sidecar and router tensors are checked before the base
    model loads."""
    path = Path(path)
    if not (path / FTP_SIDECAR).is_file():
        raise FileNotFoundError(f"{path} has no {FTP_SIDECAR}: not an FTP checkpoint")
    sidecar = read_ftp_sidecar(path)
    config = read_config(path, kwargs)
    names = _layer_names(path, sidecar, config)
    hidden = int(config.hidden_size)
    tensors = _read_router_tensors(path, sidecar, names, hidden)
    model = load_base_model(path, [r"\.(router|skip_path)\."], config=config, **kwargs)
    spec, _ = decoder_layers(model)
    mlp = FTPRouterMLP(sidecar.mlp_hidden)
    for j, (entry, name) in enumerate(zip(sidecar.layers, names)):
        layer = model.get_submodule(name)
        router = _new_router(mlp, sidecar, j, hidden)
        skip = _new_skip_path(entry, hidden)
        if skip is not None:
            skip.load_state_dict(tensors_of(tensors, f"{name}.skip_path."))
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
        router.float()  # saved in float32 (FTPModifier trains it in float32)
        layer.causal_threshold = entry.causal_threshold
        attach_context_hooks(layer)
    for name in names:
        router = model.get_submodule(name).router
        router.load_state_dict(tensors_of(tensors, f"{name}.router."))
    install_save_hook(model, FTP)
    refuse_empty_inputs(model)
    return model.eval()


register_loader(FTP_SIDECAR, load_ftp)
