"""Leaf helpers shared by calibration, routing, alignment and evaluation (they import
nothing of the package, so any module can use them without a cycle)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from compressed_tensors.distributed import is_source_process
from compressed_tensors.offload import get_execution_device
from llmcompressor.pytorch.utils.helpers import tensors_to_device
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

# The keys of a batch a causal LM's forward takes (not `labels`: no loss wanted).
MODEL_INPUT_KEYS = ("input_ids", "attention_mask")


def allowed_by_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" of a boolean or additive float mask (0 where attending,
    down to the dtype's minimum where masked: half of it separates the two)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def real_token_mask(
    attention_mask: torch.Tensor | None, batch: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """``[batch, seq]`` bool, True for real (non-padding) query tokens, read off the
    mask a decoder layer receives (llm-compressor's sequential pipeline calls layers
    directly): a query is real iff it may attend to itself. ``None`` (SDPA's causal
    fast path) means no padding; a 2D ``[batch, kv_len]`` mask is accepted too."""
    if attention_mask is None:
        return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask[:, -seq_len:].bool()
    if attention_mask.dim() != 4:
        raise ValueError(
            "AdaDSF routing expects a 2D or 4D attention mask, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    kv_len = attention_mask.shape[-1]
    offset = kv_len - seq_len
    diag = torch.diagonal(
        attention_mask[:, 0, -seq_len:, :], offset=offset, dim1=-2, dim2=-1
    )
    return allowed_by_mask(diag).expand(batch, seq_len)


def first_real_tokens(attention_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` bool: each row's first real token in the whole sequence,
    cached past included (the attention sink that always runs): the real query whose
    only allowed key is itself, also when the cached past was all padding."""
    seq_len = real.shape[1]
    if attention_mask.dim() == 2:
        seen = attention_mask.bool().cumsum(dim=1)[:, -seq_len:]
        return real & (seen == 1)
    allowed = allowed_by_mask(attention_mask[:, 0, -seq_len:, :]).sum(dim=-1)
    return real & (allowed.expand_as(real) == 1)


def layer_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """A decoder layer's hidden states as a forward (pre-)hook sees them (models pass
    them positionally or by keyword)."""
    return args[0] if args else kwargs["hidden_states"]


def model_device(model: nn.Module) -> torch.device:
    """Where inputs to ``model`` go (offload-aware; CPU without parameters)."""
    device = get_execution_device(model, default=torch.device("cpu"))
    return torch.device("cpu") if device == "disk" else torch.device(device)


def run_calibration_batches(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    desc: str = "AdaDSF calibration",
) -> int:
    """Forward every batch through ``model`` (no grad, no KV cache); returns how many
    batches."""
    device = model_device(model)
    n = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(
                batches, desc=desc, leave=False, disable=not is_source_process()
            ):
                inputs = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}
                if "input_ids" not in inputs:
                    raise ValueError(
                        "calibration batches need an `input_ids` column, got "
                        f"{sorted(batch)}"
                    )
                model(**tensors_to_device(inputs, device), use_cache=False)
                n += 1
    finally:
        model.train(was_training)
    logger.debug(f"{desc}: {n} batches")
    return n


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(data: Any, indent: int = 1, sort_keys: bool = True) -> str:
    """Strict JSON: non-finite numbers (a diverged run's perplexity) become ``null``
    (``NaN`` is not JSON)."""
    return json.dumps(
        _finite(data), indent=indent, sort_keys=sort_keys, allow_nan=False
    )
