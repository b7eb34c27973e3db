"""Reading the router tensors of a checkpoint from its safetensors files.

transformers does not know the routers, so it neither loads nor checks them; they are
read here, by name, with their presence, shape and full precision checked against the
sidecar. The same reader verifies a freshly written checkpoint before it is published.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from adadsf_modifier.checkpoint.sidecar import (
    SIDECAR_NAME,
    AdaDSFCheckpointError,
    AdaDSFSidecar,
    LayerEntry,
)
from adadsf_modifier.recipe_checks import ROUTER_HINT
from adadsf_modifier.routing import TokenRouter

__all__ = ["read_router_tensors", "safetensors_files"]

# What compressed-tensors stores next to (or instead of) a quantized weight.
_QUANT_SUFFIXES = (
    "_scale", "_zero_point", "_packed", "_shape", "_g_idx", "_global_scale",
)  # fmt: skip


def safetensors_files(path: Path) -> dict[str, Path]:
    """``{tensor name: file}`` over the checkpoint's safetensors files (sharded or
    not)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise AdaDSFCheckpointError(f"no safetensors weights found in {path}")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


def _expected_shapes(entry: LayerEntry, hidden_size: int) -> dict[str, tuple]:
    with torch.device("meta"):  # shapes only: no memory, no random init
        router = TokenRouter(hidden_size, int(entry.router_hidden_size))
    return {
        f"{entry.name}.router.{k}": tuple(v.shape)
        for k, v in router.state_dict().items()
    }


def _missing(key: str, entry: LayerEntry, path: Path, files: dict) -> Exception:
    quantized = [
        k
        for k in files
        if k.startswith(key.rsplit(".", 1)[0] + ".") and k.endswith(_QUANT_SUFFIXES)
    ]
    extra = (
        f" (found quantized tensors {quantized}: {ROUTER_HINT})" if quantized else ""
    )
    return AdaDSFCheckpointError(
        f"router tensor `{key}` of routed layer {entry.index} is missing from the "
        f"safetensors files in {path}{extra}"
    )


def read_router_tensors(path: Path, sidecar: AdaDSFSidecar) -> dict[str, torch.Tensor]:
    """Every routed layer's router tensors, checked for presence, shape and full
    precision."""
    from safetensors import safe_open

    files = safetensors_files(path)
    hidden = sidecar.hidden_size
    out: dict[str, torch.Tensor] = {}
    for entry in sidecar.routed_layers:
        for key, shape in _expected_shapes(entry, hidden).items():
            file = files.get(key)
            if file is None:
                raise _missing(key, entry, path, files)
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(key)
            if tuple(tensor.shape) != shape:
                raise AdaDSFCheckpointError(
                    f"router tensor `{key}` in {path} has shape {tuple(tensor.shape)}, "
                    f"expected {shape} (hidden_size={hidden}, router_hidden_size="
                    f"{entry.router_hidden_size})"
                )
            if not tensor.is_floating_point():
                raise AdaDSFCheckpointError(
                    f"router tensor `{key}` in {path} is {tensor.dtype}, not floating "
                    f"point: routers must stay in full precision ({ROUTER_HINT})"
                )
            out[key] = tensor
    routed_names = {e.name for e in sidecar.routed_layers}
    all_names = {e.name for e in sidecar.layers}
    for key in files:
        m = re.fullmatch(r"(.*)\.router\.[^.]+\.[^.]+", key)
        if m and m.group(1) not in routed_names and m.group(1) in all_names:
            raise AdaDSFCheckpointError(
                f"{path} holds router tensor `{key}` but {SIDECAR_NAME} says layer "
                f"`{m.group(1)}` is not routed"
            )
    return out
