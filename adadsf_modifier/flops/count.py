"""Dense vs routed FLOPs of one batch from per-layer, per-sequence kept counts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from adadsf_modifier.flops.formulas import (
    FlopsReport,
    LayerFlops,
    causal_key_count,
    layer_shape,
)
from adadsf_modifier.routing.selection import tokens_to_keep

__all__ = ["planned_kept", "count_flops"]


def planned_kept(ratios: Sequence[float], seq_lens: Sequence[int]) -> list[list[int]]:
    """``[layer][row]`` kept counts a routed model at ``ratios`` would use (the routed
    layers' own rule), to count FLOPs without a model."""
    return [
        [int(n) if r >= 1.0 else tokens_to_keep(float(r), int(n)) for n in seq_lens]
        for r in ratios
    ]


def _as_table(
    values: Any, num_layers: int, batch: int, name: str, default: Any = None
) -> list[list[int]]:
    if values is None:
        return default
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    table = [[int(v) for v in row] for row in values]
    if len(table) != num_layers:
        raise ValueError(f"{name} has {len(table)} layers, the config has {num_layers}")
    for i, row in enumerate(table):
        if len(row) != batch:
            raise ValueError(
                f"{name}[{i}] has {len(row)} sequences, seq_lens has {batch}"
            )
    return table


def _per_row(value: int | Sequence[int] | None, batch: int, name: str) -> list[int]:
    if value is None:
        return [0] * batch
    if isinstance(value, int):
        return [value] * batch
    out = [int(v) for v in value]
    if len(out) != batch:
        raise ValueError(f"{name} has {len(out)} entries, seq_lens has {batch}")
    return out


def count_flops(
    config: Any,
    kept: Sequence[Sequence[int]] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    routed_layers: Iterable[int] = (),
    router_hidden_size: int | Mapping[int, int] = 64,
    *,
    past_lens: int | Sequence[int] | None = None,
    routed_past_lens: Sequence[Sequence[int]] | torch.Tensor | None = None,
    attended_keys: Sequence[Sequence[int]] | torch.Tensor | None = None,
    dense_keys: Sequence[Sequence[int]] | torch.Tensor | None = None,
    gather_layers: Iterable[int] | None = None,
    dtype_bytes: int = 2,
    skip_path_tokens: Sequence[Sequence[int]] | torch.Tensor | None = None,
    skip_path_ranks: Mapping[int, int | None] | None = None,
    kv_only_tokens: Sequence[Sequence[int]] | torch.Tensor | None = None,
    router_flops_per_token: Mapping[int, int] | None = None,
) -> FlopsReport:
    """Dense vs routed FLOPs of one batch (``docs/flops.md`` names every term).

    Tables are ``[layer][sequence]``: ``kept`` the tokens that ran each layer,
    ``attended_keys``/``dense_keys`` the (query, key) pairs (default: the causal
    formula, an upper bound under a sliding window), ``skip_path_tokens`` and
    ``kv_only_tokens`` the skipped tokens that took each cheap path. ``seq_lens``:
    real new tokens per sequence; ``past_lens``: cached ones. ``router_hidden_size``
    (one, or ``{layer: r}``) sizes AdaDSF's router unless ``router_flops_per_token``
    says. :func:`normalized_flops` fills all of them from what a model ran.
    """
    shape = layer_shape(config)
    lens = [int(n) for n in torch.as_tensor(seq_lens).tolist()]
    batch, L = len(lens), shape.num_layers
    kept_t = _as_table(kept, L, batch, "kept")
    past = _per_row(past_lens, batch, "past_lens")
    r_past = _as_table(routed_past_lens, L, batch, "routed_past_lens", [past] * L)
    routed = frozenset(int(i) for i in routed_layers)
    if any(not 0 <= i < L for i in routed):
        raise ValueError(f"routed_layers {sorted(routed)} out of range for {L} layers")
    for li, row in enumerate(kept_t):
        for b, (k, n) in enumerate(zip(row, lens)):
            if not 0 <= k <= n:
                raise ValueError(
                    f"kept[{li}][{b}] = {k} is not within [0, seq_len = {n}]"
                )
    att = _as_table(attended_keys, L, batch, "attended_keys")
    dk = _as_table(dense_keys, L, batch, "dense_keys")
    zeros = [[0] * batch] * L
    skips = _as_table(skip_path_tokens, L, batch, "skip_path_tokens", zeros)
    kv_only = _as_table(kv_only_tokens, L, batch, "kv_only_tokens", zeros)
    for name, table in (("skip_path_tokens", skips), ("kv_only_tokens", kv_only)):
        for li, row in enumerate(table):
            for b, (s, k, n) in enumerate(zip(row, kept_t[li], lens)):
                if not 0 <= s <= n - k:
                    raise ValueError(
                        f"{name}[{li}][{b}] = {s} is not within [0, seq_len - kept = "
                        f"{n - k}]"
                    )
    ranks = dict(skip_path_ranks or {})
    if gather_layers is None:
        gathers = frozenset(
            li for li in routed if any(0 < k < n for k, n in zip(kept_t[li], lens))
        )
    else:
        gathers = frozenset(int(i) for i in gather_layers)

    def router_cost(layer: int, tokens: int) -> int:
        if router_flops_per_token and layer in router_flops_per_token:
            return int(router_flops_per_token[layer]) * tokens
        r = router_hidden_size
        return shape.router_flops(
            tokens, int(r[layer] if isinstance(r, Mapping) else r)
        )

    real_tokens = sum(lens)
    dense_layers, routed_layers_flops, traffic = [], [], []
    h = shape.hidden_size
    for li in range(L):
        window = shape.sliding_windows[li] if li < len(shape.sliding_windows) else None
        d_pairs = (
            sum(dk[li])
            if dk is not None
            else sum(causal_key_count(n, p, window) for n, p in zip(lens, past))
        )
        dense_layers.append(
            LayerFlops(
                projections=shape.projection_flops(real_tokens),
                attention=shape.attention_flops(d_pairs),
                mlp=shape.mlp_flops(real_tokens),
            )
        )
        k_tokens = sum(kept_t[li])
        r_pairs = (
            sum(att[li])
            if att is not None
            else sum(
                causal_key_count(k, p, window) for k, p in zip(kept_t[li], r_past[li])
            )
        )
        routed_layers_flops.append(
            LayerFlops(
                projections=shape.projection_flops(k_tokens),
                attention=shape.attention_flops(r_pairs),
                mlp=shape.mlp_flops(k_tokens),
                router=router_cost(li, real_tokens) if li in routed else 0,
                skip_path=shape.skip_path_flops(sum(skips[li]), ranks.get(li)),
                kv_only=shape.kv_only_flops(sum(kv_only[li])),
            )
        )
        # gather in (k h) + scatter out (k h) + the copy of the hidden states
        traffic.append(
            (2 * k_tokens * h + real_tokens * h) * int(dtype_bytes)
            if li in gathers
            else 0
        )

    return FlopsReport(
        shape=shape,
        kept=tuple(tuple(row) for row in kept_t),
        seq_lens=tuple(lens),
        routed_layers=routed,
        dense_per_layer=tuple(dense_layers),
        routed_per_layer=tuple(routed_layers_flops),
        lm_head=shape.lm_head_flops(real_tokens),
        memory_traffic_per_layer=tuple(traffic),
        dtype_bytes=int(dtype_bytes),
        notes=(
            "multiply-add = 2 FLOPs; matmuls only (norms, activations, softmax, "
            "rotary, biases, residual adds and the routing gate ignored); real tokens "
            "only",
            "attention counted over causally allowed (query, key) pairs",
            "skip_path: fitted skip maps on skipped tokens; kv_only: keys/values of "
            "skipped tokens (skipped_tokens_kv)",
            "normalized excludes lm_head; normalized_with_lm_head includes it",
            "memory_traffic_bytes: gather/scatter bytes written (2 k h + n h) per "
            "gathering layer; not FLOPs",
        ),
    )
