"""Saving and reloading routed (and possibly quantized) AdaDSF checkpoints.

A routed model is an ordinary Hugging Face causal LM whose decoder layers had their
class swapped and a ``router`` child added (see
:mod:`adadsf_modifier.routing.routed_layer`). Saving it therefore writes an ordinary
compressed-tensors checkpoint (llm-compressor's ``save_pretrained`` wrapper) in which
the router weights are plain tensors under ``<layer>.router.fc1.weight`` etc. What the
plain checkpoint cannot say is *which* layers are routed and how; that lives in a
versioned sidecar file, ``adadsf_config.json``, next to ``config.json``. A sidecar
(instead of fields in ``config.json``) survives llm-compressor's ``resave_config``,
which rewrites ``config.json`` from the original model's file at save time, and it
leaves ``config.json`` loadable by vLLM / plain transformers.

Sidecar format (``format_version`` 1)::

    {
      "format": "adadsf",
      "format_version": 1,
      "adadsf_modifier_version": "0.1.0",
      "model_type": "llama",              # must equal config.json's model_type on
      reload "num_hidden_layers": 4,
      "hidden_size": 32,
      "layers_path": "model.layers",
      "router_dtype": "float32",          # informative; reload casts routers to the
      model dtype "layers": [                         # one entry per decoder layer, in
      order
        {"index": 0, "name": "model.layers.0", "routed": true,
         "retention_ratio": 1.0, "similarity": 0.93,
         "router_hidden_size": 64, "router_eps": 1e-06,
         "causal_threshold": null,        # causal routing threshold; null = none,
         "-inf"/"inf" allowed "routing_mode": "auto"},         # the layer's
         routing-mode setting (causal mode)
        ...
      ],
      "modifier": {"class": "AdaDSFModifier", "settings": {"retention": 0.8, ...}}
    }

Readers reject any ``format_version`` they do not know; additive changes (new keys,
which readers ignore) keep the version, anything that changes the meaning of an existing
key bumps it.

Saving is atomic: the inner save writes into a fresh temporary sibling of the
destination, which then gets the sidecar, is verified (router tensors present, full
precision, right shapes) and only then takes the destination's place in one rename
(``renameat2(RENAME_EXCHANGE)`` on Linux when the destination already exists). A failure
at any point leaves the destination exactly as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
import yaml
from loguru import logger
from torch import nn

from adadsf_modifier.routing import (
    RoutedLayer,
    TokenRouter,
    decoder_layers,
    route_layer,
)

__all__ = [
    "AdaDSFCheckpointError",
    "FORMAT_VERSION",
    "SIDECAR_NAME",
    "adadsf_config",
    "attach_checkpoint_support",
    "check_recipe_keeps_routers_unquantized",
    "from_pretrained",
    "install_save_hook",
    "read_adadsf_config",
]

SIDECAR_NAME = "adadsf_config.json"
FORMAT_NAME = "adadsf"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
METADATA_ATTR = "adadsf_metadata"
"""Attribute on the model holding what the routed layers themselves do not know (similarities,
modifier settings). Set by :class:`AdaDSFModifier` after routing and by :func:`from_pretrained`."""

_ROUTER_HINT = "add 're:.*router.*' to the quantization modifier's `ignore` list"
_QUANT_SUFFIXES = (
    "_scale",
    "_zero_point",
    "_packed",
    "_shape",
    "_g_idx",
    "_global_scale",
)


class AdaDSFCheckpointError(ValueError):
    """A checkpoint (or a model about to be saved) is not a valid AdaDSF checkpoint."""


# ------------------------------------------------------------------------------------------------
# What gets written
# ------------------------------------------------------------------------------------------------


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("adadsf-modifier")
    except (
        Exception
    ):  # not installed as a distribution (e.g. a source checkout on sys.path)
        return "unknown"


def _modifier_settings(modifier: Any) -> dict[str, Any]:
    """The modifier's own recipe fields (not llm-compressor's base ``Modifier`` fields),
    as JSON."""
    from llmcompressor.modifiers import Modifier

    own = {k for k in type(modifier).model_fields if k not in Modifier.model_fields}
    # model_dump honours `exclude=True` fields (e.g. align_dataset, a Python-only
    # object)
    settings = modifier.model_dump(include=own)
    return json.loads(json.dumps(settings, default=str))


def _float_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _threshold_to_json(value: Any) -> float | str | None:
    """JSON has no infinities: a layer that keeps every (-inf) or no (inf) token says so
    in text."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return None
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def adadsf_config(model: nn.Module) -> dict[str, Any]:
    """The sidecar dict for ``model`` (read off its routed layers plus its AdaDSF
    metadata)."""
    spec, layers = decoder_layers(model)
    routed = [layer for _, layer in layers if isinstance(layer, RoutedLayer)]
    if not routed:
        raise AdaDSFCheckpointError(
            f"{type(model).__name__} has no routed decoder layers: nothing AdaDSF-specific to save"
        )
    meta = getattr(model, METADATA_ATTR, None) or {}
    sims = meta.get("similarities") or [None] * len(layers)
    if len(sims) != len(layers):
        sims = [None] * len(layers)
    entries = []
    for i, (name, layer) in enumerate(layers):
        is_routed = isinstance(layer, RoutedLayer)
        router = layer.router if is_routed else None
        entries.append(
            {
                "index": i,
                "name": name,
                "routed": is_routed,
                "retention_ratio": float(layer.retention_ratio) if is_routed else 1.0,
                "similarity": _float_or_none(sims[i]),
                "router_hidden_size": int(router.router_hidden_size)
                if is_routed
                else None,
                "router_eps": float(router.eps) if is_routed else None,
                # Causal routing mode: per-layer inference threshold (None: not
                # calibrated, so top-k over the whole sequence) and the layer's
                # routing-mode setting.
                "causal_threshold": _threshold_to_json(
                    getattr(layer, "causal_threshold", None)
                )
                if is_routed
                else None,
                "routing_mode": getattr(layer, "routing_mode", None)
                if is_routed
                else None,
            }
        )
    router_dtype = next(routed[0].router.parameters()).dtype
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "adadsf_modifier_version": _package_version(),
        "model_type": spec.model_type,
        "num_hidden_layers": len(layers),
        "hidden_size": int(model.config.hidden_size),
        "layers_path": spec.layers_path,
        "router_dtype": str(router_dtype).removeprefix("torch."),
        "layers": entries,
        "modifier": meta.get("modifier"),
    }


# ------------------------------------------------------------------------------------------------
# Routers must stay in full precision
# ------------------------------------------------------------------------------------------------


def check_recipe_keeps_routers_unquantized(
    layer_names: list[str], modifiers=None
) -> None:
    """Fail before any work if a later quantization modifier of the recipe would
    quantize a router.

    Called by :class:`AdaDSFModifier` before calibration with the names of the layers it
    is about to route. A quantized router would silently change which tokens run each
    layer (and its ``fc2`` has a single output row); the routers are a rounding error of
    the model's size anyway.
    """
    if modifiers is None:
        try:
            from llmcompressor.core import active_session

            modifiers = list(active_session().lifecycle.recipe.modifiers)
        except Exception:  # no session (direct use outside oneshot): nothing to check
            return
        # Modifiers initialised before AdaDSF attached their schemes before the routers
        # existed.
        ours = [
            i for i, m in enumerate(modifiers) if type(m).__name__ == "AdaDSFModifier"
        ]
        if ours:
            modifiers = modifiers[ours[0] + 1 :]
    from compressed_tensors.utils import is_match
    from llmcompressor.modifiers.quantization.quantization.mixin import (
        QuantizationMixin,
    )

    probe = nn.Linear(
        1, 1
    )  # routers are made of nn.Linear; class-name targets match it
    for mod in modifiers:
        if not isinstance(mod, QuantizationMixin):
            continue
        try:
            targets = mod.resolved_targets
            ignore = list(mod.ignore or [])
        except Exception:  # let the modifier report its own configuration error later
            continue
        for layer in layer_names:
            for part in ("fc1", "fc2"):
                name = f"{layer}.router.{part}"
                if is_match(name, probe, targets, ignore):
                    raise ValueError(
                        f"{type(mod).__name__} (targets={sorted(targets)}, ignore={ignore}) would "
                        f"quantize the AdaDSF router `{name}`; routers must stay in full "
                        f"precision: {_ROUTER_HINT}"
                    )


def _check_model_routers_unquantized(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if (
            ".router" in name
            and getattr(module, "quantization_scheme", None) is not None
        ):
            raise AdaDSFCheckpointError(
                f"the AdaDSF router `{name}` was quantized ({module.quantization_scheme}); routers "
                f"must stay in full precision: {_ROUTER_HINT} and run the recipe again"
            )


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------


def attach_checkpoint_support(
    model: nn.Module, modifier: Any = None, similarities=None
) -> None:
    """Record AdaDSF metadata on ``model`` and make every ``save_pretrained`` write it.

    Called by :class:`AdaDSFModifier` right after routing (so before any later modifier
    runs and before oneshot's ``post_process`` saves), and by :func:`from_pretrained`.
    """
    meta = dict(getattr(model, METADATA_ATTR, None) or {})
    if modifier is not None:
        meta["modifier"] = {
            "class": type(modifier).__name__,
            "settings": _modifier_settings(modifier),
        }
        similarities = (
            similarities if similarities is not None else modifier.similarities
        )
    if similarities is not None:
        meta["similarities"] = [float(s) for s in similarities]
    # object.__setattr__: a plain attribute, never a submodule/parameter/buffer.
    object.__setattr__(model, METADATA_ATTR, meta)
    install_save_hook(model)


def install_save_hook(model: nn.Module) -> None:
    """Wrap ``model.save_pretrained`` (once) so that every save is AdaDSF-complete and
    atomic.

    The wrapped function is llm-compressor's compressed-tensors ``save_pretrained``
    wrapper (``modify_save_pretrained``, applied here if oneshot has not applied it
    yet), so ``save_compressed`` / ``quantization_format`` keep working. Ours carries
    ``_overridden = True`` (copied by ``functools.wraps``), so a later
    ``modify_save_pretrained`` (e.g. a second oneshot on the same model) leaves it in
    place instead of wrapping it.
    """
    if getattr(model.save_pretrained, "_adadsf_save_hook", False):
        return
    from llmcompressor.transformers.compression.compressed_tensors_utils import (
        modify_save_pretrained,
    )

    modify_save_pretrained(model)  # no-op when oneshot already wrapped it
    inner = model.save_pretrained
    model_ref = weakref.ref(model)

    @functools.wraps(inner)
    def save_pretrained(save_directory, *args, **kwargs):
        model = model_ref()
        if model is None:
            raise RuntimeError(
                "the model this save_pretrained belonged to no longer exists"
            )
        return _atomic_save(model, save_directory, inner, *args, **kwargs)

    save_pretrained._adadsf_save_hook = True
    save_pretrained._overridden = True
    model.save_pretrained = save_pretrained


def _is_source_process() -> bool:
    try:
        from compressed_tensors.distributed import is_source_process

        return is_source_process()
    except Exception:
        return True


def _atomic_save(model: nn.Module, save_directory, inner, *args, **kwargs) -> None:
    if kwargs.get("push_to_hub"):
        raise NotImplementedError(
            "AdaDSF checkpoints are saved atomically through a temporary folder; push_to_hub is "
            "not supported: save locally, then upload the folder"
        )
    if not _is_source_process():
        # llm-compressor's wrapper writes only on the source rank; the others just take
        # part in its collective steps, so they need neither a temporary folder nor a
        # sidecar.
        return inner(save_directory, *args, **kwargs)

    dest = Path(save_directory).absolute()
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(
            f"cannot save a checkpoint to {dest}: it exists and is a file"
        )
    # Everything that can fail without touching the disk, first.
    _check_model_routers_unquantized(model)
    sidecar = adadsf_config(model)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.adadsf-tmp-", dir=dest.parent))
    try:
        _chmod_like(tmp, dest)
        with _single_decompress_hook(model):
            inner(str(tmp), *args, **kwargs)
        _make_recipe_safe(tmp / "recipe.yaml")
        _verify_saved_routers(tmp, sidecar)
        _write_json(tmp / SIDECAR_NAME, sidecar)
        if dest.is_dir():
            _carry_over(dest, tmp)
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_routed = sum(e["routed"] for e in sidecar["layers"])
    logger.info(f"AdaDSF: saved {n_routed} routed layers and their routers to {dest}")


@contextlib.contextmanager
def _single_decompress_hook(model: nn.Module):
    """Keep at most one pending "decompress on first forward" hook across a save.

    A compressed model that has not run a forward yet (fresh from
    :func:`from_pretrained`, or just saved by oneshot) carries compressed-tensors'
    ``ct_decompress_hook``. llm-compressor's save wrapper registers a second one without
    removing the first (compressed-tensors 0.19 keeps a single handle attribute), and
    both then decompress: the weights get multiplied by their scales twice. So the
    pending hook is removed before the inner save (whose ``compress_model`` registers a
    fresh one) and put back if the inner save failed before doing so.
    """
    pending = getattr(model, "ct_decompress_hook", None)
    if pending is not None:
        pending.remove()
        delattr(model, "ct_decompress_hook")
    try:
        yield
    finally:
        if pending is not None and getattr(model, "ct_decompress_hook", None) is None:
            from compressed_tensors.compressors import ModelCompressor

            compressor = ModelCompressor.from_pretrained_model(model)
            if compressor is not None:
                compressor.add_decompress_hook(model)


class _PlainYamlLoader(yaml.SafeLoader):
    """SafeLoader that turns the two Python tags llm-compressor's recipes contain into
    plain data: ``!!python/tuple [...]`` -> list, ``!!python/object/apply:<Enum>
    [value]`` -> value. Nothing is imported or called; any other Python tag still
    fails."""


def _enum_value(loader: yaml.SafeLoader, suffix: str, node: yaml.Node):
    if (
        isinstance(node, yaml.SequenceNode)
        and len(node.value) == 1
        and isinstance(node.value[0], yaml.ScalarNode)
    ):
        return loader.construct_scalar(node.value[0])
    raise yaml.constructor.ConstructorError(
        None,
        None,
        f"cannot turn python/object/apply:{suffix} into plain data",
        node.start_mark,
    )


_PlainYamlLoader.add_constructor(
    "tag:yaml.org,2002:python/tuple",
    lambda loader, node: loader.construct_sequence(node),
)
_PlainYamlLoader.add_multi_constructor(
    "tag:yaml.org,2002:python/object/apply:", _enum_value
)


def _make_recipe_safe(path: Path) -> None:
    """Rewrite ``recipe.yaml`` so that ``yaml.safe_load`` (llm-compressor's own reader)
    reads it.

    llm-compressor 0.14 writes the recipe with ``yaml.dump``, which serialises
    SmoothQuant's ``mappings`` as ``!!python/tuple`` and GPTQ's resolved ``actorder`` as
    a Python enum object; its own ``safe_load`` then refuses that file when the
    checkpoint is saved again or used as the starting point of another oneshot. Lists
    and the enum's string value parse back into the same modifier settings (pydantic
    coerces them), so they are written instead.
    """
    if not path.is_file():
        return
    text = path.read_text()
    try:
        yaml.safe_load(text)
        return
    except yaml.YAMLError:
        pass
    try:
        data = yaml.load(text, Loader=_PlainYamlLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        logger.warning(
            f"AdaDSF: left {path} as written; it is not safe-loadable YAML ({e})"
        )
        return
    path.write_text(
        yaml.safe_dump(
            data, allow_unicode=True, sort_keys=False, default_flow_style=None, width=88
        )
    )


def _chmod_like(tmp: Path, dest: Path) -> None:
    """mkdtemp folders are 0700; give the checkpoint the mode a plain mkdir (or the old
    one) had."""
    if dest.is_dir():
        mode = dest.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o777 & ~umask
    tmp.chmod(mode)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# Files a model save (re)writes; everything else already in the destination (a tokenizer
# saved before the model, a README, ...) is carried over into the new checkpoint, as an
# in-place `save_pretrained` would have left it.
_MODEL_ARTIFACTS = re.compile(
    r"(.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|.*\.bin\.index\.json|config\.json|"
    r"generation_config\.json|recipe\.yaml|" + re.escape(SIDECAR_NAME) + r")"
)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(
            src, dst
        )  # same filesystem: free, and leaves the old checkpoint untouched
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path) -> None:
    for entry in old.iterdir():
        target = new / entry.name
        if (
            target.exists()
            or target.is_symlink()
            or _MODEL_ARTIFACTS.fullmatch(entry.name)
        ):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if
    unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(
        err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}"
    )


def _swap_into_place(tmp: Path, dest: Path) -> None:
    if not dest.exists():
        os.rename(tmp, dest)
    elif _rename_exchange(tmp, dest):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous checkpoint
    else:  # two renames; the previous checkpoint is put back if the second one fails
        old = Path(
            tempfile.mkdtemp(prefix=f".{dest.name}.adadsf-old-", dir=dest.parent)
        )
        os.rmdir(old)
        os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):  # persist the rename itself
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------
# Reading safetensors
# ------------------------------------------------------------------------------------------------


def _safetensors_files(path: Path) -> dict[str, Path]:
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


def _expected_router_shapes(
    entry: dict, hidden_size: int
) -> dict[str, tuple[int, ...]]:
    router = TokenRouter(hidden_size, int(entry["router_hidden_size"]))
    return {
        f"{entry['name']}.router.{k}": tuple(v.shape)
        for k, v in router.state_dict().items()
    }


def _read_router_tensors(path: Path, sidecar: dict) -> dict[str, torch.Tensor]:
    """Every routed layer's router tensors, checked for presence, shape and full
    precision."""
    from safetensors import safe_open

    files = _safetensors_files(path)
    hidden = int(sidecar["hidden_size"])
    routed = [e for e in sidecar["layers"] if e["routed"]]
    out: dict[str, torch.Tensor] = {}
    for entry in routed:
        for key, shape in _expected_router_shapes(entry, hidden).items():
            file = files.get(key)
            if file is None:
                quantized = [
                    k
                    for k in files
                    if k.startswith(key.rsplit(".", 1)[0] + ".")
                    and k.endswith(_QUANT_SUFFIXES)
                ]
                extra = (
                    f" (found quantized tensors {quantized}: {_ROUTER_HINT})"
                    if quantized
                    else ""
                )
                raise AdaDSFCheckpointError(
                    f"router tensor `{key}` of routed layer {entry['index']} is missing from the "
                    f"safetensors files in {path}{extra}"
                )
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(key)
            if tuple(tensor.shape) != shape:
                raise AdaDSFCheckpointError(
                    f"router tensor `{key}` in {path} has shape {tuple(tensor.shape)}, expected "
                    f"{shape} (hidden_size={hidden}, router_hidden_size="
                    f"{entry['router_hidden_size']})"
                )
            if not tensor.is_floating_point():
                raise AdaDSFCheckpointError(
                    f"router tensor `{key}` in {path} is {tensor.dtype}, not floating point: "
                    f"routers must stay in full precision ({_ROUTER_HINT})"
                )
            out[key] = tensor
    routed_names = {e["name"] for e in routed}
    for key in files:
        m = re.fullmatch(r"(.*)\.router\.[^.]+\.[^.]+", key)
        if (
            m
            and m.group(1) not in routed_names
            and m.group(1) in {e["name"] for e in sidecar["layers"]}
        ):
            raise AdaDSFCheckpointError(
                f"{path} holds router tensor `{key}` but {SIDECAR_NAME} says layer "
                f"`{m.group(1)}` is not routed"
            )
    return out


def _verify_saved_routers(path: Path, sidecar: dict) -> None:
    """After the inner save: the router tensors are on disk, full precision, right
    shapes."""
    _read_router_tensors(path, sidecar)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def read_adadsf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate ``PATH/adadsf_config.json``; clear errors for anything off."""
    path = Path(path)
    if not path.is_dir():
        raise AdaDSFCheckpointError(
            f"no AdaDSF data in {path}: it is not a local checkpoint folder"
        )
    file = path / SIDECAR_NAME
    if not file.is_file():
        raise AdaDSFCheckpointError(
            f"no AdaDSF data in {path} ({SIDECAR_NAME} not found): save the routed model with "
            "oneshot(..., output_dir=...) or model.save_pretrained(...) after AdaDSFModifier ran"
        )
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdaDSFCheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise AdaDSFCheckpointError(
            f"{file} is not an AdaDSF sidecar (missing format: 'adadsf')"
        )
    version = data.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise AdaDSFCheckpointError(
            f"unknown AdaDSF format_version {version!r} in {file}; this adadsf_modifier "
            f"({_package_version()}) reads format_version {list(SUPPORTED_FORMAT_VERSIONS)}: "
            "upgrade adadsf_modifier"
        )
    required = ("model_type", "num_hidden_layers", "hidden_size", "layers")
    missing = [k for k in required if k not in data]
    if missing:
        raise AdaDSFCheckpointError(f"{file} lacks required key(s) {missing}")
    layers = data["layers"]
    if not isinstance(layers, list) or len(layers) != data["num_hidden_layers"]:
        raise AdaDSFCheckpointError(
            f"{file}: `layers` must list all {data['num_hidden_layers']} decoder layers"
        )
    for i, e in enumerate(layers):
        keys = ("index", "name", "routed", "retention_ratio", "router_hidden_size")
        if not isinstance(e, dict) or any(k not in e for k in keys) or e["index"] != i:
            raise AdaDSFCheckpointError(f"{file}: layer entry {i} is malformed: {e!r}")
        if e["routed"]:
            r, h = e["retention_ratio"], e["router_hidden_size"]
            if not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
                raise AdaDSFCheckpointError(
                    f"{file}: layer {i} retention_ratio {r!r} not in [0, 1]"
                )
            if not (isinstance(h, int) and h > 0):
                raise AdaDSFCheckpointError(
                    f"{file}: layer {i} router_hidden_size {h!r} invalid"
                )
    if not any(e["routed"] for e in layers):
        raise AdaDSFCheckpointError(f"{file} lists no routed layer")
    return data


def _router_key_pattern(sidecar: dict) -> str:
    names = [re.escape(e["name"]) for e in sidecar["layers"] if e["routed"]]
    return rf"^({'|'.join(names)})\.router\."


def _any_topk_at_inference(layers) -> bool:
    """True if some routed layer (0 < r < 1) would route top-k in eval mode (no KV cache
    then)."""
    for _, layer in layers:
        if isinstance(layer, RoutedLayer) and 0.0 < float(layer.retention_ratio) < 1.0:
            resolve = getattr(layer, "resolved_routing_mode", None)
            if resolve is None or resolve() == "topk":
                return True
    return False


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """Reload a checkpoint saved after :class:`AdaDSFModifier`, ready for
    ``generate()``.

    The base model loads with ``AutoModelForCausalLM.from_pretrained(path, **kwargs)``:
    a compressed-tensors checkpoint (GPTQ W8A8 / W4A16) goes through transformers'
    compressed-tensors quantizer, so its Linear layers keep their quantization scheme
    and load
    *compressed* (int8 / packed int4 weights plus scales); compressed-tensors
      decompresses them on
    the first forward pass (pass
    ``quantization_config=CompressedTensorsConfig(dequantize=True)`` to dequantize at
    load time instead). The decoder layers listed as routed in ``adadsf_config.json``
    are then routed again with their saved retention ratios and router sizes, and the
    router tensors (which transformers does not know about) are read from the
    safetensors files with shape checks.

    Top-k routing chooses over the whole sequence and cannot continue from a KV cache:
    if any routed layer would route top-k in eval mode (no causal-mode threshold saved),
    the returned model's ``generation_config.use_cache`` is False, so ``generate()``
    re-runs the full sequence per new token. Checkpoints with causal-mode thresholds
    keep the cache.

    :raises AdaDSFCheckpointError: no/unknown/malformed AdaDSF data, ``model_type``
        mismatch, a missing, mis-shaped or quantized router tensor
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = Path(path)
    sidecar = read_adadsf_config(path)
    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=kwargs.get("trust_remote_code", False)
        )
    if config.model_type != sidecar["model_type"]:
        raise AdaDSFCheckpointError(
            f"{path}: {SIDECAR_NAME} was written for model_type {sidecar['model_type']!r} but "
            f"config.json says {config.model_type!r}"
        )
    try:
        base_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as e:
        raise AdaDSFCheckpointError(
            f"{path}: no causal-LM class for {type(config).__name__}"
        ) from e
    if isinstance(base_cls, (list, tuple)):
        base_cls = base_cls[0]
    router_tensors = _read_router_tensors(path, sidecar)  # fail before the big load

    # A throw-away subclass that only tells transformers the router keys are expected
    # extras (so its load report does not flag them as UNEXPECTED); the model is
    # switched back to the real class right after loading, so nothing else sees it.
    ignore = list(base_cls._keys_to_ignore_on_load_unexpected or []) + [
        _router_key_pattern(sidecar)
    ]
    loader = type(
        base_cls.__name__,
        (base_cls,),
        {
            "_keys_to_ignore_on_load_unexpected": ignore,
            "__module__": base_cls.__module__,
        },
    )
    model = loader.from_pretrained(str(path), config=config, **kwargs)
    model.__class__ = base_cls

    spec, layers = decoder_layers(model)
    if len(layers) != sidecar["num_hidden_layers"]:
        raise AdaDSFCheckpointError(
            f"{path}: the model has {len(layers)} decoder layers, {SIDECAR_NAME} lists "
            f"{sidecar['num_hidden_layers']}"
        )
    if int(model.config.hidden_size) != int(sidecar["hidden_size"]):
        raise AdaDSFCheckpointError(
            f"{path}: hidden_size {model.config.hidden_size} != {SIDECAR_NAME}'s "
            f"{sidecar['hidden_size']}"
        )
    dtype = model.get_input_embeddings().weight.dtype
    for entry, (name, layer) in zip(sidecar["layers"], layers):
        if not entry["routed"]:
            continue
        router = TokenRouter(
            model.config.hidden_size,
            int(entry["router_hidden_size"]),
            eps=float(entry.get("router_eps") or 1e-6),
        )
        prefix = f"{entry['name']}.router."
        router.load_state_dict(
            {
                k[len(prefix) :]: v
                for k, v in router_tensors.items()
                if k.startswith(prefix)
            }
        )
        route_layer(
            layer,
            router,
            float(entry["retention_ratio"]),
            entry["index"],
            spec.cache_kwarg,
            model.config,
        )
        layer.router.to(dtype=dtype)
        if entry.get("causal_threshold") is not None:
            layer.causal_threshold = float(entry["causal_threshold"])
        if entry.get("routing_mode") is not None:
            layer.routing_mode = entry["routing_mode"]

    model.eval()
    if (
        _any_topk_at_inference(layers)
        and getattr(model, "generation_config", None) is not None
    ):
        model.generation_config.use_cache = False
    meta = {
        "modifier": sidecar.get("modifier"),
        "similarities": [e.get("similarity") for e in sidecar["layers"]],
    }
    object.__setattr__(model, METADATA_ATTR, meta)
    install_save_hook(model)
    n = sum(e["routed"] for e in sidecar["layers"])
    logger.info(f"AdaDSF: loaded {path} with {n}/{len(layers)} routed decoder layers")
    return model.eval()
