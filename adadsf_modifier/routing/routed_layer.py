"""A decoder layer that runs only on the tokens its router selects.

The routed layer is the *same module object* with its class swapped for a subclass of
the original decoder-layer class (``RoutedLlamaDecoderLayer(RoutedLayer,
LlamaDecoderLayer)``): parameter names, hooks, ``isinstance`` checks, GPTQ
``targets``/``ignore`` and the sequential pipeline's ``sequential_targets`` (which match
by class name along the MRO) all keep working, and a reference anyone took to the layer
before routing still points at the routed layer.

The module reads top to bottom: the :class:`RoutedLayer` class (``forward`` binds the
call's arguments, ``_route`` picks the path), then the paths ``_route`` takes:

- the prefill path (``0 < r < 1``, :func:`run_routed`): the selected tokens run the
  layer on a compacted batch, the others take the skip path (identity, or a fitted map,
  :mod:`~adadsf_modifier.routing.skip_path`), and the results are scattered back; with
  ``skipped_tokens_kv`` the skipped tokens' keys/values join the kept tokens' attention
  (:mod:`~adadsf_modifier.routing.kept_attention`). Everything works on the whole batch
  at once; the only host syncs are the compacted widths. Without a gradient, a layer
  keeping skipped tokens' keys/values on a sequential architecture runs its attention
  on every token and its MLP on the kept ones instead (:func:`run_kept_mlp`): the same
  outputs, about half the ops. A layer no token runs (``r = 0``, a removed layer)
  takes :func:`skip_all`.
- the decoding step (one new token per row, causal mode, :func:`decode_step`): no
  gather/scatter along the sequence, only the rows whose token passes the layer's
  threshold run it. It is the hot path of ``generate()``: one host sync per layer and
  step, none more. A layer keeping skipped tokens' keys/values decodes with
  :func:`decode_step_keeping_kv`.

then :func:`route_layer` / :func:`unroute_layer`, which swap the class. Which tokens run
is :mod:`~adadsf_modifier.routing.selection`'s choice.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from adadsf_modifier.routing.architectures import (
    ROUTED_CLASS_MARKER,
    architecture_for_config,
    original_class,
    sliding_windows,
)
from adadsf_modifier.routing.class_swap import swap_class
from adadsf_modifier.routing.kept_attention import (
    KeptQueries,
    MergedKV,
    attended_pairs,
    attention_mask_kwargs,
    causal_kernel_applies,
    gather_for_kept,
    kept_kv_pairs,
    kept_queries_go_in_chunks,
    project_kv,
    query_rows_mask,
    selected_attention_mask,
    skipped_kv,
    stored_keys,
)
from adadsf_modifier.routing.routed_cache import (
    RoutedCacheLayer,
    rank_select,
    routed_cache_layer,
    scored_cache_layer,
)
from adadsf_modifier.routing.router import TokenRouter, gated
from adadsf_modifier.routing.selection import (
    DecodeChoice,
    Selection,
    choose_decode_rows,
    choose_tokens,
    decode_choice_of,
    gather_tokens,
    positions_of,
    scatter_tokens,
)
from adadsf_modifier.routing.skip_path import SkipPath, skip_path_of
from adadsf_modifier.utils import allowed_by_mask, first_real_tokens, real_token_mask

__all__ = [
    "RoutedLayer",
    "check_dense_cache",
    "decode_step",
    "decode_step_keeping_kv",
    "pass_through",
    "route_by_rank",
    "route_layer",
    "routed_class_for",
    "routed_layers",
    "run_routed",
    "skip_all",
    "skipped_slots",
    "unroute_layer",
]


_UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_ROUTED_CLASSES: dict[type, type] = {}


class RoutedLayer(nn.Module):
    """Mixin for routed decoder layers; ``isinstance(layer, RoutedLayer)`` finds them.

    The selected tokens (see :mod:`adadsf_modifier.routing.modes`) run the original
    layer, attending only among themselves (and, with a KV cache, to the earlier tokens
    that ran this layer) at their original positions; the others leave it bit-identical.
    Two variants, off by default (the paper): a fitted ``skip_path`` child gives the
    skipped tokens ``x + u(x)`` instead of ``x``
    (:mod:`~adadsf_modifier.routing.skip_path`), and ``skipped_tokens_kv`` lets them
    keep contributing keys/values, so the selected tokens attend to the full context
    (:mod:`~adadsf_modifier.routing.kept_attention`). The update of a selected token is
    multiplied by a straight-through gate ``1 + sigmoid(s) - sigmoid(s).detach()``
    (:func:`~adadsf_modifier.routing.router.gated`): exactly 1 in value (so an
    untrained router at r = 1 reproduces the dense layer exactly), while the router
    receives ``d loss / d out * (out - skipped) * sigmoid'(s)`` as gradient
    (``skipped``: what the token would get if it skipped).
    """

    router: TokenRouter
    retention_ratio: float
    layer_index: int
    cache_kwarg: str
    routing_mode: str = "auto"
    causal_threshold: float | None = None
    keep_first_token: bool = True
    #: keys per query of this layer's sliding-window attention (None: full causal)
    attention_window: int | None = None
    #: skipped tokens still give keys/values to the attention of the tokens that run
    #: (see :mod:`adadsf_modifier.routing.kept_attention`); their skip path itself is
    #: the ``skip_path`` child module (:class:`SkipPath`), absent for the identity
    skipped_tokens_kv: bool = False
    #: a :class:`~adadsf_modifier.routing.recorder.RoutingRecorder` while one is
    #: attached: the layer then reports what it ran (see ``recorder.py``)
    routing_recorder: Any = None

    def resolved_routing_mode(self) -> str:
        mode = self.routing_mode
        if mode == "auto":
            return (
                "causal"
                if (not self.training and self.causal_threshold is not None)
                else "topk"
            )
        return mode

    def select_tokens(
        self,
        scores: torch.Tensor,
        real: torch.Tensor,
        mode: str | None = None,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> Selection:
        """The :class:`~adadsf_modifier.routing.selection.Selection` ``(index, valid,
        k_max)`` of the tokens this layer runs (``index`` None if none), by the rule of
        ``mode`` (:func:`~adadsf_modifier.routing.selection.choose_tokens`).

        The first real token of a sequence (the attention sink every later token attends
        to) always runs while ``keep_first_token`` is set; in top-k mode it counts
        toward ``K``. ``has_past``: the batch continues from a cache.
        """
        return choose_tokens(
            mode or self.resolved_routing_mode(),
            scores,
            real,
            self.forced_tokens(real, has_past, attention_mask),
            float(self.retention_ratio),
            self.causal_threshold,
            lambda: f"layer {self.layer_index}",
        )

    def forced_tokens(
        self,
        real: torch.Tensor,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``[batch, seq]`` bool: the first real token of each row (it always runs
        while ``keep_first_token`` is set), or ``None``. After a cached past it is read
        off the ``attention_mask`` (``utils.first_real_tokens``)."""
        if not self.keep_first_token:
            return None
        if not has_past:
            return real & (real.cumsum(dim=1) == 1)
        if attention_mask is None:
            return None
        return first_real_tokens(attention_mask, real)

    @property
    def grouped_query_attention(self) -> bool:
        attn = getattr(self, "self_attn", None)
        return getattr(attn, "num_key_value_groups", 1) > 1

    def selected_mask(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mode: str | None = None,
        has_past: bool = False,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, seq]`` bool: which tokens of layer input ``x`` this layer would
        run.

        ``scores``: the router's output on ``x`` when the caller already has it.
        """
        batch, q_len = x.shape[:2]
        real = real_token_mask(attention_mask, batch, q_len, x.device)
        if float(self.retention_ratio) >= 1.0:
            return real
        scores = self.router(x) if scores is None else scores
        index, valid, k_max = self.select_tokens(scores, real, mode, has_past)
        out = torch.zeros(batch, q_len + 1, dtype=torch.bool, device=x.device)
        if k_max:
            out = out.scatter(1, index, valid)
        return out[:, :q_len]

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D401 - see class docstring
        if len(args) > 1:  # bind extra positional args to their names once
            bound = inspect.signature(super().forward).bind(*args, **kwargs)
            args, kwargs = (
                (bound.arguments.pop("hidden_states"),),
                dict(bound.arguments),
            )
            kwargs.update(kwargs.pop("kwargs", {}))
        x = args[0] if args else kwargs.pop("hidden_states")
        return self._route(super().forward, x, kwargs)

    def _route(self, forward: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """Route ``forward`` (the original layer's, bound) over the tokens of ``x``."""
        ratio = float(self.retention_ratio)
        batch, q_len, _ = x.shape
        cache = kwargs.get(self.cache_kwarg)
        # a layer keeping skipped tokens' keys/values caches every position densely
        dense_cache = self.skipped_tokens_kv and ratio > 0.0
        cache_layer = (
            routed_cache_layer(cache, self.layer_index, self.attention_window)
            if cache is not None and ratio < 1.0 and not dense_cache
            else None
        )
        rec = self.routing_recorder

        if ratio <= 0.0:  # a removed layer (ShortGPT-style allocation)
            real = None
            if rec is not None or skip_path_of(self) is not None:
                real = real_token_mask(
                    kwargs.get("attention_mask"), batch, q_len, x.device
                )
            out, skipped = skip_all(self, x, real)
            if rec is not None:
                rec.record(self.layer_index, "removed", batch=batch, skip_path=skipped)
            return pass_through(out, cache_layer)
        impl = getattr(self._adadsf_config, "_attn_implementation", "sdpa")
        if impl in _UNSUPPORTED_ATTENTION:
            raise NotImplementedError(
                "AdaDSF routing supports attn_implementation 'sdpa' and 'eager', got "
                f"{impl!r}"
            )
        attention_mask = kwargs.get("attention_mask")

        if ratio >= 1.0:
            # Every real token runs the layer: call it unchanged (cache included), keep
            # padding. The router only matters for its gradient here, so inference skips
            # it.
            if rec is not None:
                rec.record(self.layer_index, "full", router_ran=torch.is_grad_enabled())
            y = forward(x, **kwargs)
            y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
            if torch.is_grad_enabled():
                y = gated(y, x, self.router(x))
            out = y
            if attention_mask is not None:
                real = real_token_mask(attention_mask, batch, q_len, x.device)
                out = torch.where(real.unsqueeze(-1), y, x)
            return (out, *rest) if rest is not None else out

        scores = self.router(x)

        mode = self.resolved_routing_mode()
        if mode == "causal" and q_len == 1 and self.causal_threshold is not None:
            if self.skipped_tokens_kv:
                if cache is not None:
                    check_dense_cache(cache, self.layer_index)
                return decode_step_keeping_kv(
                    self, forward, x, scores, attention_mask, kwargs, cache
                )
            return decode_step(
                self, forward, x, scores, attention_mask, kwargs, cache_layer, impl
            )
        if mode == "rank":
            return route_by_rank(
                self, forward, x, scores, attention_mask, kwargs, cache, cache_layer,
                impl,
            )  # fmt: skip
        real = real_token_mask(attention_mask, batch, q_len, x.device)
        if self.skipped_tokens_kv:
            has_past = stored_keys(cache, self.layer_index) > 0
        else:
            has_past = cache_layer is not None and cache_layer.seen_tokens > 0
        if mode in ("topk", "quantile") and has_past:
            raise RuntimeError(
                f"AdaDSF {mode} routing chooses tokens over the whole "
                f"{'sequence' if mode == 'topk' else 'batch'} and "
                "cannot continue from a KV cache: use causal routing for incremental "
                "decoding (model.eval() after threshold calibration, or "
                "set_routing_mode(model, 'causal'))"
            )
        selection = self.select_tokens(scores, real, mode, has_past, attention_mask)
        return run_routed(
            self, forward, x, scores, selection, real, kwargs, cache, cache_layer, impl
        )

    def extra_repr(self) -> str:
        thr = (
            "None" if self.causal_threshold is None else f"{self.causal_threshold:.4f}"
        )
        ratio = f"{self.retention_ratio:.4f}"
        return (
            f"layer_index={self.layer_index}, retention_ratio={ratio}, "
            f"routing_mode={self.routing_mode}, causal_threshold={thr}, "
            f"skipped_tokens_kv={self.skipped_tokens_kv}"
        )


# original_class() walks the MRO past every class carrying this marker
setattr(RoutedLayer, ROUTED_CLASS_MARKER, True)


# -- the prefill path ------------------------------------------------------------------


def run_routed(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    selection: Selection,
    real: torch.Tensor,
    kwargs: dict[str, Any],
    cache: Any,
    cache_layer: RoutedCacheLayer | None,
    impl: str,
) -> Any:
    """Run the selected tokens ``selection = (index, valid, k_max)`` through
    ``forward`` (the original layer's, bound) and the rest through the skip path.

    ``cache``: the model's KV cache (kv-keeping layers store every position there);
    ``cache_layer``: the layer's routed cache (others store only the tokens that ran).

    A layer keeping skipped tokens' keys/values runs :func:`run_kept_mlp` instead
    when no gradient is needed and its architecture allows, except where its kept
    queries would attend in chunks (one CPU thread, long prompts: the one case in which
    the compacted batch saves attention work, :func:`~adadsf_modifier.routing.\
kept_attention.kept_queries_go_in_chunks`). With a gradient the compacted batch
    stays: its backward skips the skipped tokens' query and output projections.
    """
    index, valid, k_max = selection
    keep_kv = bool(layer.skipped_tokens_kv)
    if keep_kv and cache is not None:
        check_dense_cache(cache, layer.layer_index)
    if (
        keep_kv
        and k_max > 0
        and not torch.is_grad_enabled()
        and attends_every_token(layer)
        and not kept_queries_go_in_chunks(
            x,
            k_max,
            kwargs.get("attention_mask"),
            impl,
            stored_keys(cache, layer.layer_index),
        )
    ):
        return run_kept_mlp(layer, x, selection, real, kwargs, cache, impl)
    rec = layer.routing_recorder
    q_len = x.shape[1]
    skip_map = skip_path_of(layer)
    need_kv = keep_kv and (k_max > 0 or cache is not None)
    slots = (
        skipped_slots(real, index if k_max else None)
        if skip_map is not None or need_kv
        else None
    )
    x_s = gather_tokens(x, slots[0]) if slots is not None else None
    # how many took the skip path: only the recorder reads it
    n_skip = slots[1].sum(1) if slots is not None and rec is not None else None
    pe = kwargs.get("position_embeddings")
    spec = architecture_for_config(layer._adadsf_config) if need_kv else None

    if k_max == 0:
        kv_count = None
        if need_kv:  # later tokens (decoding) will attend to these positions
            k, v = project_kv(layer, spec, x, pe)
            cache.update(k, v, layer.layer_index)
            kv_count = real.sum(1)
        out = x
        if skip_map is not None and slots is not None:
            out = scatter_tokens(x, slots[0], x_s + skip_map(x_s))
        if rec is not None:
            skipped = n_skip if skip_map is not None else None
            rec.record(
                layer.layer_index,
                "skipped",
                batch=x.shape[0],
                skip_path=skipped,
                kv=kv_count,
            )
        if cache_layer is not None:
            cache_layer.record_step(q_len)
        return out

    inner = gather_for_kept(kwargs, index)
    attention_mask = kwargs.get("attention_mask")
    causal_kernel = False
    if keep_kv:
        keys = values = None
        if slots is not None:
            keys, values = skipped_kv(layer, spec, x_s, pe, slots[0], q_len)
        kv_len = stored_keys(cache, layer.layer_index) + q_len
        causal_kernel = causal_kernel_applies(attention_mask, impl, kv_len, q_len)
        rows = allowed = None
        if not causal_kernel:
            rows = query_rows_mask(attention_mask, index, valid, q_len, kv_len)
            allowed = rows.unsqueeze(1)
        inner[layer.cache_kwarg] = MergedKV(keys, values, index, q_len, cache)
        inner["use_cache"] = cache is not None
    else:
        allowed = selected_attention_mask(
            attention_mask, index, valid, cache_layer, impl
        )
        if cache_layer is None:
            inner[layer.cache_kwarg] = None
            inner["use_cache"] = False
    if rec is not None:
        kept = valid.sum(1)
        kv_count = None
        if keep_kv:
            pairs = kept_kv_pairs(index, valid, None if causal_kernel else rows)
            kv_count = n_skip if n_skip is not None else torch.zeros_like(kept)
        else:
            pairs = attended_pairs(attention_mask, index, valid, cache_layer, allowed)
        skipped = n_skip if skip_map is not None else None
        rec.record(
            layer.layer_index, "gather", kept, pairs, skip_path=skipped, kv=kv_count
        )
    if causal_kernel:
        inner.update(
            attention_mask=None,
            is_causal=False,
            position_bias=KeptQueries(index, q_len),
        )
    else:
        inner.update(
            attention_mask_kwargs(
                allowed,
                x.dtype,
                impl,
                layer.grouped_query_attention,
                float_mask=attention_mask is not None
                and attention_mask.dtype != torch.bool,
            )
        )
    x_sel = gather_tokens(x, index)
    y = forward(x_sel, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if cache_layer is not None:
        cache_layer.record_step(q_len, valid, appended=k_max, index=index)
    if torch.is_grad_enabled():
        # the router learns how much running the layer beats the skip path
        base = x_sel if skip_map is None else x_sel + skip_map(x_sel)
        y = gated(y, base, scores.gather(1, index.clamp(max=q_len - 1)))
    more = None
    if skip_map is not None and slots is not None:
        more = (slots[0], x_s + skip_map(x_s))
    # no mask means no padding: the kept and skipped tokens then fill every position
    covers_all = more is not None and attention_mask is None
    out = scatter_tokens(x, index, y, more, covers_all=covers_all)
    return (out, *rest) if rest is not None else out


def attends_every_token(layer: Any) -> bool:
    """Whether a kv-keeping layer's prefill takes :func:`run_kept_mlp`: its decoder
    layer is two sequential residual sub-blocks (not GPT-NeoX's parallel residual)."""
    spec = architecture_for_config(layer._adadsf_config)
    return spec.post_attention_norm is not None


def attention_block(layer: Any) -> Any:
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


def run_kept_mlp(
    layer: Any,
    x: torch.Tensor,
    selection: Selection,
    real: torch.Tensor,
    kwargs: dict[str, Any],
    cache: Any,
    impl: str,
) -> torch.Tensor:
    """:func:`run_routed` for a layer keeping skipped tokens' keys/values, without a
    gradient: every token runs the attention sub-block, the selected ones the MLP
    sub-block on its output, the others take the skip path from the layer input.

    A selected token's output is the dense layer's on the same inputs: its query sees
    every token's keys/values, which is what keeping the skipped tokens' keys/values
    means. Running the attention sub-block on every token, with the model's own mask
    and cache, computes the skipped tokens' queries and attention output as well (their
    result is dropped). The FLOPs model does not count that work, as it does not count
    the skipped positions' zero query rows of the compacted path's causal kernel, which
    did the same attention work. In exchange the layer needs none of the compacted
    path's pieces (the skipped tokens' own norm, key/value projections and rotation,
    their placement among the kept tokens' keys, the kept queries' placement among zero
    rows, the query mask), about half of its ops, and the attention call is the dense
    layer's own, so padding, sliding windows and a cached past need nothing of their
    own. Skipped tokens do not receive the attention output: they leave the layer as
    ``x + u(x)``.
    """
    index, valid, _ = selection
    q_len = x.shape[1]
    rec = layer.routing_recorder
    skip_map = skip_path_of(layer)
    attention_mask = kwargs.get("attention_mask")
    # what the recorder needs of the cache, read before the attention appends to it
    kv_len = stored_keys(cache, layer.layer_index) + q_len if rec is not None else 0
    h = attention_block(layer)(x, **kwargs)
    y = mlp_block(layer, gather_tokens(h, index))
    need_slots = skip_map is not None or rec is not None
    slots = skipped_slots(real, index) if need_slots else None
    if rec is not None:
        rows = None
        if not causal_kernel_applies(attention_mask, impl, kv_len, q_len):
            rows = query_rows_mask(attention_mask, index, valid, q_len, kv_len)
        pairs = kept_kv_pairs(index, valid, rows)
        kept = valid.sum(1)
        n_skip = slots[1].sum(1) if slots is not None else torch.zeros_like(kept)
        rec.record(
            layer.layer_index,
            "gather",
            kept,
            pairs,
            skip_path=n_skip if skip_map is not None else None,
            kv=n_skip,
        )
    more = None
    if skip_map is not None and slots is not None:
        x_s = gather_tokens(x, slots[0])
        more = (slots[0], x_s + skip_map(x_s))
    # no mask means no padding: the kept and skipped tokens then fill every position
    covers_all = more is not None and attention_mask is None
    return scatter_tokens(x, index, y, more, covers_all=covers_all)


def check_dense_cache(cache: Any, layer_idx: int) -> None:
    """A kv-keeping layer caches every position in the model's own cache layer."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        if isinstance(layers[layer_idx], RoutedCacheLayer):
            raise RuntimeError(
                f"cache layer {layer_idx} was filled by a routed layer that did not "
                "keep skipped tokens' keys/values; start a new cache after changing "
                "skipped_tokens_kv"
            )


def skipped_slots(
    real: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(index, valid)`` of the real tokens not at the positions ``index`` (the
    selected ones, unused slots holding ``seq``; ``None``: none selected), as
    :func:`~adadsf_modifier.routing.selection.select_by_mask` lays them out, or
    ``None`` when every real token runs. One host sync."""
    seq = real.shape[1]
    # the real tokens with the selected ones cleared; unused slots (at ``seq``) clear
    # the extra column
    free = torch.nn.functional.pad(real, (0, 1))
    if index is not None:
        free.scatter_(1, index, False)
    skip, valid, _ = positions_of(free[:, :seq])
    return (skip, valid) if skip is not None else None


def skip_all(
    layer: Any, x: torch.Tensor, real: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No token runs the layer: ``(x + u(x) on real tokens, tokens that took u)``.

    ``real`` ``None``: every token is real. Identity skip path: ``x`` itself.
    """
    skip_map = skip_path_of(layer)
    if skip_map is None:
        return x, None
    update = skip_map(x)
    if real is None:
        return x + update, torch.full((x.shape[0],), x.shape[1])
    return x + update * real.unsqueeze(-1).to(update.dtype), real.sum(1)


# -- the decoding step -----------------------------------------------------------------


def decode_step(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    cache_layer: RoutedCacheLayer | None,
    impl: str,
    choice: DecodeChoice | None = None,
) -> Any:
    """One new token per row (causal mode): only the rows whose token passes run
    ``layer``; ``choice``: the rows that run, when another rule (rank routing) has
    decided them.

    ``forward`` is the original decoder layer's forward (bound). The rows that run are
    picked with one host sync (``index_select`` on the batch), their cached
    keys/values are the slots this layer stored for them, and a mask is built only when
    some of those slots are filler (a row skipped a step another row ran) or out of a
    sliding window.
    """
    batch = x.shape[0]
    rec = layer.routing_recorder
    if choice is None:
        opens = cache_layer is None or cache_layer.seen_tokens == 0
        choice = _threshold_choice(layer, x, scores, attention_mask, opens)
    selected, rows, skip_rows, n, real = choice
    if n == 0:
        out, skipped = _skip_rows(layer, x, None, real, rec)
        if rec is not None:
            rec.record(layer.layer_index, "skipped", batch=batch, skip_path=skipped)
        return pass_through(out, cache_layer)

    inner = dict(kwargs)
    inner["attention_mask"] = None
    x_in = x
    if rows is not None:
        x_in = x.index_select(0, rows)
        inner["position_embeddings"] = _rows_of(
            kwargs.get("position_embeddings"), rows, batch
        )
        inner["position_ids"] = _rows_of(kwargs.get("position_ids"), rows, batch)
    past = None
    if cache_layer is None:
        inner[layer.cache_kwarg] = None
        inner["use_cache"] = False
    elif not cache_layer.past_fully_visible(1) or rec is not None:
        past = cache_layer.visible_slots(batch, x.device)
        past = past.reshape(batch, past.shape[-1])  # one query: [batch, slots]
    if past is not None and not cache_layer.past_fully_visible(1):
        seen = past if rows is None else past.index_select(0, rows)
        allowed = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], dim=1)
        inner.update(
            attention_mask_kwargs(
                allowed[:, None, None, :], x.dtype, impl, layer.grouped_query_attention
            )
        )
    base, skipped = x, None
    if rows is not None:
        base, skipped = _skip_rows(layer, x, skip_rows, real, rec)
    if rec is not None:
        ran = _ran(selected, batch, x.device)
        visible = 1 + (past.sum(1) if past is not None else 0)
        path = "in_place" if rows is None else "gather"
        rec.record(
            layer.layer_index, path, kept=ran, attended=ran * visible, skip_path=skipped
        )

    if cache_layer is not None and rows is not None:
        with cache_layer.only_rows(rows, batch):
            y = forward(x_in, **inner)
    else:
        y = forward(x_in, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if torch.is_grad_enabled():
        y = _gated_step(layer, y, x_in, scores, rows)
    if rows is not None:
        y = base.index_copy(0, rows, y)
    if cache_layer is not None:
        valid = None if rows is None else selected.unsqueeze(1)
        cache_layer.record_step(1, valid, appended=1)
    return (y, *rest) if rest is not None else y


def decode_step_keeping_kv(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    cache: Any,
    choice: DecodeChoice | None = None,
) -> Any:
    """:func:`decode_step` for a layer whose skipped tokens keep their keys/values.

    Its cache layer is the model's dense one: a row that runs is a plain dense decoding
    step (the model's own mask and cache); a row that skips still appends its keys and
    values. When only some rows run, the skipping rows' keys/values are computed
    separately and merged into the one cache update (:class:`MergedKV`).
    """
    batch = x.shape[0]
    idx = layer.layer_index
    rec = layer.routing_recorder
    if choice is None:
        opens = stored_keys(cache, idx) == 0
        choice = _threshold_choice(layer, x, scores, attention_mask, opens)
    selected, rows, skip_rows, n, real = choice
    spec = architecture_for_config(layer._adadsf_config)
    pe = kwargs.get("position_embeddings")
    if n == 0:
        if cache is not None:
            k, v = project_kv(layer, spec, x, pe)
            cache.update(k, v, idx)
        out, skipped = _skip_rows(layer, x, None, real, rec)
        if rec is not None:
            kv = _skipping(batch, None, real) if cache is not None else None
            rec.record(idx, "skipped", batch=batch, skip_path=skipped, kv=kv)
        return out
    inner = dict(kwargs)
    x_in, base, skipped, kv = x, x, None, None
    if rows is not None:
        x_in = x.index_select(0, rows)
        k, v = project_kv(
            layer, spec, x.index_select(0, skip_rows), _rows_of(pe, skip_rows, batch)
        )
        keys = k.new_zeros(batch, *k.shape[1:]).index_copy(0, skip_rows, k)
        values = v.new_zeros(batch, *v.shape[1:]).index_copy(0, skip_rows, v)
        inner[layer.cache_kwarg] = MergedKV(keys, values, None, 1, cache, rows=rows)
        inner["use_cache"] = cache is not None
        for key in ("position_embeddings", "position_ids", "attention_mask"):
            inner[key] = _rows_of(kwargs.get(key), rows, batch)
        base, skipped = _skip_rows(layer, x, skip_rows, real, rec)
        kv = _skipping(batch, skip_rows, real) if rec is not None else None
    if rec is not None:
        ran = _ran(selected, batch, x.device)
        if attention_mask is not None and attention_mask.dim() == 4:
            visible = allowed_by_mask(attention_mask[:, 0, -1, :]).sum(-1)
        else:
            visible = stored_keys(cache, idx) + 1
        path = "in_place" if rows is None else "gather"
        rec.record(
            idx, path, kept=ran, attended=ran * visible, skip_path=skipped, kv=kv
        )
    y = forward(x_in, **inner)
    y, rest = (y[0], y[1:]) if isinstance(y, tuple) else (y, None)
    if torch.is_grad_enabled():
        y = _gated_step(layer, y, x_in, scores, rows)
    if rows is not None:
        y = base.index_copy(0, rows, y)
    return (y, *rest) if rest is not None else y


# -- rank routing ---------------------------------------------------------------------


def route_by_rank(
    layer: Any,
    forward: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    cache: Any,
    cache_layer: RoutedCacheLayer | None,
    impl: str,
) -> Any:
    """Rank routing (:func:`~adadsf_modifier.routing.selection.choose_by_rank`): each
    new token runs iff it is in the top ``retention_ratio`` of its row so far, against
    the past scores its cache layer keeps (:func:`~adadsf_modifier.routing.\
routed_cache.rank_select`); then the same paths as causal routing run the chosen
    tokens (a decoding step's rows, or a prefill's compacted batch), and record them
    the same way."""
    batch, q_len, _ = x.shape
    real = real_token_mask(attention_mask, batch, q_len, x.device)
    idx = layer.layer_index
    store, past_len = None, 0
    if layer.skipped_tokens_kv and cache is not None:
        check_dense_cache(cache, idx)
        past_len = stored_keys(cache, idx)
        store = scored_cache_layer(cache, idx)
    elif cache_layer is not None:
        past_len, store = cache_layer.seen_tokens, cache_layer
    selected = rank_select(
        store,
        past_len,
        scores,
        real,
        float(layer.retention_ratio),
        bool(layer.keep_first_token),
    )
    if q_len == 1:
        choice = decode_choice_of(
            selected[:, 0], None if attention_mask is None else real[:, 0]
        )
        if layer.skipped_tokens_kv:
            return decode_step_keeping_kv(
                layer, forward, x, scores, attention_mask, kwargs, cache, choice
            )
        return decode_step(
            layer, forward, x, scores, attention_mask, kwargs, cache_layer, impl, choice
        )
    return run_routed(
        layer,
        forward,
        x,
        scores,
        positions_of(selected),
        real,
        kwargs,
        cache,
        cache_layer,
        impl,
    )


def _threshold_choice(
    layer: Any,
    x: torch.Tensor,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    opens_cache: bool,
) -> DecodeChoice:
    """The decoding step's rows by the layer's causal threshold
    (:func:`~adadsf_modifier.routing.selection.choose_decode_rows`); ``opens_cache``:
    the step is the first the layer's cache sees, so its first token is forced."""
    return choose_decode_rows(
        x,
        scores,
        attention_mask,
        layer.keep_first_token and opens_cache,
        layer.causal_threshold,
        layer.keep_first_token,
    )


def _skip_rows(
    layer: Any, x: torch.Tensor, skip_rows: torch.Tensor | None, real: Any, rec: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` with the skip path applied to ``skip_rows`` (``None``: every row), and,
    while recording, the ``[batch]`` count of real tokens that took it (``None``:
    identity skip path)."""
    skip_map = skip_path_of(layer)
    if skip_map is None:
        return x, None
    count = _skipping(x.shape[0], skip_rows, real) if rec is not None else None
    if skip_rows is None:
        return x + skip_map(x), count
    x_s = x.index_select(0, skip_rows)
    return x.index_copy(0, skip_rows, x_s + skip_map(x_s)), count


def _skipping(
    batch: int, skip_rows: torch.Tensor | None, real: torch.Tensor | None
) -> torch.Tensor:
    """``[batch]`` 1 for the real rows among ``skip_rows`` (``None``: every row)."""
    count = torch.ones(batch, dtype=torch.long)
    if skip_rows is not None:
        count = torch.zeros(batch, dtype=torch.long).index_fill(0, skip_rows.cpu(), 1)
    return count if real is None else count * real.cpu().long()


def _ran(selected: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    ran = torch.ones(batch, dtype=torch.bool) if selected is None else selected
    return ran.to(device)


def _gated_step(layer, y, x_in, scores, rows) -> torch.Tensor:
    skip_map = skip_path_of(layer)
    base = x_in if skip_map is None else x_in + skip_map(x_in)
    return gated(y, base, scores if rows is None else scores.index_select(0, rows))


def pass_through(x: torch.Tensor, cache_layer: RoutedCacheLayer | None) -> torch.Tensor:
    """No token runs the layer: ``x`` passes through; the cache only counts the
    positions."""
    if cache_layer is not None:
        cache_layer.record_step(x.shape[1])
    return x


def _rows_of(value: Any, rows: torch.Tensor, batch: int) -> Any:
    """``value`` (a tensor or tuple of tensors with a leading batch dim) at ``rows``.

    A leading dim of 1 is a broadcast over the batch and is left as is.
    """
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    return (
        value.index_select(0, rows) if value.shape[0] == batch and batch > 1 else value
    )


# -- routing and unrouting a layer -----------------------------------------------------


def routed_class_for(layer_class: type) -> type:
    """``Routed<Name>(RoutedLayer, <Name>)``, created once per original class."""
    if issubclass(layer_class, RoutedLayer):
        return layer_class
    cls = _ROUTED_CLASSES.get(layer_class)
    if cls is None:
        cls = type(
            f"Routed{layer_class.__name__}",
            (RoutedLayer, layer_class),
            {"__module__": __name__, "__doc__": RoutedLayer.__doc__},
        )
        _ROUTED_CLASSES[layer_class] = cls
    return cls


def route_layer(
    layer: nn.Module,
    router: TokenRouter,
    retention_ratio: float,
    layer_index: int,
    cache_kwarg: str,
    config: Any,
    skip_path: SkipPath | None = None,
    skipped_tokens_kv: bool = False,
) -> nn.Module:
    """Turn ``layer`` into a routed layer in place (same object, new class, router
    added).

    ``skip_path``: what skipped tokens get added (``None``: nothing, the identity);
    ``skipped_tokens_kv``: skipped tokens still contribute keys/values.
    """
    if not 0.0 <= retention_ratio <= 1.0:
        raise ValueError(f"retention ratio must be in [0, 1], got {retention_ratio}")
    if isinstance(layer, RoutedLayer):
        raise ValueError(f"layer {layer_index} is already routed")
    param = next(layer.parameters(), None)
    for module in (router, skip_path):
        if param is not None and module is not None:
            dtype = param.dtype if param.is_floating_point() else None
            module.to(device=param.device, dtype=dtype)
    swap_class(layer, routed_class_for(type(layer)))
    layer.add_module("router", router)
    if skip_path is not None:
        layer.add_module("skip_path", skip_path)
    if skipped_tokens_kv:
        layer.skipped_tokens_kv = True
    layer.retention_ratio = float(retention_ratio)
    layer.layer_index = int(layer_index)
    layer.cache_kwarg = cache_kwarg
    layer._adadsf_config = config
    windows = sliding_windows(config) if config is not None else ()
    layer.attention_window = (
        windows[layer_index] if layer_index < len(windows) else None
    )
    return layer


def unroute_layer(layer: nn.Module) -> nn.Module:
    """Undo :func:`route_layer`, and the hooks its router put on the layer."""
    if not isinstance(layer, RoutedLayer):
        return layer
    original = original_class(type(layer))
    router = layer._modules.pop("router")
    getattr(router, "detach_from", lambda _layer: None)(layer)  # e.g. FTP's context
    layer._modules.pop("skip_path", None)
    for attr in (
        "skipped_tokens_kv",
        "retention_ratio",
        "layer_index",
        "cache_kwarg",
        "_adadsf_config",
        "routing_mode",
        "causal_threshold",
        "attention_window",
        "routing_recorder",
    ):
        layer.__dict__.pop(attr, None)
    swap_class(layer, original)
    return layer


def routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """All routed decoder layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]
