"""How the tokens that run a routed layer attend, and what the skipped tokens give them.

**Kept tokens among themselves** (the default). The kept queries see the kept keys and
the keys this layer cached for earlier tokens that ran it. Their mask is read off the
layer's own 4D mask at the kept (query, key) positions, so causality, padding and
sliding windows carry over (:func:`compact_attention_mask`); where SDPA's causal kernel
is already exact no mask is built (:func:`selected_attention_mask`).

**Skipped tokens keep their keys/values** (``skipped_tokens_kv``). A skipped token still
gives the keys/values the layer would have made from it (:func:`project_kv`), so the
kept tokens attend to the full context and their outputs equal the dense layer's. The
kept tokens run the original layer with a :class:`MergedKV` in place of its cache: its
``update`` puts their keys/values among the skipped tokens' (and through the model's
cache, when there is one). No attention is re-implemented per architecture.

**The kept queries on SDPA's causal kernel.** Scattered kept queries against a
full-length key sequence would need an explicit ``[K, seq]`` mask. With plain causal
attention and nothing cached, the kept queries are instead put at their positions in
a full-length query tensor and attend with ``is_causal=True`` (:class:`KeptQueries`);
on one CPU thread in bfloat16 they go in chunks, each against the keys up to its last
query. The marker reaches SDPA as transformers' ``position_bias``, which
``sdpa_attention_forward`` passes to ``scaled_dot_product_attention`` as
``attn_mask`` unchanged; any other use of it raises, so a transformers change fails
loudly."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from adadsf_modifier.routing.architectures import ArchitectureSpec, apply_named
from adadsf_modifier.routing.selection import (
    flat_positions,
    gather_position_embeddings,
    gather_tokens,
)
from adadsf_modifier.utils import allowed_by_mask

__all__ = [
    "CPU_CHUNKED_DTYPES",
    "CPU_CHUNKED_MAX_THREADS",
    "CPU_QUERY_CHUNK",
    "KeptQueries",
    "MergedKV",
    "attended_pairs",
    "attention_mask_kwargs",
    "causal_kernel_applies",
    "compact_attention_mask",
    "cpu_chunks_for",
    "gather_for_kept",
    "is_causal_padding_mask",
    "kept_kv_pairs",
    "kept_queries_go_in_chunks",
    "place_kv",
    "project_kv",
    "query_rows_mask",
    "selected_attention_mask",
    "stored_keys",
    "to_attention_dtype",
]


# -- kept tokens attending among themselves --------------------------------------------


def selected_attention_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    cache_layer: Any,
    impl: str,
) -> torch.Tensor | None:
    """The mask the selected tokens attend with: ``None`` where the kernel's own
    causal behaviour is exact (no cached past and a causal + padding mask: the
    selected tokens sit in position order and unused slots trail, so SDPA keeps its
    fast causal kernel), else :func:`compact_attention_mask`."""
    batch, k = index.shape
    num_past = cache_layer.num_slots if cache_layer is not None else 0
    if num_past == 0 and impl != "eager" and is_causal_padding_mask(attention_mask):
        return None
    if (
        k == 1
        and attention_mask is None
        and (cache_layer is None or cache_layer.past_fully_visible(1))
    ):
        return None
    return compact_attention_mask(
        attention_mask, index, valid, _past(cache_layer, index)
    )


_MASK_VERDICTS: dict[int, tuple[weakref.ref, bool]] = {}


def is_causal_padding_mask(attention_mask: torch.Tensor | None) -> bool:
    """Whether a layer's mask (no cached past) is causal + key padding and nothing
    else (no window, no packing). Every layer of a forward gets the same mask object,
    so the verdict is remembered per object while it lives."""
    if attention_mask is None:
        return True
    if (
        attention_mask.dim() != 4
        or attention_mask.shape[-1] != attention_mask.shape[-2]
    ):
        return False
    key = id(attention_mask)
    hit = _MASK_VERDICTS.get(key)
    if hit is not None and hit[0]() is attention_mask:
        return hit[1]
    full = attention_mask[:, 0]
    allowed = allowed_by_mask(full)
    n = allowed.shape[-1]
    real = torch.diagonal(allowed, dim1=-2, dim2=-1)  # [batch or 1, n]
    expected = (
        torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
        & real[:, None, :]
    )
    verdict = not bool(((allowed ^ expected) & real[:, :, None]).any())
    for k in [k for k, (ref, _) in _MASK_VERDICTS.items() if ref() is None]:
        del _MASK_VERDICTS[k]
    _MASK_VERDICTS[key] = (weakref.ref(attention_mask), verdict)
    return verdict


def compact_attention_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    past_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean ``[batch, 1, K, past_slots + K]`` mask of the selected queries:
    the layer's own mask at the selected (query, key) positions (``None``: causal),
    after the cached slots ``past_valid`` (``[batch, slots]``, or ``[batch, K,
    slots]`` under a window). Each slot sees itself, so no row is fully masked (SDPA
    would give NaN)."""
    batch, k = index.shape
    device = index.device
    if attention_mask is None:
        allowed = (
            torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(batch, k, k)
        )
    else:
        full = attention_mask[:, 0]
        kv_len = full.shape[-1]
        offset = kv_len - full.shape[-2]  # keys of the current tokens start here
        idx = index.clamp(max=full.shape[-2] - 1)
        if full.shape[0] == 1 and batch > 1:
            full = full.expand(batch, *full.shape[1:])
        rows = torch.arange(batch, device=device).view(batch, 1, 1)
        picked = full[rows, idx.unsqueeze(2), offset + idx.unsqueeze(1)]
        allowed = allowed_by_mask(picked)
    allowed = (allowed & valid.unsqueeze(1)) | torch.eye(
        k, dtype=torch.bool, device=device
    )
    if past_valid is not None and past_valid.shape[-1] > 0:
        if past_valid.dim() == 2:
            past_valid = past_valid.unsqueeze(1)
        past = past_valid.expand(batch, k, past_valid.shape[-1])
        allowed = torch.cat([past, allowed], dim=-1)
    return allowed.unsqueeze(1)


def _past(cache_layer: Any, index: torch.Tensor) -> torch.Tensor | None:
    if cache_layer is None or cache_layer.num_slots == 0:
        return None
    return cache_layer.visible_slots(index.shape[0], index.device, index)


def attended_pairs(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    cache_layer: Any,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[batch]`` (query, key) pairs the selected tokens attend to, cached keys
    included; ``allowed``: the mask used (``None``: the kernel's causal one, rebuilt
    here)."""
    if allowed is None:
        allowed = compact_attention_mask(
            attention_mask, index, valid, _past(cache_layer, index)
        )
    return (allowed[:, 0] & valid.unsqueeze(-1)).sum((1, 2))


def attention_mask_kwargs(
    allowed: torch.Tensor | None,
    dtype: torch.dtype,
    impl: str,
    grouped_query: bool,
    float_mask: bool = False,
) -> dict[str, Any]:
    """The decoder-layer keywords that apply the boolean mask ``allowed`` (``None``:
    none). A grouped-query layer under SDPA gets it as ``position_bias``: an
    ``attention_mask`` would make transformers drop ``enable_gqa`` and copy every
    cached key and value per query head, which costs more than the routing saves."""
    if allowed is None:
        return {"attention_mask": None}
    if impl == "sdpa" and grouped_query:
        # is_causal=False: the mask is complete; transformers would otherwise add a
        # top-left causal mask and crop the keys to the query length.
        return {
            "attention_mask": None,
            "is_causal": False,
            "position_bias": to_attention_dtype(allowed, dtype, False),
        }
    return {
        "attention_mask": to_attention_dtype(
            allowed, dtype, impl != "eager" and not float_mask
        )
    }


def to_attention_dtype(
    mask: torch.Tensor, dtype: torch.dtype, as_bool: bool
) -> torch.Tensor:
    """Boolean mask for SDPA, additive float mask for eager attention."""
    if as_bool:
        return mask
    return torch.where(
        mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min
    )


# -- skipped tokens keep their keys/values (skipped_tokens_kv) -------------------------


def gather_for_kept(kwargs: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The kept tokens' rotary embeddings and position ids (their own positions)."""
    inner = dict(kwargs)
    inner["position_embeddings"] = gather_position_embeddings(
        kwargs.get("position_embeddings"), index
    )
    if kwargs.get("position_ids") is not None:
        inner["position_ids"] = gather_tokens(kwargs["position_ids"], index)
    return inner


def project_kv(
    layer: Any,
    spec: ArchitectureSpec,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, seq, head_dim]`` the layer makes from
    ``x``, through its own modules (input norm, key/value or fused projection, key
    norm, the rotary function of its attention's source file), so quantized
    projections behave as inside the layer."""
    attn = getattr(layer, spec.attention)
    h = apply_named(layer, spec.input_norm, x)
    batch, seq = x.shape[:2]
    head_dim = int(getattr(attn, spec.head_dim_attr))
    if spec.fused_qkv_blocks:  # [all q | all k | all v]
        qkv = getattr(attn, spec.fused_qkv)(h)
        width = spec.num_kv_heads(attn.config) * head_dim
        _, k, v = qkv.split([qkv.shape[-1] - 2 * width, width, width], dim=-1)
    elif spec.fused_qkv is not None:  # per head [q, k, v]
        qkv = getattr(attn, spec.fused_qkv)(h).view(batch, seq, -1, 3 * head_dim)
        _, k, v = qkv.chunk(3, dim=-1)
    else:
        k, v = (getattr(attn, name)(h) for name in spec.kv_projections)
    if spec.key_norm is not None and not spec.key_norm_per_head:
        k = getattr(attn, spec.key_norm)(k)  # over every head at once (OLMo 2)
    k = k.reshape(batch, seq, -1, head_dim)
    if spec.key_norm is not None and spec.key_norm_per_head:
        k = getattr(attn, spec.key_norm)(k)
    k, v = k.transpose(1, 2), v.reshape(batch, seq, -1, head_dim).transpose(1, 2)
    if position_embeddings is not None:
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        cos, sin = position_embeddings
        _, k = rotate(k[:, :0], k, cos, sin)  # no query heads: only the keys rotate
    return k, v


def place_kv(
    base: torch.Tensor | None,
    new: torch.Tensor,
    index: torch.Tensor,
    seq_len: int,
    inplace: bool = False,
) -> torch.Tensor:
    """``base [batch, heads, seq + 1, d]`` (``None``: zeros) with ``new [batch,
    heads, n, d]`` written at positions ``index [batch, n]`` (unused slots at
    ``seq``); ``base`` is written in place only if ``inplace`` and it has this
    function's layout. Position-major memory, so the write is one row-wise
    ``index_copy`` (cheaper than ``scatter`` on CPU)."""
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


class MergedKV:
    """Stands in for the KV cache while a kv-keeping layer runs its kept tokens.

    ``keys``/``values [batch, kv_heads, seq + 1, head_dim]`` hold the skipped tokens'
    keys/values at their positions (``None``: none skipped); ``update`` puts the kept
    tokens' at ``index`` and returns the full-length merge, after appending it to
    ``cache`` (the model's, or ``None``). ``rows``: a decoding step in which only
    those rows run."""

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


def query_rows_mask(
    attention_mask: torch.Tensor | None,
    index: torch.Tensor,
    valid: torch.Tensor,
    seq_len: int,
    kv_len: int,
) -> torch.Tensor:
    """``[batch, K, kv_len]`` bool: the keys each kept query may see: the rows of the
    layer's own mask at the kept positions (``None``: causal after ``kv_len -
    seq_len`` cached keys). Unused query slots see every key (their output is
    dropped)."""
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


def stored_keys(cache: Any, layer_idx: int) -> int:
    """Key slots ``cache`` holds for ``layer_idx`` (0 when none yet)."""
    if cache is None or layer_idx >= len(getattr(cache, "layers", ())):
        return 0
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", False):
        return 0
    return int(layer.keys.shape[-2])


# -- the kept queries on SDPA's causal kernel ------------------------------------------


#: Largest chunk of kept queries per masked attention call on a CPU in bfloat16
#: (chunks are made equal, each at most this many); at most this many kept queries
#: take the causal kernel.
CPU_QUERY_CHUNK = 256
#: The CPU dtypes whose kept queries go in chunks (where the measurement favoured it).
CPU_CHUNKED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
#: The most intra-op threads (``torch.get_num_threads()``) at which the chunks are used:
#: on more threads the causal kernel's own parallelism does as well.
CPU_CHUNKED_MAX_THREADS = 1


def causal_kernel_applies(
    attention_mask: torch.Tensor | None, impl: str, kv_len: int, q_len: int
) -> bool:
    """Whether :class:`KeptQueries` can stand in for the explicit mask: SDPA, plain
    causal attention (transformers passes no mask only then), nothing cached."""
    return impl == "sdpa" and attention_mask is None and kv_len == q_len


class KeptQueries(torch.Tensor):
    """An empty tensor carrying the kept queries' positions ``index [batch, K]`` to
    the one ``scaled_dot_product_attention`` call it is the ``attn_mask`` of."""

    index: torch.Tensor
    seq_len: int

    @staticmethod
    def __new__(cls, index: torch.Tensor, seq_len: int) -> KeptQueries:
        out = torch.Tensor._make_subclass(cls, index.new_empty(0, dtype=torch.float32))
        out.index, out.seq_len = index, int(seq_len)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _attend(*args, **kwargs)
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return f"KeptQueries(seq_len={args[0].seq_len})"
        if getattr(func, "__name__", "") == "__get__" or func is torch.Tensor.data_ptr:
            # .shape, .device, .dtype; data_ptr: the wrapper's "did it move" test
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.to:
            # an offload wrapper (compressed-tensors) moves every tensor argument of
            # the attention module, and copies the marker's attributes onto what it
            # gets back: the marker stays as it is, :func:`_attend` moves the positions
            return args[0]
        raise RuntimeError(
            f"adadsf routing: the kept-queries attention marker reached {func!r}; it "
            "is only valid as the attn_mask of scaled_dot_product_attention (the "
            "installed transformers changed how position_bias reaches SDPA)"
        )


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: KeptQueries,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``query [batch, heads, K, d]`` at ``attn_mask.index`` against the ``seq_len``
    keys, causally: through one full-length causal call (or in chunks,
    :func:`cpu_chunks_for`)."""
    index, n = attn_mask.index, attn_mask.seq_len
    if index.device != query.device:  # the queries were moved, the positions not
        index = index.to(query.device)
    batch, heads, k, dim = query.shape
    if is_causal or key.shape[-2] != n:
        raise RuntimeError(
            f"adadsf routing: kept-queries attention expects {n} keys and "
            f"is_causal=False, got {key.shape[-2]} keys and is_causal={is_causal}"
        )
    if _chunked(query.device, k, query.dtype):
        return _attend_in_chunks(query, key, value, index, n, dropout_p, scale, kwargs)
    slots = flat_positions(index, n + 1)  # unused slots: the extra row n
    full = query.new_zeros(batch * (n + 1), heads, dim)
    full = full.index_copy(0, slots, query.transpose(1, 2).reshape(-1, heads, dim))
    full = full.view(batch, n + 1, heads, dim)[:, :n].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        full, key, value, dropout_p=dropout_p, is_causal=True, scale=scale, **kwargs
    )
    rows = flat_positions(index.clamp(max=n - 1), n)
    out = out.transpose(1, 2).reshape(batch * n, heads, dim).index_select(0, rows)
    return out.view(batch, k, heads, dim).transpose(1, 2)


def cpu_chunks_for(dtype: torch.dtype) -> bool:
    """Whether kept queries of ``dtype`` on a CPU go in chunks at the current thread
    count (when more than :data:`CPU_QUERY_CHUNK` are kept)."""
    return (
        dtype in CPU_CHUNKED_DTYPES
        and torch.get_num_threads() <= CPU_CHUNKED_MAX_THREADS
    )


def kept_queries_go_in_chunks(
    x: torch.Tensor,
    k_max: int,
    attention_mask: torch.Tensor | None,
    impl: str,
    past_keys: int,
) -> bool:
    """Whether a kv-keeping compacted prefill would attend its ``k_max`` kept queries
    in chunks: the one case in which it computes less attention than the dense layer,
    so the routed layer keeps it rather than run attention on every token."""
    q_len = x.shape[1]
    return _chunked(x.device, k_max, x.dtype) and causal_kernel_applies(
        attention_mask, impl, past_keys + q_len, q_len
    )


def _chunked(device: torch.device, kept: int, dtype: torch.dtype) -> bool:
    """Whether ``kept`` kept queries on the causal kernel's path go in chunks."""
    return device.type == "cpu" and kept > CPU_QUERY_CHUNK and cpu_chunks_for(dtype)


def kept_kv_pairs(
    index: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """``[batch]`` (query, key) pairs of the kept queries when skipped tokens keep
    their keys/values: from ``rows`` (:func:`query_rows_mask`), or ``p + 1`` keys for
    position ``p`` under plain causal attention with nothing cached (``None``)."""
    if rows is None:
        return ((index + 1) * valid).sum(1)
    return (rows & valid.unsqueeze(-1)).sum((1, 2))


def _attend_in_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    index: torch.Tensor,
    n: int,
    dropout_p: float,
    scale: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """:func:`_attend`'s result with the kept queries in equal chunks, each against
    the keys up to its last position, causality through the mask (unused slots see
    every key)."""
    k = query.shape[2]
    chunks = -(-k // CPU_QUERY_CHUNK)
    size = -(-k // chunks)
    real = torch.where(index < n, index, -1)
    pad = chunks * size - k
    if pad:
        real = F.pad(real, (0, pad), value=-1)
    # the last real position each chunk holds, over the batch: one host sync
    ends = (real.view(real.shape[0], chunks, size).amax((0, 2)) + 1).tolist()
    keys_at = torch.arange(n, device=index.device)
    out = []
    for c, end in enumerate(ends):
        a, b, end = c * size, min((c + 1) * size, k), max(int(end), 1)
        allowed = keys_at[:end].view(1, 1, end) <= index[:, a:b].unsqueeze(-1)
        out.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=allowed.unsqueeze(1),
                dropout_p=dropout_p,
                scale=scale,
                **kwargs,
            )
        )
    return torch.cat(out, dim=2)
