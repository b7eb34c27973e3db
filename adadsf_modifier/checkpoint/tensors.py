"""Reading the router (and skip-path) tensors, which transformers does not know, from
a checkpoint's safetensors files, checked (presence, shape, full precision, finite);
the save verifies what it wrote with the same reader."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from adadsf_modifier.checkpoint.sidecar import (
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    AdaDSFSidecar,
    LayerEntry,
    read_json_object,
)
from adadsf_modifier.recipe_checks import ROUTER_HINT, SKIP_PATH_HINT
from adadsf_modifier.routing import SkipPath, TokenRouter

# What compressed-tensors stores next to (or instead of) a quantized weight.
_QUANT_SUFFIXES = (
    "_scale",
    "_zero_point",
    "_packed",
    "_shape",
    "_g_idx",
    "_global_scale",
)


def safetensors_files(path: Path) -> dict[str, Path]:
    """``{tensor name: file}`` over the checkpoint's safetensors files, every header
    read: a missing or truncated shard is named here, before the base model loads
    (transformers' own error names neither the file nor the fix)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        out = {k: _shard(path, index, v) for k, v in _weight_map(index).items()}
        for file in sorted(set(out.values())):
            if not file.is_file():
                raise AdaDSFCheckpointError(
                    f"{index} lists the shard {file.name}, which is missing from "
                    f"{path}: copy the checkpoint again, or save it again"
                )
            _tensor_names(file)
        return out
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise AdaDSFCheckpointError(f"no safetensors weights found in {path}")
    return {k: file for file in files for k in _tensor_names(file)}


def _tensor_names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise AdaDSFCheckpointError(
            f"{file} is not a readable safetensors file ({err}): it is damaged or "
            "truncated; copy the checkpoint again, or save it again"
        ) from None


def _weight_map(index: Path) -> dict[str, str]:
    data = read_json_object(index, "a shard index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise AdaDSFCheckpointError(
            f"{index} has no `weight_map` of tensor names to shard files"
        )
    return weight_map


def _shard(path: Path, index: Path, name: str) -> Path:
    """The shard ``name``, which must lie inside the checkpoint folder."""
    shard = path / name
    if Path(name).is_absolute() or path.resolve() not in shard.resolve().parents:
        raise AdaDSFCheckpointError(
            f"{index} names the shard {name!r}, which is outside {path}"
        )
    return shard


def _expected_shapes(entry: LayerEntry, hidden_size: int) -> dict[str, tuple]:
    with torch.device("meta"):  # shapes only: no memory, no random init
        modules = {"router": TokenRouter(hidden_size, int(entry.router_hidden_size))}
        if entry.skip_path != "identity":
            modules["skip_path"] = SkipPath(hidden_size, entry.skip_path_rank)
    return {
        f"{entry.name}.{part}.{k}": tuple(v.shape)
        for part, module in modules.items()
        for k, v in module.state_dict().items()
    }


def _read_checked(
    path: Path, files: dict, key: str, shape: tuple, where: str, detail: str
) -> torch.Tensor:
    from safetensors import safe_open

    skip = ".skip_path." in key
    what, hint = ("skip path", SKIP_PATH_HINT) if skip else ("router", ROUTER_HINT)
    file = files.get(key)
    if file is None:
        layer = key.rsplit(".", 1)[0] + "."
        quantized = [
            k for k in files if k.startswith(layer) and k.endswith(_QUANT_SUFFIXES)
        ]
        extra = f" (found quantized tensors {quantized}: {hint})" if quantized else ""
        raise AdaDSFCheckpointError(
            f"{what} tensor `{key}`{where} is missing from the safetensors files in "
            f"{path}{extra}"
        )
    with safe_open(str(file), framework="pt") as f:
        tensor = f.get_tensor(key)
    if tuple(tensor.shape) != tuple(shape):
        raise AdaDSFCheckpointError(
            f"{what} tensor `{key}` in {path} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(shape)}{detail}"
        )
    if not tensor.is_floating_point():
        raise AdaDSFCheckpointError(
            f"{what} tensor `{key}` in {path} is {tensor.dtype}, not floating "
            f"point: {what}s must stay in full precision ({hint})"
        )
    if not bool(torch.isfinite(tensor).all()):
        raise AdaDSFCheckpointError(
            f"{what} tensor `{key}` in {path} holds NaN or infinite values: the "
            "checkpoint is corrupt (a layer would run or skip tokens at random)"
        )
    return tensor


def read_expected_tensors(
    path: Path, expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The tensors ``expected`` names (``{name: shape}``), checked."""
    files = safetensors_files(path)
    return {
        key: _read_checked(path, files, key, shape, "", "")
        for key, shape in expected.items()
    }


def read_router_tensors(path: Path, sidecar: AdaDSFSidecar) -> dict[str, torch.Tensor]:
    """Every routed layer's router (and skip-path) tensors, checked; one of a layer the
    sidecar lists as not routed is refused."""
    files = safetensors_files(path)
    hidden = sidecar.hidden_size
    out: dict[str, torch.Tensor] = {}
    for entry in sidecar.routed_layers:
        where = f" of routed layer {entry.index}"
        detail = (
            f" (hidden_size={hidden}, router_hidden_size={entry.router_hidden_size}, "
            f"skip_path_rank={entry.skip_path_rank})"
        )
        for key, shape in _expected_shapes(entry, hidden).items():
            out[key] = _read_checked(path, files, key, shape, where, detail)
    routed_names = {e.name for e in sidecar.routed_layers}
    skip_names = {e.name for e in sidecar.routed_layers if e.skip_path != "identity"}
    all_names = {e.name for e in sidecar.layers}
    for key in files:
        m = re.fullmatch(r"(.*)\.router\.[^.]+\.[^.]+", key)
        if m and m.group(1) not in routed_names and m.group(1) in all_names:
            raise AdaDSFCheckpointError(
                f"{path} holds router tensor `{key}` but {SIDECAR_NAME} says layer "
                f"`{m.group(1)}` is not routed"
            )
        m = re.fullmatch(r"(.*)\.skip_path\.[^.]+", key)
        if m and m.group(1) not in skip_names and m.group(1) in all_names:
            raise AdaDSFCheckpointError(
                f"{path} holds skip path tensor `{key}` but {SIDECAR_NAME} gives layer "
                f"`{m.group(1)}` no skip path"
            )
    return out
