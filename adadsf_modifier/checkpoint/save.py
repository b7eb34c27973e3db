"""Saving a routed model: every ``save_pretrained`` writes a complete, atomic
checkpoint of the kind its routers need (:class:`.kinds.CheckpointKind`).

The hook wraps llm-compressor's compressed-tensors save (routers are plain tensors to
it): checks that need no disk first; the inner save into a temporary sibling, its
``recipe.yaml`` and ``config.json`` rewritten; the router tensors read back and
checked; the destination's other files (a tokenizer, a README) carried over, never a
sidecar; the sidecar last, as the completeness marker; one rename. A failure leaves
the destination as it was. Under ``torchrun`` every rank calls the save
(llm-compressor's wrapper has collective steps), the ranks must agree on routers and
sidecar, only the source rank writes, and a failure is raised on every rank.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import weakref
from pathlib import Path
from typing import Any

from loguru import logger
from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.atomic import atomic_directory, resolve_destination
from adadsf_modifier.checkpoint._compat import (
    single_decompress_hook,
    write_model_recipe,
)
from adadsf_modifier.checkpoint.kinds import SIDECAR_NAMES, CheckpointKind
from adadsf_modifier.checkpoint.routed_config import (
    CODE_FILES,
    declare_routed_architecture,
)
from adadsf_modifier.checkpoint.sidecar import (
    METADATA_ATTR,
    AdaDSFCheckpointError,
    sidecar_for_model,
    write_sidecar,
)
from adadsf_modifier.checkpoint.tensors import read_router_tensors
from adadsf_modifier.recipe_checks import ROUTER_HINT, SKIP_PATH_HINT

ADADSF = CheckpointKind(
    label="AdaDSF",
    describe=sidecar_for_model,
    as_json=lambda sidecar: sidecar.model_dump(mode="json"),
    verify=read_router_tensors,
    write=write_sidecar,
    summary=lambda s: f"{len(s.routed_layers)} routed layers and their routers",
)


def _modifier_settings(modifier: Any) -> dict[str, Any]:
    """The modifier's own recipe fields (not the base ``Modifier``'s), as JSON."""
    from llmcompressor.modifiers import Modifier

    own = {k for k in type(modifier).model_fields if k not in Modifier.model_fields}
    # model_dump honours `exclude=True` fields (e.g. align_dataset, a Python object)
    settings = modifier.model_dump(include=own)
    return json.loads(json.dumps(settings, default=str))


def attach_checkpoint_support(
    model: nn.Module, modifier: Any = None, similarities: Any = None
) -> None:
    """Record AdaDSF metadata on ``model`` and make every ``save_pretrained`` write
    it."""
    meta = dict(getattr(model, METADATA_ATTR, None) or {})
    if modifier is not None:
        meta["modifier"] = {
            "class": type(modifier).__name__,
            "settings": _modifier_settings(modifier),
        }
        if similarities is None:
            similarities = modifier.similarities
    if similarities is not None:
        meta["similarities"] = [float(s) for s in similarities]
    # object.__setattr__: a plain attribute, never a submodule/parameter/buffer.
    object.__setattr__(model, METADATA_ATTR, meta)
    install_save_hook(model)


def install_save_hook(model: nn.Module, kind: CheckpointKind = ADADSF) -> None:
    """Wrap ``model.save_pretrained`` (once; again only changes the kind) so that every
    save is a complete, atomic checkpoint of ``kind``. It wraps llm-compressor's save
    (``save_compressed`` keeps working); ``_overridden`` makes a later
    ``modify_save_pretrained`` (a second oneshot) leave ours in place."""
    if getattr(model.save_pretrained, "_adadsf_save_hook", None) is not None:
        model.save_pretrained._adadsf_save_hook = kind
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
        kind = save_pretrained._adadsf_save_hook
        return _atomic_save(model, kind, save_directory, inner, *args, **kwargs)

    save_pretrained._adadsf_save_hook = kind
    save_pretrained._overridden = True
    model.save_pretrained = save_pretrained


def _atomic_save(
    model: nn.Module, kind: CheckpointKind, save_directory, inner, *args, **kwargs
) -> None:
    if kwargs.get("push_to_hub"):
        raise NotImplementedError(
            f"{kind.label} checkpoints are saved atomically through a temporary "
            "folder; push_to_hub is not supported: save locally, then upload the folder"
        )
    if distributed.is_distributed():
        return _save_from_source_rank(
            model, kind, save_directory, inner, *args, **kwargs
        )
    dest = _destination(save_directory)
    sidecar = _checked_sidecar(model, kind)
    _write(model, kind, dest, sidecar, inner, *args, **kwargs)


def _destination(save_directory) -> Path:
    dest = resolve_destination(save_directory)  # a symlink: replace its target
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(
            f"cannot save a checkpoint to {dest}: it exists and is a file"
        )
    return dest


def _checked_sidecar(model: nn.Module, kind: CheckpointKind):
    """Everything that can fail without touching the disk."""
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or not (".router" in name or ".skip_path" in name):
            continue
        router = ".router" in name
        what, hint = (
            ("router", ROUTER_HINT) if router else ("skip path", SKIP_PATH_HINT)
        )
        raise AdaDSFCheckpointError(
            f"the {kind.label} {what} `{name}` was quantized ({scheme}); {what}s "
            f"must stay in full precision: {hint} and run the recipe again"
        )
    return kind.describe(model)


def _write(
    model: nn.Module, kind: CheckpointKind, dest: Path, sidecar, inner, *args, **kwargs
) -> None:
    with atomic_directory(dest) as tmp:
        with single_decompress_hook(model):
            inner(str(tmp), *args, **kwargs)
        write_model_recipe(model, tmp / "recipe.yaml")  # how it was made, once
        declare_routed_architecture(tmp)  # every loader: routed, or a refusal
        kind.verify(tmp, sidecar)  # on disk, full precision, right shapes
        if dest.is_dir():
            _carry_over(dest, tmp)
        kind.write(tmp, sidecar)  # last: the completeness marker
    logger.info(f"{kind.label}: saved {kind.summary(sidecar)} to {dest}")


def _save_from_source_rank(
    model: nn.Module, kind: CheckpointKind, save_directory, inner, *args, **kwargs
):
    source = distributed.is_source_process()
    sidecar = distributed.agree_on_errors(lambda: _checked_sidecar(model, kind))
    routers = {
        name: float(p.detach().double().sum()).hex()
        for name, p in model.named_parameters()
        if ".router." in name
    }
    why = "the checkpoint would depend on the rank that writes it"
    distributed.check_same_across_ranks("the router weights", routers, why)
    distributed.check_same_across_ranks(
        f"the {kind.label} sidecar (ratios, thresholds)", kind.as_json(sidecar), why
    )
    dest = distributed.agree_on_errors(
        lambda: _destination(save_directory) if source else None
    )
    if not source:  # the inner save's collective steps; it writes nothing
        inner(save_directory, *args, **kwargs)
        failure = distributed.broadcast_object(None)
        if failure is not None:
            raise AdaDSFCheckpointError(
                f"the source rank failed to save the checkpoint: {failure}"
            )
        return
    try:
        _write(model, kind, dest, sidecar, inner, *args, **kwargs)
    except Exception as e:
        distributed.broadcast_object(f"{type(e).__name__}: {e}")
        raise
    distributed.broadcast_object(None)


# Files a model save (re)writes; everything else in the destination is carried over, as
# an in-place save would leave it. Never a sidecar: the other kind's would describe
# routers the weights do not have.
_MODEL_ARTIFACTS = re.compile(
    r"(.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|.*\.bin\.index\.json|"
    r"config\.json|generation_config\.json|recipe\.yaml|"
    + "|".join(re.escape(name) for name in (*SIDECAR_NAMES, *CODE_FILES))
    + r")"
)


def link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a hard link to ``src`` (to be replaced, never written into), a copy
    across filesystems."""
    try:
        os.link(src, dst)
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
            shutil.copytree(entry, target, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(str(entry), str(target))
