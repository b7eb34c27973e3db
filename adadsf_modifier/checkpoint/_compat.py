"""Workarounds for upstream behaviour that breaks AdaDSF checkpoints.

Each one is tagged (:func:`_targets`) with the releases it was written against and
says why it exists. When a tagged package moves, re-check the workaround: the upstream
fix may make it unnecessary, or harmful. ``tests/test_checkpoint_compat.py`` compares
the tags with the installed versions so that an upgrade cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from loguru import logger
from torch import nn

__all__ = [
    "WORKAROUNDS",
    "load_with_expected_extra_keys",
    "make_recipe_safe",
    "single_decompress_hook",
]

WORKAROUNDS: dict[str, dict[str, str]] = {}
"""``{workaround name: {distribution: release it targets (major.minor)}}``."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _targets(versions: dict[str, str]) -> Callable[[_F], _F]:
    def tag(fn: _F) -> _F:
        WORKAROUNDS[fn.__name__] = dict(versions)
        return fn

    return tag


# ------------------------------------------------------------------------------------
# compressed-tensors 0.19 + llm-compressor 0.14: a second decompress hook on save
# ------------------------------------------------------------------------------------


@_targets({"compressed-tensors": "0.19", "llmcompressor": "0.14"})
@contextlib.contextmanager
def single_decompress_hook(model: nn.Module) -> Iterator[None]:
    """Keep at most one pending "decompress on first forward" hook across a save.

    A compressed model that has not run a forward yet (fresh from
    :func:`~adadsf_modifier.checkpoint.from_pretrained`, or just saved by oneshot)
    carries compressed-tensors' ``ct_decompress_hook``. llm-compressor's save wrapper
    registers a second one without removing the first (compressed-tensors 0.19 keeps a
    single handle attribute), and both then decompress: the weights get multiplied by
    their scales twice. So the pending hook is removed before the inner save (whose
    ``compress_model`` registers a fresh one) and put back if the inner save failed
    before doing so.
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


# ------------------------------------------------------------------------------------
# llm-compressor 0.14: recipe.yaml that its own safe_load refuses
# ------------------------------------------------------------------------------------


class _PlainYamlLoader(yaml.SafeLoader):
    """SafeLoader that turns the two Python tags llm-compressor's recipes contain into
    plain data: ``!!python/tuple [...]`` -> list, ``!!python/object/apply:<Enum>
    [value]`` -> value. Nothing is imported or called; any other Python tag still
    fails."""


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


# ------------------------------------------------------------------------------------
# transformers 5.17: router weights reported as UNEXPECTED keys on load
# ------------------------------------------------------------------------------------


@_targets({"transformers": "5.17"})
def load_with_expected_extra_keys(
    base_cls: type, extra_keys: list[str], path: Path, **kwargs: Any
) -> nn.Module:
    """``base_cls.from_pretrained(path, **kwargs)`` with ``extra_keys`` (regexes)
    expected.

    The router tensors are in the checkpoint but not in the plain model transformers
    builds; its load report would flag them as UNEXPECTED (they are read separately,
    see :mod:`adadsf_modifier.checkpoint.tensors`). transformers only reads the class
    attribute ``_keys_to_ignore_on_load_unexpected``, so a throw-away subclass adds the
    patterns, and the model is switched back to the real class right after loading, so
    nothing else sees the subclass.
    """
    ignore = list(base_cls._keys_to_ignore_on_load_unexpected or []) + extra_keys
    loader = type(
        base_cls.__name__,
        (base_cls,),
        {
            "_keys_to_ignore_on_load_unexpected": ignore,
            "__module__": base_cls.__module__,
        },
    )
    model = loader.from_pretrained(str(path), **kwargs)
    model.__class__ = base_cls
    return model
