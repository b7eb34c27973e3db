"""Saving a routed model: every ``save_pretrained`` writes a complete, atomic
checkpoint of the kind the model's routers need (AdaDSF's or FTP's,
:class:`~adadsf_modifier.checkpoint.kinds.CheckpointKind`).

The routed model is an ordinary Hugging Face causal LM whose decoder layers had their
class swapped and a ``router`` child added, so llm-compressor's compressed-tensors
``save_pretrained`` wrapper writes it as an ordinary checkpoint with the router weights
as plain tensors under ``<layer>.router.fc1.weight`` etc. The hook installed here wraps
that save:

1. everything that can fail without touching the disk first (a quantized router, a
   model whose sidecar would not validate);
2. the inner save into a temporary sibling of the destination
   (:func:`adadsf_modifier.atomic.atomic_directory`), its ``recipe.yaml`` rewritten
   as the recipe that made the model, once
   (:func:`~adadsf_modifier.checkpoint._compat.write_model_recipe`), and its
   ``config.json`` as the routed architecture's, with the remote-code files its
   ``auto_map`` names (:mod:`.routed_config`: a loader builds the routed model or
   refuses, never the dense-depth one);
3. the router tensors read back and checked (present, full precision, right shapes);
4. files of an existing destination that a model save does not own (a tokenizer, a
   README) carried over; never a sidecar of either kind;
5. the sidecar, last: it marks the folder a complete checkpoint;
6. one rename puts the folder in place. A failure at any point leaves the destination
   exactly as it was; a SIGKILL leaves a temporary folder that the next save removes.

Under ``torchrun`` every rank calls ``save_pretrained`` (llm-compressor's wrapper
compresses on every rank and synchronises them), but only the source rank writes.
Every rank checks the model first, and the ranks must agree on the routers and the
sidecar (else the checkpoint would depend on the rank that wrote it); any failure,
the source rank's write included, is raised on every rank.
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

__all__ = ["ADADSF", "attach_checkpoint_support", "install_save_hook"]

ADADSF = CheckpointKind(
    label="AdaDSF",
    describe=sidecar_for_model,
    as_json=lambda sidecar: sidecar.model_dump(mode="json"),
    verify=read_router_tensors,
    write=write_sidecar,
    summary=lambda s: f"{len(s.routed_layers)} routed layers and their routers",
)
"""AdaDSF's checkpoint: ``adadsf_config.json`` (:mod:`.sidecar`)."""


def _modifier_settings(modifier: Any) -> dict[str, Any]:
    """The modifier's own recipe fields (not llm-compressor's base ``Modifier``
    fields), as JSON."""
    from llmcompressor.modifiers import Modifier

    own = {k for k in type(modifier).model_fields if k not in Modifier.model_fields}
    # model_dump honours `exclude=True` fields (e.g. align_dataset, a Python object)
    settings = modifier.model_dump(include=own)
    return json.loads(json.dumps(settings, default=str))


def attach_checkpoint_support(
    model: nn.Module, modifier: Any = None, similarities: Any = None
) -> None:
    """Record AdaDSF metadata on ``model`` and make every ``save_pretrained`` write it.

    Called by :class:`AdaDSFModifier` right after routing (so before any later modifier
    runs and before oneshot's ``post_process`` saves), and by
    :func:`~adadsf_modifier.checkpoint.from_pretrained`.
    """
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
    """Wrap ``model.save_pretrained`` (once) so that every save is a complete, atomic
    checkpoint of ``kind`` (AdaDSF's unless told otherwise; FTP passes its own).

    The wrapped function is llm-compressor's compressed-tensors ``save_pretrained``
    wrapper (``modify_save_pretrained``, applied here if oneshot has not applied it
    yet), so ``save_compressed`` / ``quantization_format`` keep working. Ours carries
    ``_overridden = True`` (copied by ``functools.wraps``), so a later
    ``modify_save_pretrained`` (e.g. a second oneshot on the same model) leaves it in
    place instead of wrapping it. Installing again only changes the kind the hook
    writes (the last modifier that routed the model decides).
    """
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


def _check_model_routers_unquantized(model: nn.Module, label: str) -> None:
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        kinds = (
            (".router", "router", ROUTER_HINT),
            (".skip_path", "skip path", SKIP_PATH_HINT),
        )
        for part, what, hint in kinds:
            if part in name:
                raise AdaDSFCheckpointError(
                    f"the {label} {what} `{name}` was quantized ({scheme}); {what}s "
                    f"must stay in full precision: {hint} and run the recipe again"
                )


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
    # Everything that can fail without touching the disk, first.
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
    _check_model_routers_unquantized(model, kind.label)
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
    """Under ``torchrun``: checks on every rank, the write on the source rank only,
    every failure raised on every rank (no rank left waiting in a collective)."""
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
    if not source:
        # llm-compressor's wrapper writes only on the source rank; the others take
        # part in its collective steps.
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


# Files a model save (re)writes; everything else already in the destination (a tokenizer
# saved before the model, a README, ...) is carried over into the new checkpoint, as an
# in-place `save_pretrained` would have left it. Every kind's sidecar is the model's:
# an FTP sidecar carried into an AdaDSF checkpoint (or the reverse) would describe
# routers the weights do not have.
_MODEL_ARTIFACTS = re.compile(
    r"(.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|.*\.bin\.index\.json|"
    r"config\.json|generation_config\.json|recipe\.yaml|"
    + "|".join(re.escape(name) for name in (*SIDECAR_NAMES, *CODE_FILES))
    + r")"
)


def link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a hard link to ``src`` (a checkpoint's weights are not rewritten, and
    the folder they came from stays as it was), a copy across filesystems. Whoever
    changes such a file afterwards must replace it, not write into it."""
    try:
        os.link(src, dst)  # same filesystem: free, and leaves the old folder untouched
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
