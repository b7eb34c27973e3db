"""Skipped tokens keep contributing keys and values to a routed layer's attention.

With ``skipped_tokens_kv`` a token that skips layer ``l`` still produces the keys and
values the layer would have made from it (its input, after the layer's input norm,
through the key/value projections, rotated at its position), so the tokens that run
the layer attend to the *full* context, as in the dense model; only their queries, the
attention output projection and the MLP are saved for the skipped tokens. A kept
token's output then equals the dense layer's output on the same inputs exactly.

How, without re-implementing attention per architecture: the kept tokens run the
original layer on a compacted batch as usual, but the layer receives a
:class:`MergedKV` in place of its KV cache. When the attention module hands it the
kept tokens' new keys/values (``cache.update``), it puts them at their original
positions among the skipped tokens' (computed here by :func:`project_kv`) and returns
the full-length keys/values, passing them through the model's real cache first when
there is one. The kept queries attend with the rows of the layer's own mask at their
positions, so causality, padding and sliding windows carry over.

The KV cache of such a layer is the model's ordinary dense cache layer (every position
has keys), so incremental decoding equals one full forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from adadsf_modifier.routing.architectures import ArchitectureSpec
from adadsf_modifier.routing.selection import (
    flat_positions,
    gather_position_embeddings,
    gather_tokens,
)
from adadsf_modifier.utils import allowed_by_mask

__all__ = ["MergedKV", "place_kv", "project_kv", "query_rows_mask", "stored_keys"]


def project_kv(
    layer: Any,
    spec: ArchitectureSpec,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, seq, head_dim]`` the layer makes from ``x``.

    The layer's own modules compute them (its input norm, its key/value or fused
    projection, the rotary function of its attention module's source file), so
    quantized projections and biases behave exactly as inside the layer.
    """
    attn = getattr(layer, spec.attention)
    h = getattr(layer, spec.input_norm)(x)
    batch, seq = x.shape[:2]
    head_dim = int(getattr(attn, spec.head_dim_attr))
    if spec.fused_qkv is not None:
        qkv = getattr(attn, spec.fused_qkv)(h).view(batch, seq, -1, 3 * head_dim)
        _, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)
    else:
        k_name, v_name = spec.kv_projections
        k = getattr(attn, k_name)(h).view(batch, seq, -1, head_dim).transpose(1, 2)
        v = getattr(attn, v_name)(h).view(batch, seq, -1, head_dim).transpose(1, 2)
    if position_embeddings is not None:
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        cos, sin = position_embeddings
        _, k = rotate(k[:, :0], k, cos, sin)  # no query heads: only the keys rotate
    return k, v


def stored_keys(cache: Any, layer_idx: int) -> int:
    """Key slots ``cache`` holds for ``layer_idx`` (0 when none yet)."""
    if cache is None or layer_idx >= len(getattr(cache, "layers", ())):
        return 0
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", False):
        return 0
    return int(layer.keys.shape[-2])


class MergedKV:
    """Stands in for the KV cache inside a kv-keeping layer's call on its kept tokens.

    ``keys``/``values`` ``[batch, kv_heads, seq + 1, head_dim]`` hold the skipped
    tokens' keys/values at their positions (``None``: none were skipped); the attention
    module's ``update`` with the kept tokens' keys/values (slots ``index [batch, K]``,
    unused slots at ``seq``) returns the full-length merge, after appending it to
    ``cache`` (the model's cache, or ``None``). ``rows``: decoding with only some rows
    of the batch running: their keys go to those rows of ``keys`` (one position) and
    only those rows come back.
    """

    def __init__(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        index: torch.Tensor | None,
        seq_len: int,
        cache: Any = None,
        rows: torch.Tensor | None = None,
    ):
        self.keys, self.values = keys, values
        self.index, self.seq_len = index, seq_len
        self.cache, self.rows = cache, rows

    def _merge(self, base: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:  # decoding: new [rows, heads, 1, d]
            return base.index_copy(0, self.rows, new)
        # the skipped tokens' buffers are this call's own: the kept keys go in place
        out = place_kv(base, new, self.index, self.seq_len, inplace=True)
        return out[:, :, : self.seq_len]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._merge(self.keys, key_states)
        values = self._merge(self.values, value_states)
        if self.cache is not None:
            keys, values = self.cache.update(keys, values, layer_idx, *args, **kwargs)
        if self.rows is not None:
            keys, values = (
                keys.index_select(0, self.rows),
                values.index_select(0, self.rows),
            )
        return keys, values


def place_kv(
    base: torch.Tensor | None,
    new: torch.Tensor,
    index: torch.Tensor,
    seq_len: int,
    inplace: bool = False,
) -> torch.Tensor:
    """``base`` ``[batch, heads, seq + 1, d]`` (``None``: zeros) with ``new``
    ``[batch, heads, n, d]`` written at the positions ``index [batch, n]`` (unused
    slots at ``seq``, the extra position). ``base`` is left as it was unless
    ``inplace`` (the caller owns it) and it has the layout this function returns.

    Stored position-major (a ``[batch, heads, seq + 1, d]`` view of ``[batch, seq + 1,
    heads, d]`` memory, the layout the attention module's own keys have), so the write
    is a row-wise ``index_copy`` over the flattened ``batch * (seq + 1)`` positions:
    cheaper on CPU than ``scatter`` with an index expanded over heads and dims.
    """
    batch, heads, _, dim = new.shape
    rows = flat_positions(index, seq_len + 1)
    src = new.transpose(1, 2).reshape(-1, heads, dim)
    if base is None:
        out = new.new_zeros(batch * (seq_len + 1), heads, dim).index_copy_(0, rows, src)
    elif inplace and base.transpose(1, 2).is_contiguous():
        out = base.transpose(1, 2).view(-1, heads, dim)
        out.index_copy_(0, rows, src.to(out.dtype))
    else:
        flat = base.transpose(1, 2).reshape(batch * (seq_len + 1), heads, dim)
        out = flat.index_copy(0, rows, src.to(flat.dtype))
    return out.view(batch, seq_len + 1, heads, dim).transpose(1, 2)


def skipped_kv(
    layer: Any,
    spec: ArchitectureSpec,
    x_skipped: torch.Tensor,
    position_embeddings: Any,
    skip_index: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The skipped tokens' keys/values ``[batch, kv_heads, seq + 1, head_dim]`` at their
    positions (zeros elsewhere; unused slots of ``skip_index`` land in the extra one).
    """
    pe = gather_position_embeddings(position_embeddings, skip_index)
    k, v = project_kv(layer, spec, x_skipped, pe)
    return place_kv(None, k, skip_index, seq_len), place_kv(
        None, v, skip_index, seq_len
    )


def query_rows_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    seq_len: int,
    kv_len: int,
) -> torch.Tensor:
    """``[batch, K, kv_len]`` bool: the keys each kept query (position ``index`` among
    the ``seq_len`` new tokens) may see.

    The rows of the layer's own 4D mask at the kept positions (causality, padding,
    sliding window and cached length as the dense layer has them); ``None`` (plain
    causal: transformers leaves the mask out only then) gives the causal rule after
    ``kv_len - seq_len`` cached keys. Unused query slots may see every key (their
    output is dropped; a fully masked row would be NaN).
    """
    batch = index.shape[0]
    if attention_mask is None:
        # unused slots hold ``seq_len`` (select_by_mask's convention): they see all
        keys = torch.arange(kv_len, device=index.device)
        return keys.view(1, 1, -1) <= (kv_len - seq_len + index).unsqueeze(-1)
    full = attention_mask[:, 0]
    idx = index.clamp(max=full.shape[-2] - 1)
    if full.shape[0] == 1 and batch > 1:
        full = full.expand(batch, *full.shape[1:])
    rows = torch.arange(batch, device=index.device).view(batch, 1)
    allowed = allowed_by_mask(full[rows, idx])
    return allowed | ~valid.unsqueeze(-1)


def gather_for_kept(kwargs: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The kept tokens' rotary embeddings and position ids (original positions)."""
    inner = dict(kwargs)
    inner["position_embeddings"] = gather_position_embeddings(
        kwargs.get("position_embeddings"), index
    )
    if kwargs.get("position_ids") is not None:
        inner["position_ids"] = gather_tokens(kwargs["position_ids"], index)
    return inner
