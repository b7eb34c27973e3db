"""KV cache of a routed layer: only the tokens that ran the layer leave keys and values.

A :class:`RoutedCacheLayer` replaces a routed layer's ``DynamicLayer`` (or sliding
window layer) inside any ``DynamicCache``, so ``generate()`` works with its default
cache. It stores the kept tokens' keys/values compacted per step (``slot_valid`` marks
the used slots) and reports the true number of positions seen, from which transformers
derives positions and mask sizes. Under a sliding window it also keeps each slot's
sequence index, to mask slots that left the window and drop steps every later query
has left behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["RoutedCacheLayer", "cache_layer", "check_dense_cache", "routed_cache_layer"]


def cache_layer(cache: Any, layer_idx: int, who: str) -> Any:
    """Layer ``layer_idx`` of a transformers ``DynamicCache``, created (as the cache
    would) where the cache has not reached it yet; ``who`` names the caller in the
    refusal of any other cache."""
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            f"{who} supports transformers' DynamicCache, got {type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    return layers[layer_idx]


class RoutedCacheLayer(DynamicLayer):
    """The compacted keys/values of the tokens that ran, their validity, the true
    length."""

    is_croppable = False

    def __init__(
        self, sliding_window: int | None = None, is_sliding: bool = False, **kwargs: Any
    ):
        """``sliding_window``: the layer's attention window; ``is_sliding``: this
        replaces a ``DynamicSlidingWindowLayer``, whose mask sizes and flag it keeps."""
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
        """While active, :meth:`update` gets the keys/values of rows ``rows`` only (a
        decoding step some rows skip): it stores them in a new slot of every row
        (zero filler elsewhere, marked invalid by :meth:`record_step`) and returns
        those rows' cache."""
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
        """``(kv_length, kv_offset)``: those of the dense layer this replaced, so
        every layer sharing the model's mask reads it alike."""
        if not self.is_sliding:
            return self.seen_tokens + query_length, 0
        w = self.sliding_window
        return min(self.seen_tokens, w - 1) + query_length, max(
            self.seen_tokens - w + 1, 0
        )

    def past_fully_visible(self, query_length: int) -> bool:
        """Whether the next ``query_length`` queries see every cached slot (no
        filler, none out of the window), decided on the host: cheap to ask every
        step."""
        if self._slot_valid is not None:
            return False
        if self.sliding_window is None or not self._steps:
            return True
        last_query = self.seen_tokens + query_length - 1
        return self._steps[0][1] > last_query - self.sliding_window

    def slot_valid(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[batch, num_slots]`` bool: which cached slots hold a token."""
        if self._slot_valid is None:
            return torch.ones(batch, self.num_slots, dtype=torch.bool, device=device)
        return self._slot_valid

    def visible_slots(
        self,
        batch: int,
        device: torch.device,
        query_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The cached slots each new query may see: ``[batch, num_slots]`` without a
        window, ``[batch, K, num_slots]`` with one (``query_offsets [batch, K]``: the
        queries' positions within the step; ``None``: one query)."""
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
        slots: ``valid [batch, appended]`` which are real (``None``: all), ``index``
        their tokens' positions within the step (``None``: the first; a windowed
        layer reads it)."""
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
        """Drop the oldest steps no query after ``lowest + w - 1`` sees."""
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

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.num_slots:
            super().batch_repeat_interleave(repeats)
            self._per_row(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.num_slots:
            super().batch_select_indices(indices)
            self._per_row(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "AdaDSF routed caches cannot be cropped (assisted/speculative decoding is "
            "not supported)"
        )


def routed_cache_layer(
    cache: Any, layer_idx: int, sliding_window: int | None = None
) -> RoutedCacheLayer:
    """The routed cache layer ``layer_idx`` of ``cache``, installed on first use in
    place of an empty dense one (a sliding-window one must have the layer's window)."""
    current = cache_layer(cache, layer_idx, "AdaDSF routing")
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
    cache.layers[layer_idx] = routed = RoutedCacheLayer(
        sliding_window, is_sliding=type(current) is DynamicSlidingWindowLayer
    )
    return routed


def check_dense_cache(cache: Any, layer_idx: int) -> None:
    """A layer keeping skipped tokens' K/V caches every position in the model's own
    cache layer, never in a routed one."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        if isinstance(layers[layer_idx], RoutedCacheLayer):
            raise RuntimeError(
                f"cache layer {layer_idx} was filled by a routed layer that did not "
                "keep skipped tokens' keys/values; start a new cache after changing "
                "skipped_tokens_kv"
            )
