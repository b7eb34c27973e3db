"""The kept tokens' attention over every position, on SDPA's causal kernel.

With ``skipped_tokens_kv`` the tokens that run a layer attend to the keys of *all*
positions, so their queries sit at scattered positions of a full-length key sequence.
Written as an explicit ``[K, seq]`` mask, SDPA computes every (query, key) block and
reads the mask (on the 2-core CPU, bfloat16, seq 1024, 80% kept: 6.4 ms against 4.6
ms for the dense layer's causal attention; ``lab/NOTEBOOK.md`` §4). When the
layer's mask is plain causal and nothing is cached yet (a prefill), the same result
comes from the causal kernel: the kept queries are put at their positions in a
full-length query tensor (zeros elsewhere), attention runs with ``is_causal=True``,
and the kept rows are read back (4.9 ms; the outputs are bit-identical in that
measurement, and equal to the masked form in the tests).

That form still does the dense layer's attention work: the skipped positions' query rows
are zeros, not absent. On a CPU in bfloat16 running one thread, when more than
:data:`CPU_QUERY_CHUNK` queries are kept, they are instead split by position into a few
equal chunks, each attending (through an explicit mask) only to the keys up to its last
query: about half the keys per query on average, as the causal kernel would, and no zero
rows. Measured (the quality variant at 79-81% kept, twins interleaved;
``lab/NOTEBOOK.md`` §4.2): on one thread bfloat16 prefill 3-10% faster at seq
1024 and 2048 on an AVX512-BF16 CPU and 5% faster on an AMX one; float32 within the
run-to-run noise either way (-5% to +2.5%), so float32 keeps the causal kernel, as does
CUDA (an arbitrary mask would leave the flash kernel; not measured). On two threads the
chunks do not pay (AMX: behind the causal kernel in 3 of 4 runs, 0.74 against 0.78 of
the FLOPs ideal on average; AVX512-BF16: even), so more threads than
:data:`CPU_CHUNKED_MAX_THREADS` keep the causal kernel.

How it reaches the kernel without re-implementing each architecture's attention: the
routed layer passes a :class:`KeptQueries` as transformers' ``position_bias`` (with
``attention_mask=None, is_causal=False``, which ``sdpa_attention_forward`` hands to
``torch.nn.functional.scaled_dot_product_attention`` unchanged as ``attn_mask``); its
``__torch_function__`` turns that one call into the causal form. Any other use of it
raises, so a transformers change that touches the bias fails loudly instead of
computing something else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from adadsf_modifier.routing.selection import flat_positions

__all__ = [
    "CPU_CHUNKED_DTYPES",
    "CPU_CHUNKED_MAX_THREADS",
    "CPU_QUERY_CHUNK",
    "KeptQueries",
    "causal_kernel_applies",
    "cpu_chunks_for",
]

#: Largest chunk of kept queries per masked attention call on a CPU in bfloat16
#: (chunks are made equal, each at most this many); at most this many kept queries
#: take the causal kernel. Measured best at ~200-260 queries a chunk for seq 1024
#: and 2048 (``lab/NOTEBOOK.md`` §4.2).
CPU_QUERY_CHUNK = 256
#: The CPU dtypes whose kept queries go in chunks (where the measurement favoured it).
CPU_CHUNKED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
#: The most intra-op threads (``torch.get_num_threads()``) at which the chunks are used:
#: they won on one thread and lost or tied on two (``lab/NOTEBOOK.md`` §4.2-4.3).
CPU_CHUNKED_MAX_THREADS = 1


def cpu_chunks_for(dtype: torch.dtype) -> bool:
    """Whether kept queries of ``dtype`` on a CPU go in chunks (when more than
    :data:`CPU_QUERY_CHUNK` are kept) at the current thread count: the one place the
    rule lives, for :func:`_attend` and for the benchmark that labels its default."""
    return (
        dtype in CPU_CHUNKED_DTYPES
        and torch.get_num_threads() <= CPU_CHUNKED_MAX_THREADS
    )


def causal_kernel_applies(
    attention_mask: torch.Tensor | None, impl: str, kv_len: int, q_len: int
) -> bool:
    """Whether :class:`KeptQueries` can stand in for the explicit mask: SDPA, plain
    causal attention (transformers passes no mask only then), no cached keys."""
    return impl == "sdpa" and attention_mask is None and kv_len == q_len


class KeptQueries(torch.Tensor):
    """An empty tensor carrying the kept queries' positions ``index [batch, K]``
    (unused slots hold ``seq_len``) to the attention call (see the module doc)."""

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
        if getattr(func, "__name__", "") == "__get__":  # .shape, .device, .dtype
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
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
    """``query [batch, heads, K, d]`` at ``attn_mask.index`` against the
    ``seq_len`` keys, causally: through a full-length causal call."""
    index, n = attn_mask.index, attn_mask.seq_len
    batch, heads, k, dim = query.shape
    if is_causal or key.shape[-2] != n:
        raise RuntimeError(
            f"adadsf routing: kept-queries attention expects {n} keys and "
            f"is_causal=False, got {key.shape[-2]} keys and is_causal={is_causal}"
        )
    if (
        query.device.type == "cpu"
        and k > CPU_QUERY_CHUNK
        and cpu_chunks_for(query.dtype)
    ):
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
    """The same result as the causal form: the kept queries in equal chunks along
    their slots, each chunk against the keys up to its last real position, causality
    through the mask (unused slots, at ``n``, see every key: their rows are dropped)."""
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
