"""Workarounds for upstream behaviour that breaks AdaDSF checkpoints, each tagged with
the releases it targets (`tests/test_checkpoint_compat.py` fails when one moves on)."""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from loguru import logger
from torch import nn

from adadsf_modifier.checkpoint.sidecar import AdaDSFCheckpointError

WORKAROUNDS: dict[str, dict[str, str]] = {}  # name -> {distribution: major.minor}

_F = TypeVar("_F", bound=Callable[..., Any])


def _targets(versions: dict[str, str]) -> Callable[[_F], _F]:
    def tag(fn: _F) -> _F:
        WORKAROUNDS[fn.__name__] = dict(versions)
        return fn

    return tag


@_targets({"compressed-tensors": "0.19", "llmcompressor": "0.14"})
@contextlib.contextmanager
def single_decompress_hook(model: nn.Module) -> Iterator[None]:
    """Keep at most one pending "decompress on first forward" hook across a save:
    llm-compressor's save wrapper adds compressed-tensors' ``ct_decompress_hook``
    beside a pending one, and both then decompress (weights scaled twice). The pending
    hook is put back if the save failed before adding its own."""
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
    """SafeLoader reading the two Python tags llm-compressor's recipes contain as plain
    data (``!!python/tuple`` -> list, ``!!python/object/apply:<Enum> [v]`` -> v);
    nothing is imported or called."""


def _enum_value(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
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


@_targets({"llmcompressor": "0.14"})
def make_recipe_safe(path: Path) -> None:
    """Rewrite ``recipe.yaml`` so that llm-compressor's own ``yaml.safe_load`` reads it:
    it writes it with ``yaml.dump`` (SmoothQuant's ``mappings`` as ``!!python/tuple``,
    GPTQ's ``actorder`` as an enum object), then refuses it on the next save or
    oneshot from the checkpoint. Lists and the enum's value mean the same settings."""
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
    path.write_text(_dump(data))


def _dump(data: Any) -> str:
    return yaml.safe_dump(
        data, allow_unicode=True, sort_keys=False, default_flow_style=None, width=88
    )


def _plain_recipe(text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = yaml.load(text, Loader=_PlainYamlLoader)  # noqa: S506 - SafeLoader subclass
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"a recipe is a mapping, not {type(data).__name__}")
    return data


# `append_recipe_dict`'s name for a stage key both recipes had: `X_stage` -> `X_stage_N`
_MERGED_STAGE = re.compile(r"(?P<name>.+_stage)_\d+")


def _stage_name(key: str) -> str | None:
    """The stage a top-level recipe key stands for (None: not a stage, e.g. `args`)."""
    merged = _MERGED_STAGE.fullmatch(key)
    if merged:
        return merged["name"]
    return key if key.endswith("_stage") else None


def _distinct_stages(entries: list[tuple[str, Any]]) -> dict[str, Any]:
    """One recipe from ``(top-level key, body)`` pairs in the order they ran: empty and
    repeated stages dropped, stage keys ending in ``_stage`` (the only ones
    ``Recipe.from_dict`` reads; ``default_stage_0`` -> ``default_stage``, a repeated
    name -> ``default_0_stage``, ``default_1_stage``, ...), the first of other keys."""
    kept: list[tuple[str, str | None, Any]] = []
    bodies: list[Any] = []
    for key, body in entries:
        stage = _stage_name(key)
        if stage is not None:
            if body is None or body == {} or body in bodies:
                continue
            bodies.append(body)
        kept.append((key, stage, body))
    uses = Counter(stage for _, stage, _ in kept if stage is not None)
    taken = {stage for stage, n in uses.items() if n == 1}
    out: dict[str, Any] = {}
    for key, stage, body in kept:
        if stage is None:
            out.setdefault(key, body)
        elif uses[stage] == 1:
            out[stage] = body
        else:
            prefix, n = stage.removesuffix("_stage"), 0
            while f"{prefix}_{n}_stage" in taken:
                n += 1
            taken.add(f"{prefix}_{n}_stage")
            out[f"{prefix}_{n}_stage"] = body
    return out


@_targets({"llmcompressor": "0.14"})
def write_model_recipe(model: nn.Module, path: Path) -> None:
    """Rewrite the saved ``recipe.yaml`` as the recipe that made ``model``: each stage
    once, under keys llm-compressor parses, in plain YAML.

    llm-compressor's save merges the recipe of the folder the model came from with the
    session's: a stage key in both becomes ``X_stage_0`` / ``X_stage_1``, which
    ``Recipe.from_dict`` skips, and the session's recipe is appended whatever model it
    ran on (re-running the file would route the model twice). So: the folder's recipe,
    then the session's only when the session worked on this very model. A recipe that
    is not plain data is left as llm-compressor merged it (made safe), with a warning.
    """
    from llmcompressor.core import active_session
    from llmcompressor.transformers.utils.helpers import infer_recipe_from_model_path

    try:
        entries: list[tuple[str, Any]] = []
        existing = infer_recipe_from_model_path(
            getattr(model, "name_or_path", None) or ""
        )
        if existing:
            entries += _plain_recipe(Path(existing).read_text()).items()
        session = active_session()
        recipe = session.lifecycle.recipe
        worked_on = session.state.model
        if recipe.modifiers and (worked_on is None or worked_on is model):
            entries += _plain_recipe(recipe.yaml()).items()
    except (OSError, ValueError, yaml.YAMLError) as e:
        logger.warning(f"AdaDSF: left {path} as llm-compressor merged it ({e})")
        make_recipe_safe(path)
        return
    path.write_text(_dump(_distinct_stages(entries)))


@_targets({"transformers": "5.17"})
def load_with_expected_extra_keys(
    base_cls: type, extra_keys: list[str], path: Path, **kwargs: Any
) -> nn.Module:
    """``base_cls.from_pretrained(path, **kwargs)`` with ``extra_keys`` (regexes, the
    router tensors) expected instead of reported UNEXPECTED: transformers reads only
    the class attribute ``_keys_to_ignore_on_load_unexpected``, so a throw-away
    subclass sets it; the model gets the real class back right after."""
    ignore = list(base_cls._keys_to_ignore_on_load_unexpected or []) + extra_keys
    loader = type(
        base_cls.__name__,
        (base_cls,),
        {
            "_keys_to_ignore_on_load_unexpected": ignore,
            "__module__": base_cls.__module__,
        },
    )
    model, info = loader.from_pretrained(str(path), output_loading_info=True, **kwargs)
    model.__class__ = base_cls
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        # transformers only warns, and leaves those weights randomly initialised
        raise AdaDSFCheckpointError(
            f"{path}: the safetensors files lack {len(missing)} tensor(s) of the base "
            f"model (e.g. {', '.join(missing[:3])}); the checkpoint is incomplete"
        )
    return model
