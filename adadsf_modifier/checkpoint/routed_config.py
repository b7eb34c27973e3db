"""A routed checkpoint's ``config.json`` declares the routed architecture, so that no
loader builds the dense-depth model from it.

The save rewrites it (:func:`declare_routed_architecture`, idempotent, after
llm-compressor's ``resave_config``) as the base config's fields, unchanged and at the
top level (lm-eval and llm-compressor read some without building the model), plus
``model_type: adadsf_routed`` (our own: transformers refuses to remap its own config
classes), ``architectures``, ``auto_map`` and ``base_model_type`` /
``base_architectures``. An explicit class (``LlamaForCausalLM.from_pretrained``) reads
the fields, not the ``model_type``, and would build the dense-depth model with a mere
warning: so ``rope_parameters`` moves to ``base_rope_parameters`` and its RoPE type
becomes :data:`ROPE_GUARD`, which no transformers knows and which names the way to load
the checkpoint. Without the package imported, ``trust_remote_code=True`` runs the two
files ``auto_map`` names, which only import the package (no stale copy of its code).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedConfig

from adadsf_modifier.atomic import write_text_durably
from adadsf_modifier.checkpoint.sidecar import AdaDSFCheckpointError, read_json_object

ROUTED_MODEL_TYPE = "adadsf_routed"
ROUTED_ARCHITECTURE = "AdaDSFRoutedForCausalLM"
_BASE_TYPE = "base_model_type"
_BASE_ARCHITECTURES = "base_architectures"
_BASE_ROPE = "base_rope_parameters"
ROPE_GUARD = (
    "adadsf_routed: a depth-routed checkpoint; load it with "
    "adadsf_modifier.from_pretrained(path), or AutoModelForCausalLM after "
    "`import adadsf_modifier`"
)
_CONFIG_MODULE = "configuration_adadsf_routed"
_MODEL_MODULE = "modeling_adadsf_routed"
AUTO_MAP = {
    "AutoConfig": f"{_CONFIG_MODULE}.AdaDSFRoutedConfig",
    "AutoModelForCausalLM": f"{_MODEL_MODULE}.{ROUTED_ARCHITECTURE}",
}

_IMPORT = """\
try:
    from adadsf_modifier import {name}
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] != "adadsf_modifier":
        raise
    raise ImportError(
        "this checkpoint is a depth-routed model saved by adadsf-modifier; install "
        "that package to load it: pip install adadsf-modifier"
    ) from None

__all__ = ["{name}"]
"""
_HEADER = '''\
"""Remote code of a depth-routed checkpoint saved by adadsf-modifier (written by its
save; do not edit). It holds no logic: it imports the installed ``adadsf_modifier``,
which registers the routed architecture with transformers' Auto classes, and re-exports
its {what}. The routing data is the sidecar next to this file."""

'''
CODE_FILES = {  # the files auto_map names, written into every routed checkpoint
    f"{_CONFIG_MODULE}.py": _HEADER.format(what="config class")
    + _IMPORT.format(name="AdaDSFRoutedConfig"),
    f"{_MODEL_MODULE}.py": _HEADER.format(what="model class (a loader)")
    + _IMPORT.format(name=ROUTED_ARCHITECTURE),
}
# Keys of the routed config that are not the base config's.
_ROUTED_ONLY = (
    "model_type",
    "architectures",
    "auto_map",
    _BASE_TYPE,
    _BASE_ARCHITECTURES,
    _BASE_ROPE,
)


class AdaDSFRoutedConfig(PreTrainedConfig):
    model_type = ROUTED_MODEL_TYPE

    def __init__(
        self,
        base_model_type: str | None = None,
        base_architectures: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.base_model_type = base_model_type
        self.base_architectures = base_architectures
        super().__init__(**kwargs)

    def base_config(self) -> PreTrainedConfig:
        from transformers import CONFIG_MAPPING

        if not self.base_model_type:
            raise AdaDSFCheckpointError(
                f"{self.name_or_path or 'this config'}: a routed config without "
                f"{_BASE_TYPE}: the base architecture cannot be rebuilt"
            )
        data = {k: v for k, v in self.to_dict().items() if k not in _ROUTED_ONLY}
        data["architectures"] = self.base_architectures
        if getattr(self, _BASE_ROPE, None) is not None:
            data["rope_parameters"] = getattr(self, _BASE_ROPE)
        try:
            config_class = CONFIG_MAPPING[self.base_model_type]
        except KeyError:
            raise AdaDSFCheckpointError(
                f"{self.name_or_path}: the routed model's base model_type "
                f"{self.base_model_type!r} is not one this transformers knows"
            ) from None
        config = config_class.from_dict(data)
        config._name_or_path = self._name_or_path
        return config

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoConfig") -> None:
        """Nothing: else transformers would copy this module into every folder it saves
        a config to; the package registers itself, and its save writes ``auto_map``."""


def routed_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s content as the routed architecture's (idempotent)."""
    base = _base_config_dict(data)
    routed = {
        "model_type": ROUTED_MODEL_TYPE,
        "architectures": [ROUTED_ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        _BASE_TYPE: base["model_type"],
        _BASE_ARCHITECTURES: base.get("architectures"),
    }
    routed.update({k: v for k, v in base.items() if k not in _ROUTED_ONLY})
    rope = base.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        routed[_BASE_ROPE] = rope
        routed["rope_parameters"] = _guarded(rope)
    return routed


def _guarded(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope`` with :data:`ROPE_GUARD` as its RoPE type (each layer type's)."""
    if all(isinstance(v, dict) for v in rope.values()):
        return {k: _guarded(v) for k, v in rope.items()}
    return {**rope, "rope_type": ROPE_GUARD}


def _base_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("model_type") != ROUTED_MODEL_TYPE:
        if not data.get("model_type"):
            raise AdaDSFCheckpointError("config.json has no model_type")
        return dict(data)
    base = {k: v for k, v in data.items() if k not in _ROUTED_ONLY}
    base["model_type"] = data.get(_BASE_TYPE)
    base["architectures"] = data.get(_BASE_ARCHITECTURES)
    if data.get(_BASE_ROPE) is not None:
        base["rope_parameters"] = data[_BASE_ROPE]
    if not base["model_type"]:
        raise AdaDSFCheckpointError(f"a routed config.json without {_BASE_TYPE}")
    return base


def declare_routed_architecture(folder: Path) -> None:
    """Rewrite ``folder/config.json`` as the routed architecture's, beside the files
    ``auto_map`` names (durably: the sidecar, written after, marks completeness)."""
    file = folder / "config.json"
    data = read_json_object(file, "a model's config")
    write_text_durably(file, json.dumps(routed_config_dict(data), indent=2) + "\n")
    for name, text in CODE_FILES.items():
        write_text_durably(folder / name, text)


def declares_routed_architecture(path: str | os.PathLike[str]) -> bool:
    """Whether ``path/config.json`` names the routed architecture."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        return json.loads(file.read_text()).get("model_type") == ROUTED_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False
