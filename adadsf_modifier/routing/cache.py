"""KV cache of a routed layer: only the tokens that ran the layer leave keys and values.

A :class:`RoutedCacheLayer` replaces the ``DynamicLayer`` of a routed decoder layer
inside any transformers ``DynamicCache`` (so ``generate()`` works with its default
cache). It stores the keys and values of the *selected* tokens, compacted per step into
``[batch, slots, ...]`` with a ``slot_valid`` mask (rows of a batch select different
numbers of tokens), and it reports the true number of positions seen, because
transformers derives positions and mask sizes from ``cache.get_seq_length()`` and
``get_mask_sizes()`` of layer 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["RoutedCacheLayer", "routed_cache_layer"]


class RoutedCacheLayer(DynamicLayer):
    """Compacted keys/values of selected tokens plus their validity and the true
    length."""

    is_croppable = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.seen_tokens = 0  # positions processed by this layer, selected or not
        self.num_slots = 0  # cached (compacted) key/value slots
        self._slot_valid: torch.Tensor | None = (
            None  # [batch, slots]; None while all are valid
        )
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
        return self.seen_tokens + query_length, 0

    @property
    def all_slots_valid(self) -> bool:
        """True while every cached slot holds a real token (always so at batch size
        1)."""
        return self._slot_valid is None

    def slot_valid(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[batch, num_slots]`` bool: which cached slots hold a token (the rest are
        filler)."""
        if self._slot_valid is None:
            return torch.ones(batch, self.num_slots, dtype=torch.bool, device=device)
        return self._slot_valid

    def record_step(
        self, query_length: int, valid: torch.Tensor | None = None, appended: int = 0
    ) -> None:
        """After a forward over ``query_length`` tokens that appended ``appended``
        slots.

        ``valid [batch, appended]`` marks which appended slots are real; ``None`` means
        all.
        """
        self.seen_tokens += query_length
        if appended == 0:
            return
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

    # batch manipulations used by generate() (beam search, num_return_sequences)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.num_slots:
            super().reorder_cache(beam_idx)
            if self._slot_valid is not None:
                self._slot_valid = self._slot_valid.index_select(
                    0, beam_idx.to(self._slot_valid.device)
                )

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.num_slots:
            super().batch_repeat_interleave(repeats)
            if self._slot_valid is not None:
                self._slot_valid = self._slot_valid.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.num_slots:
            super().batch_select_indices(indices)
            if self._slot_valid is not None:
                self._slot_valid = self._slot_valid[indices, ...]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "AdaDSF routed caches cannot be cropped (assisted/speculative decoding is not supported)"
        )


def routed_cache_layer(cache: Any, layer_idx: int) -> RoutedCacheLayer:
    """The routed cache layer for ``layer_idx`` inside ``cache``, installing it on first
    use."""
    if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
        raise TypeError(
            f"AdaDSF routing supports transformers' DynamicCache, got {type(cache).__name__}"
        )
    layers = cache.layers
    replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    while len(layers) <= layer_idx:
        layers.append(replicate())
    current = layers[layer_idx]
    if isinstance(current, RoutedCacheLayer):
        return current
    if type(current) is not DynamicLayer:
        raise TypeError(
            f"AdaDSF routing needs a plain DynamicLayer at cache layer {layer_idx}, found "
            f"{type(current).__name__} (sliding-window, static and offloaded caches are not "
            "supported by routed layers)"
        )
    if current.is_initialized and current.get_seq_length() > 0:
        raise RuntimeError(
            f"cache layer {layer_idx} already holds {current.get_seq_length()} dense tokens: "
            "a routed model cannot continue from a cache filled by another model"
        )
    layers[layer_idx] = routed = RoutedCacheLayer()
    return routed
