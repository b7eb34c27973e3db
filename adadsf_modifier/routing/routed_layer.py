"""A decoder layer that runs only the tokens its router selects.

Routing swaps the layer's class for ``Routed<Name>(RoutedLayer, <Name>)``: the same
module object, so parameter names, hooks, ``isinstance`` checks, GPTQ targets and the
sequential pipeline's class-name matching keep working.

The file reads like a transformers modeling file: :class:`RoutedLayer`, whose
``forward`` picks one of four paths by the layer's ratio and the call's shape,

- ``_skip_layer``: ratio 0 (a removed layer), every token takes the skip path;
- ``_run_every_token``: ratio 1, the original layer unchanged;
- ``_prefill``: the selected tokens run the layer on a compacted batch, the others
  take the skip path; ``run_kept_mlp`` is its fast form for a layer keeping skipped
  tokens' keys/values at inference;
- ``_decode_step``: one new token per row (causal routing), only the rows whose
  token runs go through the layer; the hot path of ``generate()``;

then :func:`route_layer` / :func:`unroute_layer`. The branches inside each path are
the variants: skipped tokens' keys/values kept or not (``skipped_tokens_kv``),
identity or fitted skip path, recorder attached or not.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from adadsf_modifier.constraints import InputError
from adadsf_modifier.routing.architectures import (
    ROUTED_CLASS_MARKER,
    apply_named,
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
    place_kv,
    project_kv,
    query_rows_mask,
    selected_attention_mask,
    stored_keys,
)
from adadsf_modifier.routing.routed_cache import (
    RoutedCacheLayer,
    check_dense_cache,
    routed_cache_layer,
)
from adadsf_modifier.routing.router import TokenRouter, gated
from adadsf_modifier.routing.selection import (
    DecodeChoice,
    Selection,
    choose_decode_rows,
    choose_tokens,
    gather_position_embeddings,
    gather_tokens,
    scatter_tokens,
    skipped_slots,
)
from adadsf_modifier.routing.skip_path import SkipPath, skip_path_of
from adadsf_modifier.utils import allowed_by_mask, first_real_tokens, real_token_mask

__all__ = [
    "RoutedLayer",
    "refuse_empty_inputs",
    "route_layer",
    "routed_class_for",
    "routed_layers",
    "unroute_layer",
]

_UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_ROUTED_CLASSES: dict[type, type] = {}


class RoutedLayer(nn.Module):
    """Mixin for routed decoder layers; ``isinstance(layer, RoutedLayer)`` finds them.

    The selected tokens run the original layer at their original positions, attending
    among themselves (and to the cached tokens that ran it); the others leave it as
    ``x`` (identity skip path) or ``x + u(x)`` (a fitted ``skip_path`` child). With
    ``skipped_tokens_kv`` the skipped tokens still give keys/values, so the selected
    ones attend to the full context. A selected token's update is multiplied by the
    straight-through gate of :func:`~adadsf_modifier.routing.router.gated`, exactly 1
    in value, through which the router gets its gradient.
    """

    router: TokenRouter
    retention_ratio: float
    #: read only where used: torch.compile specialises on each int attribute it
    #: reads, and would compile the routing once per layer
    layer_index: int
    cache_kwarg: str
    routing_mode: str = "auto"
    causal_threshold: float | None = None
    keep_first_token: bool = True
    #: keys per query of this layer's sliding-window attention (None: full causal)
    attention_window: int | None = None
    skipped_tokens_kv: bool = False
    #: a RoutingRecorder while one is attached: the layer reports what it ran
    routing_recorder: Any = None

    # -- which tokens run --------------------------------------------------------------

    def resolved_routing_mode(self) -> str:
        if self.routing_mode != "auto":
            return self.routing_mode
        causal = not self.training and self.causal_threshold is not None
        return "causal" if causal else "topk"

    def forced_tokens(
        self,
        real: torch.Tensor,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``[batch, seq]``: each row's first real token, the attention sink that runs
        whatever its score (``None`` unless ``keep_first_token``). After a cached past
        it is read off the mask."""
        if not self.keep_first_token:
            return None
        if not has_past:
            return real & (real.cumsum(dim=1) == 1)
        if attention_mask is None:
            return None
        return first_real_tokens(attention_mask, real)

    def select_tokens(
        self,
        scores: torch.Tensor,
        real: torch.Tensor,
        mode: str | None = None,
        has_past: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> Selection:
        """The tokens this layer runs under ``mode`` (default: its own)."""
        return choose_tokens(
            mode or self.resolved_routing_mode(),
            scores,
            real,
            self.forced_tokens(real, has_past, attention_mask),
            float(self.retention_ratio),
            self.causal_threshold,
            lambda: f"layer {self.layer_index}",  # read only for an error
        )

    def selected_mask(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mode: str | None = None,
        has_past: bool = False,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, seq]`` bool: which tokens of layer input ``x`` this layer runs
        (``scores``: the router's on ``x``, when the caller has them)."""
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

    # -- the forward -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:  # bind extra positional args to their names once
            bound = inspect.signature(super().forward).bind(*args, **kwargs)
            args, kwargs = (bound.arguments.pop("hidden_states"),), bound.arguments
            kwargs.update(kwargs.pop("kwargs", {}))
        x = args[0] if args else kwargs.pop("hidden_states")
        ratio = float(self.retention_ratio)
        cache = kwargs.get(self.cache_kwarg)
        # a layer keeping skipped tokens' K/V caches every position in the model's own
        # cache layer; any other caches only the tokens that ran it
        cache_layer = None
        dense_cache = self.skipped_tokens_kv and ratio > 0.0
        if cache is not None and ratio < 1.0 and not dense_cache:
            cache_layer = routed_cache_layer(
                cache, self.layer_index, self.attention_window
            )
        if ratio <= 0.0:
            return self._skip_layer(x, kwargs, cache_layer)
        if self._attn_implementation in _UNSUPPORTED_ATTENTION:
            raise NotImplementedError(
                "AdaDSF routing supports attn_implementation 'sdpa' and 'eager', got "
                f"{self._attn_implementation!r}"
            )
        if ratio >= 1.0:
            return self._run_every_token(x, kwargs)
        scores = self.router(x)
        mode = self.resolved_routing_mode()
        decoding = mode == "causal" and self.causal_threshold is not None
        if decoding and x.shape[1] == 1:
            return self._decode_step(x, scores, kwargs, cache, cache_layer)
        return self._prefill(x, scores, mode, kwargs, cache, cache_layer)

    def _skip_layer(
        self, x: torch.Tensor, kwargs: dict, cache_layer: RoutedCacheLayer | None
    ) -> torch.Tensor:
        """Ratio 0: no token runs the layer and its router is not evaluated."""
        rec = self.routing_recorder
        skip_map = skip_path_of(self)
        out, skipped = x, None
        if skip_map is not None:
            real = real_token_mask(kwargs.get("attention_mask"), *x.shape[:2], x.device)
            update = skip_map(x)
            out = x + update * real.unsqueeze(-1).to(update.dtype)
            skipped = real.sum(1)
        if rec is not None:
            rec.record(self.layer_index, "removed", batch=x.shape[0], skip_path=skipped)
        if cache_layer is not None:
            cache_layer.record_step(x.shape[1])
        return out

    def _run_every_token(self, x: torch.Tensor, kwargs: dict) -> Any:
        """Ratio 1: the original layer, cache included; padding keeps its input. The
        router runs only for its gradient."""
        grad = torch.is_grad_enabled()
        if self.routing_recorder is not None:
            self.routing_recorder.record(self.layer_index, "full", router_ran=grad)
        y, rest = _split(super().forward(x, **kwargs))
        if grad:
            y = gated(y, x, self.router(x))
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None:
            real = real_token_mask(attention_mask, *x.shape[:2], x.device)
            y = torch.where(real.unsqueeze(-1), y, x)
        return _join(y, rest)

    def _prefill(
        self,
        x: torch.Tensor,
        scores: torch.Tensor,
        mode: str,
        kwargs: dict,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> Any:
        """The selected tokens run the original layer on a compacted batch ``[batch,
        k_max]``, the others take the skip path, and both are scattered back."""
        rec = self.routing_recorder
        keep_kv, impl = self.skipped_tokens_kv, self._attn_implementation
        attention_mask = kwargs.get("attention_mask")
        q_len = x.shape[1]
        real, (index, valid, k_max) = self._prefill_tokens(
            x, scores, mode, attention_mask, cache, cache_layer
        )
        if k_max == 0:
            return self._no_token_runs(x, real, kwargs, cache, cache_layer)
        # skipped tokens' K/V kept, no gradient: attention on every token instead,
        # unless the compacted kept queries would attend in chunks
        if (
            keep_kv
            and not torch.is_grad_enabled()
            and self.attends_every_token()
            and not kept_queries_go_in_chunks(
                x, k_max, attention_mask, impl, stored_keys(cache, self.layer_index)
            )
        ):
            return self.run_kept_mlp(x, index, valid, real, kwargs, cache)

        skip_map = skip_path_of(self)
        slots = x_s = n_skip = None  # the skipped real tokens: (index, valid)
        if skip_map is not None or keep_kv:
            slots = skipped_slots(real, index)
        if slots is not None:
            x_s = gather_tokens(x, slots[0])
            n_skip = slots[1].sum(1) if rec is not None else None
        inner = gather_for_kept(kwargs, index)
        causal_kernel = False
        if keep_kv:
            # the layer's cache.update merges the kept tokens' keys/values with the
            # skipped ones' (and the model's cache), so the kept queries see them all
            keys = values = None
            if slots is not None:
                spec = architecture_for_config(self._adadsf_config)
                pe = gather_position_embeddings(
                    kwargs.get("position_embeddings"), slots[0]
                )
                k, v = project_kv(self, spec, x_s, pe)
                keys = place_kv(None, k, slots[0], q_len)
                values = place_kv(None, v, slots[0], q_len)
            kv_len = stored_keys(cache, self.layer_index) + q_len
            causal_kernel = causal_kernel_applies(attention_mask, impl, kv_len, q_len)
            rows = allowed = None
            if not causal_kernel:
                rows = query_rows_mask(attention_mask, index, valid, q_len, kv_len)
                allowed = rows.unsqueeze(1)
            inner[self.cache_kwarg] = MergedKV(keys, values, index, q_len, cache)
            inner["use_cache"] = cache is not None
        else:  # among themselves and the kept tokens the routed cache holds
            allowed = selected_attention_mask(
                attention_mask, index, valid, cache_layer, impl
            )
            if cache_layer is None:
                inner[self.cache_kwarg] = None
                inner["use_cache"] = False
        if rec is not None:
            kept, kv = valid.sum(1), None
            if keep_kv:
                pairs = kept_kv_pairs(index, valid, None if causal_kernel else rows)
                kv = n_skip if n_skip is not None else torch.zeros_like(kept)
            else:
                pairs = attended_pairs(
                    attention_mask, index, valid, cache_layer, allowed
                )
            skipped = n_skip if skip_map is not None else None
            rec.record(
                self.layer_index, "gather", kept, pairs, skip_path=skipped, kv=kv
            )
        if causal_kernel:  # see KeptQueries
            inner.update(
                attention_mask=None,
                is_causal=False,
                position_bias=KeptQueries(index, q_len),
            )
        else:
            float_mask = (
                attention_mask is not None and attention_mask.dtype != torch.bool
            )
            inner.update(
                attention_mask_kwargs(
                    allowed, x.dtype, impl, self.grouped_query_attention, float_mask
                )
            )
        x_sel = gather_tokens(x, index)
        y, rest = _split(super().forward(x_sel, **inner))
        if cache_layer is not None:
            cache_layer.record_step(q_len, valid, appended=k_max, index=index)
        if torch.is_grad_enabled():
            y = self._gate(y, x_sel, scores.gather(1, index.clamp(max=q_len - 1)))
        return _join(self._scatter_back(x, index, y, slots, x_s, attention_mask), rest)

    def _prefill_tokens(
        self,
        x: torch.Tensor,
        scores: torch.Tensor,
        mode: str,
        attention_mask: torch.Tensor | None,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> tuple[torch.Tensor, Selection]:
        """``(real tokens, the tokens that run)`` of a prefill, by
        :meth:`select_tokens`."""
        if self.skipped_tokens_kv and cache is not None:
            check_dense_cache(cache, self.layer_index)
        real = real_token_mask(attention_mask, *x.shape[:2], x.device)
        if self.skipped_tokens_kv:
            has_past = stored_keys(cache, self.layer_index) > 0
        else:
            has_past = cache_layer is not None and cache_layer.seen_tokens > 0
        if mode in ("topk", "quantile") and has_past:
            raise RuntimeError(
                f"AdaDSF {mode} routing chooses tokens over the whole "
                f"{'sequence' if mode == 'topk' else 'batch'} and cannot continue "
                "from a KV cache: use causal routing for incremental decoding "
                "(model.eval() after threshold calibration, or "
                "set_routing_mode(model, 'causal'))"
            )
        return real, self.select_tokens(scores, real, mode, has_past, attention_mask)

    def _no_token_runs(
        self,
        x: torch.Tensor,
        real: torch.Tensor,
        kwargs: dict,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> torch.Tensor:
        """A prefill in which no token runs: the real tokens take the skip path (and
        leave their keys/values in the cache, when the layer keeps them)."""
        skip_map, rec = skip_path_of(self), self.routing_recorder
        out, skipped, kv = x, None, None
        if self.skipped_tokens_kv and cache is not None:
            spec = architecture_for_config(self._adadsf_config)
            k, v = project_kv(self, spec, x, kwargs.get("position_embeddings"))
            cache.update(k, v, self.layer_index)
            kv = real.sum(1)
        slots = skipped_slots(real, None) if skip_map is not None else None
        if slots is not None:
            x_s = gather_tokens(x, slots[0])
            out = scatter_tokens(x, slots[0], x_s + skip_map(x_s))
            skipped = slots[1].sum(1) if rec is not None else None
        if rec is not None:
            batch = x.shape[0]
            rec.record(
                self.layer_index, "skipped", batch=batch, skip_path=skipped, kv=kv
            )
        if cache_layer is not None:
            cache_layer.record_step(x.shape[1])
        return out

    def run_kept_mlp(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        valid: torch.Tensor,
        real: torch.Tensor,
        kwargs: dict,
        cache: Any,
    ) -> torch.Tensor:
        """The prefill of a layer keeping skipped tokens' K/V, without a gradient:
        every token runs the attention sub-block (the dense layer's own call: mask,
        cache, windows as they are), the selected ones the MLP sub-block. The selected
        tokens' outputs equal the compacted path's, in about half its ops; the
        skipped tokens' queries are computed and dropped, work the FLOPs model does
        not count (nor the compacted path's zero query rows)."""
        q_len = x.shape[1]
        rec = self.routing_recorder
        attention_mask = kwargs.get("attention_mask")
        # what the recorder needs of the cache, read before the attention appends to it
        kv_len = stored_keys(cache, self.layer_index) + q_len if rec else 0
        spec = architecture_for_config(self._adadsf_config)
        attn = getattr(self, spec.attention)
        out = attn(hidden_states=apply_named(self, spec.input_norm, x), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        after_attn, after_mlp = spec.output_norms or (None, None)
        h = gather_tokens(x + apply_named(self, after_attn, out), index)
        out = getattr(self, spec.mlp)(apply_named(self, spec.mlp_norm, h))
        y = h + apply_named(self, after_mlp, out)
        skip_map, slots = skip_path_of(self), None
        if skip_map is not None or rec is not None:
            slots = skipped_slots(real, index)
        if rec is not None:
            rows = None
            impl = self._attn_implementation
            if not causal_kernel_applies(attention_mask, impl, kv_len, q_len):
                rows = query_rows_mask(attention_mask, index, valid, q_len, kv_len)
            kept = valid.sum(1)
            n_skip = slots[1].sum(1) if slots is not None else torch.zeros_like(kept)
            skipped = n_skip if skip_map is not None else None
            pairs = kept_kv_pairs(index, valid, rows)
            rec.record(
                self.layer_index, "gather", kept, pairs, skip_path=skipped, kv=n_skip
            )
        return self._scatter_back(x, index, y, slots, None, attention_mask)

    def _decode_step(
        self,
        x: torch.Tensor,
        scores: torch.Tensor,
        kwargs: dict,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> Any:
        """One new token per row: only the rows whose token runs go through the layer
        (gathered along the batch, one host sync), the others take the skip path."""
        batch = x.shape[0]
        rec, keep_kv = self.routing_recorder, self.skipped_tokens_kv
        attention_mask = kwargs.get("attention_mask")
        selected, rows, skip_rows, n, real = self._decode_rows(
            x, scores, attention_mask, cache, cache_layer
        )
        if n == 0:
            return self._no_row_runs(x, real, kwargs, cache, cache_layer)

        inner = dict(kwargs)
        x_in, base, skipped, kv = x, x, None, None
        if rows is not None:  # some rows run: gather them along the batch
            x_in = x.index_select(0, rows)
            for key in ("position_embeddings", "position_ids"):
                inner[key] = _rows_of(kwargs.get(key), rows, batch)
            base, skipped = self._skip_rows(x, skip_rows, real)
        if keep_kv:  # the model's own mask and dense cache
            if rows is not None:  # the skipping rows still append their K/V
                inner["attention_mask"] = _rows_of(attention_mask, rows, batch)
                spec = architecture_for_config(self._adadsf_config)
                pe = _rows_of(kwargs.get("position_embeddings"), skip_rows, batch)
                k, v = project_kv(self, spec, x.index_select(0, skip_rows), pe)
                keys = k.new_zeros(batch, *k.shape[1:]).index_copy(0, skip_rows, k)
                values = v.new_zeros(batch, *v.shape[1:]).index_copy(0, skip_rows, v)
                inner[self.cache_kwarg] = MergedKV(
                    keys, values, None, 1, cache, rows=rows
                )
                inner["use_cache"] = cache is not None
                kv = _rows_mask(batch, skip_rows, real) if rec is not None else None
            if rec is not None:
                if attention_mask is not None and attention_mask.dim() == 4:
                    visible = allowed_by_mask(attention_mask[:, 0, -1, :]).sum(-1)
                else:
                    visible = stored_keys(cache, self.layer_index) + 1
        else:  # the routed cache: a mask only where a cached slot is hidden
            inner["attention_mask"] = None
            past, visible = None, 1
            hidden = cache_layer is not None and not cache_layer.past_fully_visible(1)
            if cache_layer is None:
                inner[self.cache_kwarg] = None
                inner["use_cache"] = False
            elif hidden or rec is not None:
                past = cache_layer.visible_slots(batch, x.device)
                past = past.reshape(batch, past.shape[-1])  # one query: [batch, slots]
                if rec is not None:
                    visible = 1 + past.sum(1)
            if hidden:  # filler slots (a row skipped a step another ran), or windowed
                seen = past if rows is None else past.index_select(0, rows)
                allowed = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], dim=1)
                inner.update(
                    attention_mask_kwargs(
                        allowed[:, None, None, :],
                        x.dtype,
                        self._attn_implementation,
                        self.grouped_query_attention,
                    )
                )
        if rec is not None:
            ran = torch.ones(batch, dtype=torch.bool) if selected is None else selected
            ran = ran.to(x.device)
            path = "in_place" if rows is None else "gather"
            rec.record(
                self.layer_index,
                path,
                kept=ran,
                attended=ran * visible,
                skip_path=skipped,
                kv=kv,
            )
        only_rows = cache_layer is not None and rows is not None
        with cache_layer.only_rows(rows, batch) if only_rows else nullcontext():
            y, rest = _split(super().forward(x_in, **inner))
        if torch.is_grad_enabled():
            y = self._gate(
                y, x_in, scores if rows is None else scores.index_select(0, rows)
            )
        if rows is not None:
            y = base.index_copy(0, rows, y)
        if cache_layer is not None:
            valid = None if rows is None else selected.unsqueeze(1)
            cache_layer.record_step(1, valid, appended=1)
        return _join(y, rest)

    def _decode_rows(
        self,
        x: torch.Tensor,
        scores: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> DecodeChoice:
        """The rows of a decoding step that run: by the causal threshold (every real
        row at the step that opens the cache)."""
        if self.skipped_tokens_kv:
            if cache is not None:
                check_dense_cache(cache, self.layer_index)
            opens = stored_keys(cache, self.layer_index) == 0
        else:
            opens = cache_layer is None or cache_layer.seen_tokens == 0
        first = self.keep_first_token
        return choose_decode_rows(
            x, scores, attention_mask, first and opens, self.causal_threshold, first
        )

    def _no_row_runs(
        self,
        x: torch.Tensor,
        real: torch.Tensor | None,
        kwargs: dict,
        cache: Any,
        cache_layer: RoutedCacheLayer | None,
    ) -> torch.Tensor:
        """A decoding step in which no row runs: every row takes the skip path (and
        leaves its keys/values in the cache, when the layer keeps them)."""
        batch, rec = x.shape[0], self.routing_recorder
        kv = None
        if self.skipped_tokens_kv and cache is not None:
            spec = architecture_for_config(self._adadsf_config)
            k, v = project_kv(self, spec, x, kwargs.get("position_embeddings"))
            cache.update(k, v, self.layer_index)
            kv = _rows_mask(batch, None, real) if rec is not None else None
        out, skipped = self._skip_rows(x, None, real)
        if rec is not None:
            rec.record(
                self.layer_index, "skipped", batch=batch, skip_path=skipped, kv=kv
            )
        if cache_layer is not None:
            cache_layer.record_step(1)
        return out

    # -- pieces of the paths -----------------------------------------------------------

    @property
    def _attn_implementation(self) -> str:
        return getattr(self._adadsf_config, "_attn_implementation", "sdpa")

    @property
    def grouped_query_attention(self) -> bool:
        attn = getattr(self, "self_attn", None)
        return getattr(attn, "num_key_value_groups", 1) > 1

    def attends_every_token(self) -> bool:
        """Whether a kv-keeping prefill may take :meth:`run_kept_mlp`: the layer is
        two sequential residual sub-blocks (not GPT-NeoX's parallel residual)."""
        return not architecture_for_config(self._adadsf_config).parallel_residual

    def _gate(
        self, y: torch.Tensor, x: torch.Tensor, scores: torch.Tensor
    ) -> torch.Tensor:
        """``y`` through the router's straight-through gate: the router learns how
        much running the layer beats the skip path."""
        skip_map = skip_path_of(self)
        return gated(y, x if skip_map is None else x + skip_map(x), scores)

    def _skip_rows(
        self, x: torch.Tensor, skip_rows: torch.Tensor | None, real: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` with the skip path applied to rows ``skip_rows`` (``None``: all),
        and, while recording, which real rows took it (``None``: identity)."""
        skip_map = skip_path_of(self)
        if skip_map is None:
            return x, None
        count = None
        if self.routing_recorder is not None:
            count = _rows_mask(x.shape[0], skip_rows, real)
        if skip_rows is None:
            return x + skip_map(x), count
        x_s = x.index_select(0, skip_rows)
        return x.index_copy(0, skip_rows, x_s + skip_map(x_s)), count

    def _scatter_back(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        y: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor] | None,
        x_s: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` with the kept tokens' outputs ``y`` at ``index`` and the skipped
        tokens' (``slots``, gathered ``x_s``) skip path."""
        skip_map = skip_path_of(self)
        more = None
        if skip_map is not None and slots is not None:
            x_s = gather_tokens(x, slots[0]) if x_s is None else x_s
            more = (slots[0], x_s + skip_map(x_s))
        # no mask means no padding: the kept and skipped tokens fill every position
        covers_all = more is not None and attention_mask is None
        return scatter_tokens(x, index, y, more, covers_all=covers_all)

    def extra_repr(self) -> str:
        thr = self.causal_threshold
        thr = "None" if thr is None else f"{thr:.4f}"
        return (
            f"layer_index={self.layer_index}, "
            f"retention_ratio={self.retention_ratio:.4f}, "
            f"routing_mode={self.routing_mode}, causal_threshold={thr}, "
            f"skipped_tokens_kv={self.skipped_tokens_kv}"
        )


# original_class() walks the MRO past every class carrying this marker
setattr(RoutedLayer, ROUTED_CLASS_MARKER, True)


def _split(y: Any) -> tuple[torch.Tensor, tuple | None]:
    """A decoder layer's output as ``(hidden states, the rest or None)``."""
    return (y[0], y[1:]) if isinstance(y, tuple) else (y, None)


def _join(y: torch.Tensor, rest: tuple | None) -> Any:
    return (y, *rest) if rest is not None else y


def _rows_of(value: Any, rows: torch.Tensor, batch: int) -> Any:
    """``value`` (a tensor or tuple of tensors with a leading batch dim) at ``rows``;
    a leading dim of 1 broadcasts over the batch and is left as is."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    if value.shape[0] == batch and batch > 1:
        return value.index_select(0, rows)
    return value


def _rows_mask(
    batch: int, rows: torch.Tensor | None, real: torch.Tensor | None
) -> torch.Tensor:
    """``[batch]`` 1 for the real rows among ``rows`` (``None``: every row)."""
    count = torch.ones(batch, dtype=torch.long)
    if rows is not None:
        count = torch.zeros(batch, dtype=torch.long).index_fill(0, rows.cpu(), 1)
    return count if real is None else count * real.cpu().long()


# -- routing and unrouting a layer -----------------------------------------------------


def routed_class_for(layer_class: type) -> type:
    """``Routed<Name>(RoutedLayer, <Name>)``, created once per original class."""
    if issubclass(layer_class, RoutedLayer):
        return layer_class
    cls = _ROUTED_CLASSES.get(layer_class)
    if cls is None:
        cls = _ROUTED_CLASSES[layer_class] = type(
            f"Routed{layer_class.__name__}",
            (RoutedLayer, layer_class),
            {"__module__": __name__, "__doc__": RoutedLayer.__doc__},
        )
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
    added). ``skip_path``: what skipped tokens get added (``None``: the identity)."""
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


def _refuse_empty(module: nn.Module, args: tuple, kwargs: dict) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is not None and ids.dim() >= 2 and ids.shape[1] == 0:
        raise InputError(
            "a routed model got an input of 0 tokens: give it (or generate()) at "
            "least one token per row, e.g. the tokenizer's BOS token"
        )


def refuse_empty_inputs(model: nn.Module) -> None:
    """A call of ``model`` with 0 tokens per row fails by name (the routing rules
    read a row's last token; dense layers fail with a reshape error). Idempotent."""
    if getattr(model, "_adadsf_empty_hook", None) is None:
        model._adadsf_empty_hook = model.register_forward_pre_hook(
            _refuse_empty, with_kwargs=True
        )
