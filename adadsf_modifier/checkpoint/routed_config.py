"""A routed checkpoint's ``config.json`` declares what it is: the routed architecture.

Before this, a saved AdaDSF or FTP checkpoint kept its base model's ``config.json``
(``"model_type": "llama"``), so every standard loader (``AutoModelForCausalLM``, a
``pipeline``, ``lm_eval --model hf``, a serving stack) silently built the *dense-depth*
model: all layers on every token, with weights fine-tuned for routing. The save now
rewrites ``config.json`` (:func:`declare_routed_architecture`) as::

    {
      "model_type": "adadsf_routed",
      "architectures": ["AdaDSFRoutedForCausalLM"],
      "auto_map": {
        "AutoConfig": "configuration_adadsf_routed.AdaDSFRoutedConfig",
        "AutoModelForCausalLM": "modeling_adadsf_routed.AdaDSFRoutedForCausalLM"
      },
      "base_model_type": "llama",
      "base_architectures": ["LlamaForCausalLM"],
      ...every other field of the base config, quantization_config included...
    }

and writes the two small files ``auto_map`` names next to it. The routing data itself
stays in the sidecar (``adadsf_config.json`` / ``ftp_routing.json``): ``config.json``
only says *that* the model is routed and which base architecture it routes, so nothing
can disagree with the sidecar.

Why this shape, among transformers' mechanisms for models outside its tree:

* **Registration** (``AutoConfig.register`` / ``AutoModelForCausalLM.register``,
  :mod:`.auto_model`, done by ``import adadsf_modifier``): with the package imported,
  ``AutoConfig`` / ``AutoModelForCausalLM`` / ``pipeline`` / llm-compressor's
  ``oneshot(model=PATH)`` build the routed model, no flag needed. This needs a
  ``model_type`` of our own: transformers refuses to remap one of its own config
  classes (``_LazyAutoMapping.register`` ignores keys from ``transformers.*``), which
  is also why an *old* checkpoint (base ``model_type``) cannot be intercepted without a
  monkeypatch.
* **``auto_map`` + remote code**: a process that never imports the package (the
  ``lm_eval`` command line, a notebook) finds ``auto_map``. With
  ``trust_remote_code=True`` transformers imports the checkpoint's two files, which
  import ``adadsf_modifier`` (that registers it) and re-export its classes, so the
  same code builds the same routed model; the files hold no logic of their own, so a
  checkpoint never carries a stale copy of the routing code. Without
  ``trust_remote_code`` transformers refuses ("contains custom code ... pass
  ``trust_remote_code=True``"); with it, but without the package installed, the
  files raise one line naming ``adadsf-modifier``. Their import sits in a ``try``
  block so that transformers' own import check (which would say ``pip install
  adadsf_modifier``, the module name) leaves the message to them.
* **A loader that knows neither** (an older transformers, vLLM without a plug-in)
  refuses the unknown ``model_type`` instead of building the dense model.

The base fields stay at the top level (not nested under a key) so that code that reads
the config without building the model (lm-eval reads ``max_position_embeddings``,
llm-compressor ``quantization_config`` and ``_name_or_path``) finds them where it
looks, and :meth:`AdaDSFRoutedConfig.base_config` rebuilds the base config from them.
llm-compressor's save rewrites ``config.json`` from the folder the model came from
(``resave_config``), so :func:`declare_routed_architecture` runs after it, inside the
package's save hook, and accepts either form (it is idempotent).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedConfig

from adadsf_modifier.atomic import write_text_durably
from adadsf_modifier.checkpoint.sidecar import AdaDSFCheckpointError, read_json_object

__all__ = [
    "AUTO_MAP",
    "CODE_FILES",
    "ROUTED_ARCHITECTURE",
    "ROUTED_MODEL_TYPE",
    "AdaDSFRoutedConfig",
    "base_config_of",
    "declare_routed_architecture",
    "declares_routed_architecture",
    "routed_config_dict",
]

ROUTED_MODEL_TYPE = "adadsf_routed"
ROUTED_ARCHITECTURE = "AdaDSFRoutedForCausalLM"
_BASE_TYPE = "base_model_type"
_BASE_ARCHITECTURES = "base_architectures"
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
CODE_FILES = {
    f"{_CONFIG_MODULE}.py": _HEADER.format(what="config class")
    + _IMPORT.format(name="AdaDSFRoutedConfig"),
    f"{_MODEL_MODULE}.py": _HEADER.format(what="model class (a loader)")
    + _IMPORT.format(name=ROUTED_ARCHITECTURE),
}
"""The files ``auto_map`` names, written into every routed checkpoint."""

# Keys of the routed config that are not the base config's.
_ROUTED_ONLY = (
    "model_type",
    "architectures",
    "auto_map",
    _BASE_TYPE,
    _BASE_ARCHITECTURES,
)


class AdaDSFRoutedConfig(PreTrainedConfig):
    """The config of a routed checkpoint: the base config's fields as they are, plus
    ``base_model_type`` / ``base_architectures``; :meth:`base_config` rebuilds the
    base config (what the routed model runs on)."""

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
        """The base model's config: every field but the routed-only ones, as the
        base architecture's config class reads them (``quantization_config``, and any
        value given to ``from_pretrained`` that landed on this config, included)."""
        from transformers import CONFIG_MAPPING

        if not self.base_model_type:
            raise AdaDSFCheckpointError(
                f"{self.name_or_path or 'this config'}: a routed config without "
                f"{_BASE_TYPE}: the base architecture cannot be rebuilt"
            )
        data = {k: v for k, v in self.to_dict().items() if k not in _ROUTED_ONLY}
        data["architectures"] = self.base_architectures
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
        """Nothing: transformers calls this after importing the checkpoint's remote
        code, and a registered class would then copy this package's module into
        every folder it saves a config to. The package registers itself on import,
        and its save writes ``auto_map``."""


def routed_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s content as the routed architecture's: a base config is
    wrapped, a routed one refreshed (idempotent)."""
    base = _base_config_dict(data)
    routed = {
        "model_type": ROUTED_MODEL_TYPE,
        "architectures": [ROUTED_ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        _BASE_TYPE: base["model_type"],
        _BASE_ARCHITECTURES: base.get("architectures"),
    }
    routed.update({k: v for k, v in base.items() if k not in _ROUTED_ONLY})
    return routed


def _base_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("model_type") != ROUTED_MODEL_TYPE:
        if not data.get("model_type"):
            raise AdaDSFCheckpointError("config.json has no model_type")
        return dict(data)
    base = {k: v for k, v in data.items() if k not in _ROUTED_ONLY}
    base["model_type"] = data.get(_BASE_TYPE)
    base["architectures"] = data.get(_BASE_ARCHITECTURES)
    if not base["model_type"]:
        raise AdaDSFCheckpointError(f"a routed config.json without {_BASE_TYPE}")
    return base


def declare_routed_architecture(folder: Path) -> None:
    """Rewrite ``folder/config.json`` as the routed architecture's and write the
    remote-code files its ``auto_map`` names (durably: the sidecar, written after,
    marks the folder complete)."""
    file = folder / "config.json"
    data = read_json_object(file, "a model's config")
    write_text_durably(file, json.dumps(routed_config_dict(data), indent=2) + "\n")
    for name, text in CODE_FILES.items():
        write_text_durably(folder / name, text)


def declares_routed_architecture(path: str | os.PathLike[str]) -> bool:
    """Whether ``path/config.json`` names the routed architecture (False for a
    checkpoint saved before it did, whose plain loads are the dense-depth model)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        return json.loads(file.read_text()).get("model_type") == ROUTED_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def base_config_of(config: Any) -> Any:
    """``config``'s base config when it is a routed one, else ``config`` itself."""
    if isinstance(config, AdaDSFRoutedConfig):
        return config.base_config()
    return config
