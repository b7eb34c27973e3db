"""Routing one sub-block of a decoder layer: ``route_target`` ``attention`` or ``mlp``.

A pre-norm decoder layer (Llama, Qwen2, Mistral) is two residual sub-blocks::

    h   = x + attention(input_norm(x))        # the attention sub-block
    out = h + mlp(post_attention_norm(h))     # the MLP sub-block

With ``route_target: attention`` (as in Router-Tuning and MindSkip, which route
attention only) the router's selected tokens run the attention sub-block and the others
keep ``h = x``;
*every* token then runs the MLP sub-block. The attention sub-block is routed exactly
like a whole layer (:func:`~adadsf_modifier.routing.routed_layer.run_routed`,
:func:`~adadsf_modifier.routing.routed_layer.decode_step`): selected tokens attend among
themselves at their original positions, and the layer's KV cache keeps only their
keys/values, unless ``skipped_tokens_kv`` is set (then skipped tokens still give
keys/values and the cache is the model's dense one). Prefill + incremental decoding
therefore equals one full forward, as for whole layers.

With ``route_target: mlp`` every token runs the attention sub-block (dense, the model's
own KV cache) and only the selected tokens run the MLP sub-block; the others keep ``out
= h``. The MLP sees one token at a time, so this is a plain gather/scatter.

For every target the router reads the *layer input* ``x`` (what threshold calibration
and the warm start see), and the retention ratio is the fraction of real tokens that
run the routed sub-block. A layer at ratio 1 runs the unchanged decoder layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from adadsf_modifier.routing.architectures import architecture_for_config
from adadsf_modifier.routing.kept_attention import stored_keys
from adadsf_modifier.routing.routed_cache import rank_select, scored_cache_layer
from adadsf_modifier.routing.router import gated
from adadsf_modifier.routing.selection import (
    gather_tokens,
    positions_of,
    scatter_tokens,
)
from adadsf_modifier.utils import real_token_mask

__all__ = [
    "ROUTE_TARGETS",
    "RouteTarget",
    "attention_block",
    "check_route_target",
    "mlp_block",
    "route_mlp",
]

#: What a routed layer's router decides: the whole layer, or one sub-block.
ROUTE_TARGETS = ("layer", "attention", "mlp")
RouteTarget = Literal["layer", "attention", "mlp"]


def check_route_target(
    route_target: str, config: Any, skip_path: bool = False, kv: bool = False
) -> None:
    """Refuse, with one line, a target the architecture or the other options cannot
    take.

    ``skip_path``: a fitted skip path is asked for (it is fitted to a whole layer's
    update, so it goes with ``layer`` only); ``kv``: ``skipped_tokens_kv`` is asked for
    (meaningless for ``mlp``: every token already runs the attention).
    """
    if route_target not in ROUTE_TARGETS:
        raise ValueError(
            f"route_target must be one of {list(ROUTE_TARGETS)}, got {route_target!r}"
        )
    if route_target == "layer":
        return
    architecture_for_config(config).check_sub_blocks(route_target)
    if skip_path:
        raise ValueError(
            f"skip_path 'ridge' is fitted to a whole layer's update: it needs "
            f"route_target 'layer', got {route_target!r}"
        )
    if route_target == "mlp" and kv:
        raise ValueError(
            "skipped_tokens_kv needs route_target 'layer' or 'attention' (with 'mlp' "
            "every token runs the attention)"
        )


def attention_block(layer: Any) -> Callable[..., torch.Tensor]:
    """The attention sub-block of ``layer`` as a forward: ``x + attention(norm(x))``,
    called with the decoder layer's own keyword arguments (which the layer passes on to
    its attention module unchanged)."""
    spec = architecture_for_config(layer._adadsf_config)
    norm, attn = getattr(layer, spec.input_norm), getattr(layer, spec.attention)

    def forward(hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = attn(hidden_states=norm(hidden_states), **kwargs)
        return hidden_states + (out[0] if isinstance(out, tuple) else out)

    return forward


def mlp_block(layer: Any, h: torch.Tensor) -> torch.Tensor:
    """The MLP sub-block of ``layer``: ``h + mlp(post_attention_norm(h))``."""
    spec = architecture_for_config(layer._adadsf_config)
    norm, mlp = getattr(layer, spec.post_attention_norm), getattr(layer, spec.mlp)
    return h + mlp(norm(h))


def route_mlp(layer: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """``route_target: mlp`` at ``r < 1``: every token runs the attention sub-block,
    the selected ones the MLP sub-block too.

    Selection as for a whole layer (top-k or causal thresholds, the first token forced
    unless the batch continues from a cache); the router's gradient is that of the
    MLP's update (straight-through gate, :func:`~adadsf_modifier.routing.router.gated`).
    """
    cache = kwargs.get(layer.cache_kwarg)
    past_len = stored_keys(cache, layer.layer_index)  # before the attention adds
    has_past = past_len > 0
    h = attention_block(layer)(x, **kwargs)
    batch, q_len = x.shape[:2]
    rec = layer.routing_recorder
    if float(layer.retention_ratio) <= 0.0:
        if rec is not None:
            rec.record(layer.layer_index, "removed", batch=batch)
        return h
    mode = layer.resolved_routing_mode()
    if mode == "topk" and has_past:
        raise RuntimeError(
            "AdaDSF top-k routing chooses tokens over the whole sequence and cannot "
            "continue from a KV cache: use causal routing for incremental decoding"
        )
    mask = kwargs.get("attention_mask")
    real = real_token_mask(mask, batch, q_len, x.device)
    scores = layer.router(x)
    if mode == "rank":  # the past scores live on the (dense) cache layer
        store = None if cache is None else scored_cache_layer(cache, layer.layer_index)
        selected = rank_select(
            store,
            past_len,
            scores,
            real,
            float(layer.retention_ratio),
            bool(layer.keep_first_token),
        )
        index, valid, k_max = positions_of(selected)
    else:
        index, valid, k_max = layer.select_tokens(scores, real, mode, has_past, mask)
    if k_max == 0:
        if rec is not None:
            rec.record(layer.layer_index, "skipped", batch=batch)
        return h
    h_sel = gather_tokens(h, index)
    y = mlp_block(layer, h_sel)
    if torch.is_grad_enabled():
        y = gated(y, h_sel, scores.gather(1, index.clamp(max=q_len - 1)))
    if rec is not None:
        kept = valid.sum(1)  # attention is dense here: the observer counts its pairs
        rec.record(layer.layer_index, "gather", kept, torch.zeros_like(kept))
    return scatter_tokens(h, index, y)
