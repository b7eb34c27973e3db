"""KV cache of a routed layer: only the tokens that ran the layer leave keys and values.

A :class:`RoutedCacheLayer` replaces the ``DynamicLayer`` (or, for a sliding-window
layer, the ``DynamicSlidingWindowLayer``) of a routed decoder layer inside any
transformers ``DynamicCache`` (so ``generate()`` works with its default cache). It
stores the keys and values of the *selected* tokens, compacted per step into ``[batch,
slots, ...]`` with a ``slot_valid`` mask (rows of a batch select different numbers of
tokens), and it reports the true number of positions seen, because transformers derives
positions and mask sizes from ``cache.get_seq_length()`` and ``get_mask_sizes()``.

Under a sliding window of ``w`` keys a query at sequence index ``q`` sees the keys at
indices ``> q - w``. Compacted slots no longer sit at their index, so a windowed layer
also keeps each slot's sequence index and masks the slots that left the window; whole
steps whose slots every later query has left behind are dropped (no host sync: the
bounds are known per step).

Rank routing (:func:`~adadsf_modifier.routing.selection.choose_by_rank`) decides a new
token against the router scores of its row's earlier tokens at the same layer, so those
scores live with the layer's cache (:class:`RankScoresMixin`): on the
:class:`RoutedCacheLayer` of a layer that caches only the tokens that ran, and on the
model's own dense cache layer, its class swapped for a scored subclass
(:func:`scored_cache_layer`), for a layer that caches every position
(``skipped_tokens_kv``). Both follow the batch through
``generate()``'s reorders.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from adadsf_modifier.routing.selection import RankState, choose_by_rank

__all__ = [
    "RankScoresMixin",
    "RoutedCacheLayer",
    "rank_select",
    "routed_cache_layer",
    "scored_cache_layer",
]


class RankScoresMixin:
    """Rank routing's :class:`~adadsf_modifier.routing.selection.RankState` of every
    position a cache layer has seen: the router scores, how many were real, how many
    ran. ``None`` until rank routing first runs on the cache.
    """

    __slots__ = ()  # a dense layer's class is swapped in place: same layout
    rank_state: RankState | None = None

    def rank_length(self) -> int:
        return 0 if self.rank_state is None else int(self.rank_state.scores.shape[1])

    def rank_rows(self, fn) -> None:
        """Apply a batch-dim operation (reorder, repeat, select) to the state."""
        state = self.rank_state
        if state is not None:
            kept = None if state.kept is None else fn(state.kept)
            self.rank_state = RankState(fn(state.scores), fn(state.count), kept)

    def rank_crop(self, tokens_to_remove: int) -> None:
        """Forget the last positions; how many of those left ran is recounted by the
        next rank decision (:func:`~adadsf_modifier.routing.selection.choose_by_rank`),
        which knows the layer's ratio."""
        if self.rank_state is not None and tokens_to_remove:
            scores = self.rank_state.scores[:, : -abs(tokens_to_remove)]
            # nothing left: as if rank routing never ran
            self.rank_state = (
                RankState(scores, (~scores.isnan()).sum(1), None)
                if scores.shape[1]
                else None
            )


class RoutedCacheLayer(RankScoresMixin, DynamicLayer):
    """Compacted keys/values of selected tokens plus their validity and the true
    length."""

    is_croppable = False

    def __init__(
        self, sliding_window: int | None = None, is_sliding: bool = False, **kwargs: Any
    ):
        """``sliding_window``: the routed layer's attention window (masks cached slots);
        ``is_sliding``: this replaces a ``DynamicSlidingWindowLayer``, whose mask sizes
        (and ``is_sliding`` flag, which transformers reads) it keeps."""
        super().__init__(**kwargs)
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.is_sliding = bool(is_sliding and self.sliding_window)
        self.seen_tokens = 0  # positions processed by this layer, selected or not
        self.num_slots = 0  # cached (compacted) key/value slots
        # [batch, slots]; None while all are valid
        self._slot_valid: torch.Tensor | None = None
        # windowed layers: [batch, slots] sequence index of each slot's token, and per
        # step (slots appended, lowest index, highest index), oldest first
        self._slot_pos: torch.Tensor | None = None
        self._steps: list[tuple[int, int, int]] = []
        self._rows: tuple[torch.Tensor, int] | None = None  # see only_rows()

    @contextmanager
    def only_rows(self, rows: torch.Tensor, batch: int) -> Iterator[None]:
        """While active, the layer runs on rows ``rows`` of a ``batch``-row cache only.

        Used when some rows of a decoding step skip the layer: :meth:`update` receives
        the new keys/values of those rows, stores them in a fresh slot of every row (the
        others get a zero filler the caller marks invalid with :meth:`record_step`) and
        returns the cached keys/values of those rows alone.
        """
        self._rows = (rows, batch)
        try:
            yield
        finally:
            self._rows = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            return super().update(key_states, value_states, *args, **kwargs)
        rows, batch = self._rows

        def widen(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros((batch, *t.shape[1:])).index_copy_(0, rows, t)

        keys, values = super().update(
            widen(key_states), widen(value_states), *args, **kwargs
        )
        return keys.index_select(0, rows), values.index_select(0, rows)

    # what transformers reads to build positions and masks: the true sequence length
    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the model's mask: those of the dense layer this
        cache replaced (a sliding-window layer keeps the last ``w - 1`` keys), so every
        layer that shares the model's mask reads it the same way."""
        if not self.is_sliding:
            return self.seen_tokens + query_length, 0
        w = self.sliding_window
        return min(self.seen_tokens, w - 1) + query_length, max(
            self.seen_tokens - w + 1, 0
        )

    @property
    def all_slots_valid(self) -> bool:
        """True while every cached slot holds a real token (always so at batch size
        1)."""
        return self._slot_valid is None

    def past_fully_visible(self, query_length: int) -> bool:
        """Whether the next ``query_length`` queries may attend to every cached slot:
        no filler slot and, under a sliding window, none out of any query's window.

        Decided on the host (no device sync), so it is cheap to ask every step.
        """
        if self._slot_valid is not None:
            return False
        if self.sliding_window is None or not self._steps:
            return True
        last_query = self.seen_tokens + query_length - 1
        return self._steps[0][1] > last_query - self.sliding_window

    def slot_valid(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[batch, num_slots]`` bool: which cached slots hold a token (the rest are
        filler)."""
        if self._slot_valid is None:
            return torch.ones(batch, self.num_slots, dtype=torch.bool, device=device)
        return self._slot_valid

    def visible_slots(
        self,
        batch: int,
        device: torch.device,
        query_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Which cached slots each new query may attend to.

        ``query_offsets [batch, K]``: positions of the queries within the step
        (``None``: one query, the step's only token). Returns ``[batch, num_slots]``
        without a sliding window (every query sees every valid slot) and ``[batch, K,
        num_slots]`` (``K = 1`` for ``None``) with one.
        """
        valid = self.slot_valid(batch, device)
        if self.sliding_window is None:
            return valid
        if query_offsets is None:
            query_offsets = torch.zeros(batch, 1, dtype=torch.long, device=device)
        lowest = self.seen_tokens + query_offsets - self.sliding_window  # [batch, K]
        pos = self._slot_pos
        if pos is None:  # nothing cached yet
            pos = torch.zeros(batch, 0, dtype=torch.long, device=device)
        in_window = pos.unsqueeze(1) > lowest.unsqueeze(-1)
        return valid.unsqueeze(1) & in_window

    def record_step(
        self,
        query_length: int,
        valid: torch.Tensor | None = None,
        appended: int = 0,
        index: torch.Tensor | None = None,
    ) -> None:
        """After a forward over ``query_length`` tokens that appended ``appended``
        slots.

        ``valid [batch, appended]`` marks which appended slots are real; ``None`` means
        all. ``index [batch, appended]``: the position within the step of each appended
        slot's token (``None``: the step's first token); only a windowed layer uses it.
        """
        start = self.seen_tokens
        self.seen_tokens += query_length
        if appended:
            self._append_slots(start, query_length, valid, appended, index)
        if self.sliding_window is not None:
            self._evict(self.seen_tokens - self.sliding_window)

    def _append_slots(self, start, query_length, valid, appended, index) -> None:
        if valid is not None and self._slot_valid is None and not bool(valid.all()):
            self._slot_valid = torch.ones(
                valid.shape[0], self.num_slots, dtype=torch.bool, device=valid.device
            )
        if self._slot_valid is not None:
            if valid is None:
                valid = torch.ones(
                    self._slot_valid.shape[0],
                    appended,
                    dtype=torch.bool,
                    device=self._slot_valid.device,
                )
            self._slot_valid = torch.cat([self._slot_valid, valid], dim=1)
        self.num_slots += appended
        if self.sliding_window is None:
            return
        batch = self.keys.shape[0]
        if index is None:
            pos = torch.full((batch, appended), start, device=self.keys.device)
        else:
            pos = start + index.to(self.keys.device).expand(batch, appended)
        old = self._slot_pos if self._slot_pos is not None else pos[:, :0]
        self._slot_pos = torch.cat([old, pos], dim=1)
        self._steps.append((appended, start, start + query_length - 1))

    def _evict(self, lowest: int) -> None:
        """Drop the oldest steps whose slots no query at index ``> lowest + w - 1``
        sees."""
        drop = 0
        while self._steps and self._steps[0][2] <= lowest:
            drop += self._steps.pop(0)[0]
        if not drop:
            return
        self.keys = self.keys[:, :, drop:]
        self.values = self.values[:, :, drop:]
        self._slot_pos = self._slot_pos[:, drop:]
        if self._slot_valid is not None:
            self._slot_valid = self._slot_valid[:, drop:]
        self.num_slots -= drop

    # batch manipulations used by generate() (beam search, num_return_sequences)
    def _per_row(self, fn) -> None:
        if self._slot_valid is not None:
            self._slot_valid = fn(self._slot_valid)
        if self._slot_pos is not None:
            self._slot_pos = fn(self._slot_pos)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.num_slots:
            super().reorder_cache(beam_idx)
            self._per_row(lambda t: t.index_select(0, beam_idx.to(t.device)))
        self.rank_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.num_slots:
            super().batch_repeat_interleave(repeats)
            self._per_row(lambda t: t.repeat_interleave(repeats, dim=0))
        self.rank_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.num_slots:
            super().batch_select_indices(indices)
            self._per_row(lambda t: t[indices, ...])
        self.rank_rows(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "AdaDSF routed caches cannot be cropped (assisted/speculative decoding is "
            "not supported)"
        )


def routed_cache_layer(
    cache: Any, layer_idx: int, sliding_window: int | None = None
) -> RoutedCacheLayer:
    """The routed cache layer for ``layer_idx`` inside ``cache``, installing it on first
    use.

    ``sliding_window``: the routed layer's attention window (from its config); a
    ``DynamicSlidingWindowLayer`` there must have the same one.
    """
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            "AdaDSF routing supports transformers' DynamicCache, got "
            f"{type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    current = layers[layer_idx]
    if isinstance(current, RoutedCacheLayer):
        return current
    if type(current) is DynamicSlidingWindowLayer:
        if current.sliding_window != sliding_window:
            raise TypeError(
                f"cache layer {layer_idx} has a sliding window of "
                f"{current.sliding_window} tokens, the routed decoder layer "
                f"{sliding_window}: build the cache from this model's config"
            )
    elif type(current) is not DynamicLayer:
        raise TypeError(
            "AdaDSF routing needs a DynamicLayer or DynamicSlidingWindowLayer at "
            f"cache layer {layer_idx}, found {type(current).__name__} (static, "
            "quantized and offloaded caches are not supported by routed layers)"
        )
    if current.is_initialized and current.get_seq_length() > 0:
        raise RuntimeError(
            f"cache layer {layer_idx} already holds {current.get_seq_length()} dense "
            "tokens: a routed model cannot continue from a cache filled by another "
            "model"
        )
    layers[layer_idx] = routed = RoutedCacheLayer(
        sliding_window, is_sliding=type(current) is DynamicSlidingWindowLayer
    )
    return routed


def _scored_class(base: type) -> type:
    """``RankScored<Base>``: ``base`` (a dense cache layer class) also keeping rank
    routing's scores through ``generate()``'s batch operations. Built with ``base`` as
    its only base (the mixin's methods copied in): CPython swaps an object's class in
    place only between classes of the same base chain."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        base.reorder_cache(self, beam_idx)
        self.rank_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        base.batch_repeat_interleave(self, repeats)
        self.rank_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        base.batch_select_indices(self, indices)
        self.rank_rows(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        before = self.get_seq_length()
        base.crop(self, tokens_to_remove)
        self.rank_crop(before - self.get_seq_length())

    def reset(self) -> None:
        base.reset(self)
        self.rank_state = None

    namespace = {
        name: value
        for name, value in vars(RankScoresMixin).items()
        if name in ("rank_state", "rank_length", "rank_rows", "rank_crop")
    }
    namespace.update(
        __slots__=(),
        __module__=__name__,
        reorder_cache=reorder_cache,
        batch_repeat_interleave=batch_repeat_interleave,
        batch_select_indices=batch_select_indices,
        crop=crop,
        reset=reset,
    )
    return type(f"RankScored{base.__name__}", (base,), namespace)


_SCORED_CLASSES: dict[type, type] = {}


def scored_cache_layer(cache: Any, layer_idx: int) -> RankScoresMixin:
    """The model's own (dense) cache layer ``layer_idx`` of ``cache``, able to keep
    rank routing's scores: its class is swapped once for a subclass that carries them,
    so its keys, values and everything transformers reads stay as they are."""
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            "AdaDSF rank routing supports transformers' DynamicCache, got "
            f"{type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    current = layers[layer_idx]
    if hasattr(current, "rank_rows"):  # a RoutedCacheLayer, or swapped before
        return current
    base = type(current)
    if base not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise TypeError(
            "AdaDSF rank routing needs a DynamicLayer or DynamicSlidingWindowLayer at "
            f"cache layer {layer_idx}, found {base.__name__}"
        )
    cls = _SCORED_CLASSES.get(base)
    if cls is None:
        cls = _SCORED_CLASSES[base] = _scored_class(base)
    current.__class__ = cls
    return current


def rank_select(
    store: RankScoresMixin | None,
    past_len: int,
    scores: torch.Tensor,
    real: torch.Tensor,
    ratio: float,
    keep_first: bool,
) -> torch.Tensor:
    """``[batch, Q]`` bool: the new tokens that run under rank routing
    (:func:`~adadsf_modifier.routing.selection.choose_by_rank`), against the scores
    ``store`` (a cache layer; ``None``: no cache) holds for the ``past_len`` positions
    before them, which it then holds for these too."""
    if store is None:
        return choose_by_rank(scores, real, ratio, keep_first)[0]
    if store.rank_length() != past_len:
        raise RuntimeError(
            f"AdaDSF rank routing needs the router scores of every earlier position "
            f"at this layer; the cache has {past_len} positions and scores for "
            f"{store.rank_length()} (it was filled in another routing mode): start a "
            "new cache after switching to rank routing"
        )
    selected, store.rank_state = choose_by_rank(
        scores, real, ratio, keep_first, store.rank_state
    )
    return selected
