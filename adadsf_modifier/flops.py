"""An explicit FLOPs model for dense vs depth-sparse (routed) decoder stacks.

The AdaDSF paper reports "normalized FLOPs" without defining them. This module defines
them: for a given batch it counts the FLOPs of the dense model and of the routed model
from the numbers of tokens that actually ran each layer, term by term (attention
projections, the quadratic attention term, the MLP, the router), and reports their
ratio. The formulas are in ``docs/flops.md``.

Conventions (see the docs for the full list):

* one multiply-add = 2 FLOPs; only matrix multiplications are counted (norms,
  activations, softmax, rotary embeddings, residual adds, biases and the routing gate
  are ignored);
* counts are over *real* (non-padding) tokens only: padding is waste of the batching
  scheme, the same in both models, and is not attributed to either;
* attention is counted over the (query, key) pairs actually allowed by the causal mask:
  for a prefill of ``n`` tokens that is ``sum_{i=1..n} i = n (n + 1) / 2`` pairs, not
  ``n^2``;
* ``lm_head`` is a separate term, identical in both models;
  :attr:`FlopsReport.normalized` excludes it,
  :attr:`FlopsReport.normalized_with_lm_head` includes it;
* the gather/scatter of a routed layer costs no FLOPs but moves memory; it is reported
  separately as :attr:`FlopsReport.memory_traffic_bytes`.

Three entry points:

* :func:`count_flops` -- pure arithmetic from a config and per-layer, per-sequence kept
  counts;
* :func:`observe_routing` / :func:`observe_kept_tokens` -- run a (routed) model on a
  batch and read off how many tokens ran each layer (exact: forward pre-hooks recompute
  the routed layer's own selection with the public helpers of
  :mod:`adadsf_modifier.routing.selection`);
* :func:`normalized_flops` -- both together.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adadsf_modifier.allocation import tokens_to_keep
from adadsf_modifier.routing.architectures import decoder_layers
from adadsf_modifier.routing.routed_layer import RoutedLayer
from adadsf_modifier.utils import real_token_mask

__all__ = [
    "LayerShape",
    "LayerFlops",
    "FlopsReport",
    "ObservedRouting",
    "layer_shape",
    "causal_key_count",
    "planned_kept",
    "count_flops",
    "observe_routing",
    "observe_kept_tokens",
    "normalized_flops",
]

_SWIGLU_TYPES = ("llama", "qwen2", "mistral")
_GELU_MLP_TYPES = ("gpt_neox",)


# --------------------------------------------------------------------------------------------
# Shapes and per-term formulas
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """What the FLOPs of one decoder layer depend on, read from a Hugging Face config.

    ``q_dim = num_heads * head_dim`` is the width of the query projection (and of the
    input of the output projection); ``kv_dim = num_kv_heads * head_dim`` the width of
    each of the key and value projections (smaller than ``q_dim`` under grouped-query
    attention). ``mlp_matmuls`` is 3 for a gated (SwiGLU) MLP -- gate, up, down -- and 2
    for a plain MLP (GPT-NeoX: h->4h, 4h->h). ``sliding_windows[l]`` is the attention
    window of layer ``l`` (keys per query at most), or ``None`` for full causal
    attention.
    """

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp_matmuls: int
    num_layers: int
    vocab_size: int
    sliding_windows: tuple[int | None, ...]

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_flops(self, tokens: int) -> int:
        """``2 n (h q_dim + 2 h kv_dim + q_dim h)``: Q, K, V and output projections of n
        tokens."""
        h = self.hidden_size
        return 2 * tokens * (h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h)

    def attention_flops(self, key_pairs: int) -> int:
        """``2 * 2 * heads * head_dim * P``: ``Q K^T`` and ``A V`` over ``P`` (query,
        key) pairs."""
        return 4 * self.num_heads * self.head_dim * key_pairs

    def mlp_flops(self, tokens: int) -> int:
        """``2 n * mlp_matmuls * h * intermediate``."""
        return 2 * tokens * self.mlp_matmuls * self.hidden_size * self.intermediate_size

    def router_flops(self, tokens: int, router_hidden_size: int) -> int:
        """``2 n (h r + r)``: the router's two linear layers (``h -> r -> 1``) on ``n``
        tokens."""
        r = router_hidden_size
        return 2 * tokens * (self.hidden_size * r + r)

    def lm_head_flops(self, tokens: int) -> int:
        """``2 n h V``."""
        return 2 * tokens * self.hidden_size * self.vocab_size


def layer_shape(config: Any) -> LayerShape:
    """The :class:`LayerShape` of a llama / qwen2 / mistral / gpt_neox config (or a
    model)."""
    config = getattr(config, "config", config)  # accept a model as well
    model_type = getattr(config, "model_type", None)
    if model_type in _SWIGLU_TYPES:
        mlp_matmuls = 3
    elif model_type in _GELU_MLP_TYPES:
        mlp_matmuls = 2
    else:
        raise ValueError(
            f"the FLOPs model does not know model_type {model_type!r}; supported: "
            f"{sorted(_SWIGLU_TYPES + _GELU_MLP_TYPES)}"
        )
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if model_type in _GELU_MLP_TYPES:
        kv_heads = heads  # GPT-NeoX: full multi-head attention, fused qkv of width 3h
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    num_layers = int(config.num_hidden_layers)
    return LayerShape(
        model_type=model_type,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(config.intermediate_size),
        mlp_matmuls=mlp_matmuls,
        num_layers=num_layers,
        vocab_size=int(config.vocab_size),
        sliding_windows=_sliding_windows(config, num_layers),
    )


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # qwen2 (and newer configs): per-layer attention kind
        return tuple(
            int(window) if (t == "sliding_attention" and window) else None
            for t in list(layer_types)[:num_layers]
        )
    if getattr(config, "use_sliding_window", None) is False:
        window = None
    return tuple(int(window) if window else None for _ in range(num_layers))


def causal_key_count(queries: int, past: int = 0, window: int | None = None) -> int:
    """(query, key) pairs of ``queries`` new tokens under a causal mask after ``past``
    cached ones.

    Query ``i`` (1-based) sees ``past + i`` keys, at most ``window`` under a sliding
    window: ``sum_{j=past+1}^{past+n} min(j, w)``. A prefill (``past = 0``) gives ``n (n
    + 1) / 2``.
    """
    n, p = int(queries), int(past)
    if n <= 0:
        return 0
    lo, hi = p + 1, p + n
    if window is None or window >= hi:
        return (lo + hi) * n // 2
    w = int(window)
    if w <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    below_hi = min(
        hi, w
    )  # terms j in [lo, below_hi] contribute j, the rest contribute w
    full = (lo + below_hi) * (below_hi - lo + 1) // 2 if below_hi >= lo else 0
    capped = hi - max(lo - 1, w)
    return full + w * capped


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one decoder layer over the whole batch, by term."""

    projections: int
    attention: int
    mlp: int
    router: int = 0

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.mlp + self.router

    def as_dict(self) -> dict[str, int]:
        return {
            "projections": self.projections,
            "attention": self.attention,
            "mlp": self.mlp,
            "router": self.router,
            "total": self.total,
        }


@dataclass(frozen=True)
class FlopsReport:
    """Dense vs routed FLOPs of one batch.

    ``dense_per_layer`` / ``routed_per_layer`` hold a :class:`LayerFlops` per decoder
    layer (the routed one includes that layer's router). ``dense`` and ``routed`` are
    the decoder-stack totals (without ``lm_head``); ``normalized = routed / dense``. The
    ``*_with_lm_head`` variants add the ``lm_head`` term to both.
    ``memory_traffic_bytes`` (not FLOPs) is the gather/scatter traffic of the routed
    layers, per layer in ``memory_traffic_per_layer``.
    """

    shape: LayerShape
    kept: tuple[tuple[int, ...], ...]
    seq_lens: tuple[int, ...]
    routed_layers: frozenset[int]
    dense_per_layer: tuple[LayerFlops, ...]
    routed_per_layer: tuple[LayerFlops, ...]
    lm_head: int
    memory_traffic_per_layer: tuple[int, ...]
    dtype_bytes: int
    notes: tuple[str, ...] = field(default=())

    @property
    def dense(self) -> int:
        return sum(layer.total for layer in self.dense_per_layer)

    @property
    def routed(self) -> int:
        return sum(layer.total for layer in self.routed_per_layer)

    @property
    def router(self) -> int:
        """Router overhead (already included in :attr:`routed`)."""
        return sum(layer.router for layer in self.routed_per_layer)

    @property
    def dense_with_lm_head(self) -> int:
        return self.dense + self.lm_head

    @property
    def routed_with_lm_head(self) -> int:
        return self.routed + self.lm_head

    @property
    def normalized(self) -> float:
        """Routed / dense FLOPs of the decoder stack (router included, ``lm_head``
        excluded)."""
        return self.routed / self.dense if self.dense else float("nan")

    @property
    def normalized_with_lm_head(self) -> float:
        d = self.dense_with_lm_head
        return self.routed_with_lm_head / d if d else float("nan")

    @property
    def memory_traffic_bytes(self) -> int:
        return sum(self.memory_traffic_per_layer)

    def _by_term(self, layers: Iterable[LayerFlops]) -> dict[str, int]:
        layers = list(layers)
        return {
            "projections": sum(x.projections for x in layers),
            "attention": sum(x.attention for x in layers),
            "mlp": sum(x.mlp for x in layers),
            "router": sum(x.router for x in layers),
        }

    @property
    def dense_by_term(self) -> dict[str, int]:
        return self._by_term(self.dense_per_layer)

    @property
    def routed_by_term(self) -> dict[str, int]:
        return self._by_term(self.routed_per_layer)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (totals, ratios, per-term and per-layer breakdowns)."""
        return {
            "model_type": self.shape.model_type,
            "seq_lens": list(self.seq_lens),
            "kept": [list(k) for k in self.kept],
            "routed_layers": sorted(self.routed_layers),
            "dense_flops": self.dense,
            "routed_flops": self.routed,
            "router_flops": self.router,
            "lm_head_flops": self.lm_head,
            "dense_flops_with_lm_head": self.dense_with_lm_head,
            "routed_flops_with_lm_head": self.routed_with_lm_head,
            "normalized_flops": self.normalized,
            "normalized_flops_with_lm_head": self.normalized_with_lm_head,
            "dense_by_term": self.dense_by_term,
            "routed_by_term": self.routed_by_term,
            "dense_per_layer": [x.as_dict() for x in self.dense_per_layer],
            "routed_per_layer": [x.as_dict() for x in self.routed_per_layer],
            "memory_traffic_bytes": self.memory_traffic_bytes,
            "memory_traffic_per_layer": list(self.memory_traffic_per_layer),
            "dtype_bytes": self.dtype_bytes,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def planned_kept(ratios: Sequence[float], seq_lens: Sequence[int]) -> list[list[int]]:
    """Kept counts a routed model *would* use: ``max(1, floor(r_l * n_b))`` (0 for ``r_l
    = 0``).

    For planning without a model (e.g. the worked example in ``docs/flops.md``); a ratio
    of 1 keeps every real token. Same rule as
    :func:`adadsf_modifier.allocation.tokens_to_keep`.
    """
    return [
        [int(n) if r >= 1.0 else tokens_to_keep(float(r), int(n)) for n in seq_lens]
        for r in ratios
    ]


def _as_table(values: Any, num_layers: int, batch: int, name: str) -> list[list[int]]:
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
) -> FlopsReport:
    """Dense vs routed FLOPs of one batch from per-layer, per-sequence kept counts.

    :param config: a llama / qwen2 / mistral / gpt_neox config (or a model carrying one)
    :param kept: ``kept[l][b]`` = tokens of sequence ``b`` that ran decoder layer ``l``
        (all real tokens for a dense layer, 0 for a removed one); a ``[layers, batch]``
        tensor works too
    :param seq_lens: real (non-padding) new tokens per sequence; the dense model runs
        all of them through every layer
    :param routed_layers: indices of the layers whose router runs (it scores every real
        token of the sequence, whatever it then keeps)
    :param router_hidden_size: the routers' hidden width ``r`` (one int, or ``{layer:
        r}``)
    :param past_lens: cached tokens per sequence before this batch (decode / chunked
        prefill; default 0): query ``i`` then sees ``past + i`` keys
    :param routed_past_lens: ``[l][b]`` cached entries of each layer in the routed model
        (a routed layer caches only the tokens that ran it); default: ``past_lens`` for
        every layer. Kept query ``i`` then sees ``routed_past + i`` keys
    :param attended_keys: exact (query, key) pair counts ``[l][b]`` of the routed model,
        overriding the formula ``causal_key_count(kept, past, window)`` (which is exact
        without a sliding window and an upper bound with one, since kept tokens keep
        their original positions);
        :func:`observe_routing` measures them
    :param dense_keys: the same for the dense reference (default: the formula with
        ``seq_lens``)
    :param gather_layers: layers that gather/scatter (memory traffic); default: the
        routed layers where some sequence kept ``0 < k < n`` tokens
    :param dtype_bytes: bytes per hidden-state element for the memory-traffic estimate
    """
    shape = layer_shape(config)
    lens = [
        int(n)
        for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)
    ]
    batch, L = len(lens), shape.num_layers
    kept_t = _as_table(kept, L, batch, "kept")
    past = _per_row(past_lens, batch, "past_lens")
    r_past = (
        _as_table(routed_past_lens, L, batch, "routed_past_lens")
        if routed_past_lens is not None
        else [past] * L
    )
    routed = frozenset(int(i) for i in routed_layers)
    if any(not 0 <= i < L for i in routed):
        raise ValueError(f"routed_layers {sorted(routed)} out of range for {L} layers")
    for l, row in enumerate(kept_t):
        for b, (k, n) in enumerate(zip(row, lens)):
            if not 0 <= k <= n:
                raise ValueError(
                    f"kept[{l}][{b}] = {k} is not within [0, seq_len = {n}]"
                )
    att = (
        _as_table(attended_keys, L, batch, "attended_keys")
        if attended_keys is not None
        else None
    )
    dk = (
        _as_table(dense_keys, L, batch, "dense_keys")
        if dense_keys is not None
        else None
    )
    if gather_layers is None:
        gathers = frozenset(
            l for l in routed if any(0 < k < n for k, n in zip(kept_t[l], lens))
        )
    else:
        gathers = frozenset(int(i) for i in gather_layers)

    def r_of(layer: int) -> int:
        if isinstance(router_hidden_size, Mapping):
            return int(router_hidden_size[layer])
        return int(router_hidden_size)

    real_tokens = sum(lens)
    dense_layers, routed_layers_flops, traffic = [], [], []
    h = shape.hidden_size
    for l in range(L):
        window = shape.sliding_windows[l] if l < len(shape.sliding_windows) else None
        d_pairs = (
            sum(dk[l])
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
        k_tokens = sum(kept_t[l])
        r_pairs = (
            sum(att[l])
            if att is not None
            else sum(
                causal_key_count(k, p, window) for k, p in zip(kept_t[l], r_past[l])
            )
        )
        routed_layers_flops.append(
            LayerFlops(
                projections=shape.projection_flops(k_tokens),
                attention=shape.attention_flops(r_pairs),
                mlp=shape.mlp_flops(k_tokens),
                router=shape.router_flops(real_tokens, r_of(l)) if l in routed else 0,
            )
        )
        # gather in (k h) + scatter out (k h) + the copy of the hidden states scatter
        # writes into
        traffic.append(
            (2 * k_tokens * h + real_tokens * h) * int(dtype_bytes)
            if l in gathers
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
            "multiply-add = 2 FLOPs; matmuls only (norms, activations, softmax, rotary, biases, "
            "residual adds and the routing gate ignored); real tokens only",
            "attention counted over causally allowed (query, key) pairs",
            "normalized excludes lm_head; normalized_with_lm_head includes it",
            "memory_traffic_bytes: gather/scatter bytes written (2 k h + n h) per gathering layer; "
            "not FLOPs",
        ),
    )


# --------------------------------------------------------------------------------------------
# Observing a model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservedRouting:
    """What a model did on one batch, layer by layer (``[layer][sequence]`` tables).

    ``kept``: tokens that ran the layer; ``seq_lens``: real tokens per sequence;
    ``attended_keys``: (query, key) pairs the layer's attention computed among real/kept
    tokens; ``dense_keys``: the pairs the dense layer would compute on the same batch;
    ``routed_layers``: layers whose router ran; ``gather_layers``: layers that
    gathered/scattered a compacted batch; ``router_hidden_sizes``: ``{layer: r}``;
    ``dtype_bytes``: element size of the hidden states.
    """

    kept: list[list[int]]
    seq_lens: list[int]
    attended_keys: list[list[int]]
    dense_keys: list[list[int]]
    routed_layers: frozenset[int]
    gather_layers: frozenset[int]
    router_hidden_sizes: dict[int, int]
    dtype_bytes: int


def _base_forward_signature(layer: nn.Module) -> inspect.Signature:
    cls = type(layer)
    if isinstance(layer, RoutedLayer):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, RoutedLayer))
    return inspect.signature(cls.forward)


def _bind(
    sig: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict
) -> dict[str, Any]:
    bound = sig.bind_partial(module, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", None)
    if isinstance(extra, dict):
        bound.update(extra)
    return bound


def _allowed_pairs(
    mask: torch.Tensor | None, batch: int, n: int, past: int, window: int | None, device
) -> torch.Tensor:
    """``[batch, n, kv]`` bool: which keys each of the ``n`` queries may attend to."""
    if mask is not None and mask.dim() == 4:
        full = mask[:, 0, -n:, :]
        allowed = (
            full if full.dtype == torch.bool else full > torch.finfo(full.dtype).min / 2
        )
        return allowed.expand(batch, *allowed.shape[1:])
    kv = mask.shape[-1] if mask is not None else past + n
    offset = kv - n
    q = torch.arange(n, device=device).view(n, 1) + offset
    k = torch.arange(kv, device=device).view(1, kv)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    allowed = allowed.unsqueeze(0).expand(batch, n, kv)
    if mask is not None:  # 2D padding mask over keys
        allowed = allowed & mask.bool().unsqueeze(1)
    return allowed


def _selected_tokens(
    module: RoutedLayer, x: torch.Tensor, real: torch.Tensor, has_past: bool
) -> torch.Tensor:
    """``[batch, seq] bool``: the tokens a routed layer with ``0 < ratio < 1`` will run.

    Asks the layer itself (:meth:`RoutedLayer.select_tokens`), so the count follows
    every rule the layer applies (routing mode, threshold, top-k budget, attention-sink
    token).
    """
    b, n = real.shape
    try:
        index, valid, k_max = module.select_tokens(
            module.router(x), real, None, has_past
        )
    except RuntimeError:  # causal mode without a threshold: the layer itself will raise
        return torch.zeros_like(real)
    sel = torch.zeros(b, n + 1, dtype=torch.bool, device=real.device)
    if k_max:
        sel = sel.scatter(1, index, valid)
    return sel[:, :n]  # unused slots go to the dropped column n


def _routed_cache_slots(cache: Any, index: int, batch: int, device) -> torch.Tensor:
    """``[batch]`` cached keys a routed layer's selected queries see (valid slots of its
    cache).

    Reads the layer's routed cache (``adadsf_modifier.routing.cache``) by duck typing:
    its ``slot_valid`` mask (an attribute or a ``slot_valid(batch, device)`` method),
    else its ``num_slots``; no cache (or a plain, empty cache layer) means no past.
    """
    layers = getattr(cache, "layers", None) if cache is not None else None
    if layers is None or len(layers) <= index:
        return torch.zeros(batch, dtype=torch.long, device=device)
    layer = layers[index]
    slot_valid = getattr(layer, "slot_valid", None)
    if callable(slot_valid):
        slot_valid = slot_valid(batch, device)
    if isinstance(slot_valid, torch.Tensor):
        return slot_valid.sum(1).to(device=device, dtype=torch.long).expand(batch)
    slots = int(getattr(layer, "num_slots", 0) or 0)
    return torch.full((batch,), slots, dtype=torch.long, device=device)


@torch.no_grad()
def observe_routing(model: nn.Module, batch: Any) -> ObservedRouting:
    """Run ``model`` once on ``batch`` and record, per decoder layer and sequence, what
    ran.

    ``batch`` is a mapping of model inputs (``input_ids``, ``attention_mask``, ...) or
    an ``input_ids`` tensor; the model is called with ``use_cache=False`` unless the
    batch says otherwise (pass ``past_key_values`` and ``use_cache=True`` to measure one
    decoding step). The model runs in its current train/eval state and routing mode.
    Nothing in the model is modified: a forward pre-hook on every decoder layer sees the
    layer's inputs and recomputes what it will do with the same public helpers the
    routed layer uses (:func:`real_token_mask`,
    :func:`tokens_to_keep_per_row`, :func:`select_topk`; in causal mode the layer's
    threshold), so the counts are exact, not inferred from outputs. For a routed layer
    with ``0 < r < 1`` the hook evaluates the router once more (extra work for the
    measurement only, never counted). Attention pairs are read off the layer's own
    attention mask (causality, padding and sliding windows), restricted to the selected
    tokens, plus the valid slots of a routed layer's KV cache. The hooks are removed
    afterwards, also on error.
    """
    spec, layers = decoder_layers(model)
    shape = layer_shape(model.config)
    records: dict[int, dict[str, Any]] = {}
    handles = []

    def make_hook(index: int, layer: nn.Module):
        sig = _base_forward_signature(layer)

        def hook(module, args, kwargs):
            if index in records:
                raise RuntimeError(
                    f"decoder layer {index} ran more than once in one forward; "
                    "observe_routing measures a single forward pass"
                )
            bound = _bind(sig, module, args, kwargs)
            x = bound["hidden_states"]
            b, n, _ = x.shape
            mask = bound.get("attention_mask")
            cache = bound.get(spec.cache_kwarg)
            past = int(cache.get_seq_length(index)) if cache is not None else 0
            window = (
                shape.sliding_windows[index]
                if index < len(shape.sliding_windows)
                else None
            )
            real = real_token_mask(mask, b, n, x.device)
            dense_allowed = _allowed_pairs(mask, b, n, past, window, x.device)
            dense_keys = (dense_allowed & real.unsqueeze(-1)).sum((1, 2))
            n_real = real.sum(1)
            rec = {
                "seq_lens": n_real.tolist(),
                "dense_keys": dense_keys.tolist(),
                "kept": n_real.tolist(),
                "keys": dense_keys.tolist(),
                "routed": False,
                "gather": False,
                "r": None,
                "dtype_bytes": x.element_size(),
            }
            if isinstance(module, RoutedLayer):
                ratio = float(module.retention_ratio)
                rec["r"] = int(module.router.router_hidden_size)
                if (
                    ratio <= 0.0
                ):  # removed layer: returns its input, router not evaluated
                    rec["kept"] = [0] * b
                    rec["keys"] = [0] * b
                elif (
                    ratio >= 1.0
                ):  # every real token runs the unchanged layer (its own cache)
                    rec["routed"] = True
                else:
                    rec["routed"] = True
                    sel = _selected_tokens(module, x, real, has_past=past > 0)
                    mode = module.resolved_routing_mode()
                    kept = sel.sum(1)
                    offset = (
                        dense_allowed.shape[-1] - n
                    )  # keys of the current tokens start here
                    new_pairs = (
                        dense_allowed[:, :, offset:]
                        & sel.unsqueeze(2)
                        & sel.unsqueeze(1)
                    )
                    past_slots = _routed_cache_slots(cache, index, b, x.device)
                    rec["kept"] = kept.tolist()
                    rec["keys"] = (new_pairs.sum((1, 2)) + kept * past_slots).tolist()
                    # causal decoding of one token per row runs the layer in place when
                    # every row runs it; otherwise it index-selects the rows that do
                    in_place = mode == "causal" and n == 1 and bool((kept == 1).all())
                    rec["gather"] = bool(kept.max() > 0) and not in_place
            records[index] = rec

        return hook

    try:
        for i, (_, layer) in enumerate(layers):
            handles.append(
                layer.register_forward_pre_hook(make_hook(i, layer), with_kwargs=True)
            )
        if isinstance(batch, torch.Tensor):
            inputs: dict[str, Any] = {"input_ids": batch}
        else:
            inputs = dict(batch)
        device = next(model.parameters()).device
        inputs = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()
        }
        inputs.setdefault("use_cache", False)
        model(**inputs)
    finally:
        for handle in handles:
            handle.remove()

    missing = [i for i in range(len(layers)) if i not in records]
    if missing:
        raise RuntimeError(
            f"decoder layers {missing} did not run during the forward pass"
        )
    ordered = [records[i] for i in range(len(layers))]
    seq_lens = ordered[0]["seq_lens"]
    for i, rec in enumerate(ordered):
        if rec["seq_lens"] != seq_lens:
            raise RuntimeError(
                f"layer {i} saw real lengths {rec['seq_lens']}, layer 0 saw {seq_lens}"
            )
    return ObservedRouting(
        kept=[rec["kept"] for rec in ordered],
        seq_lens=list(seq_lens),
        attended_keys=[rec["keys"] for rec in ordered],
        dense_keys=[rec["dense_keys"] for rec in ordered],
        routed_layers=frozenset(i for i, rec in enumerate(ordered) if rec["routed"]),
        gather_layers=frozenset(i for i, rec in enumerate(ordered) if rec["gather"]),
        router_hidden_sizes={
            i: rec["r"] for i, rec in enumerate(ordered) if rec["r"] is not None
        },
        dtype_bytes=int(ordered[0]["dtype_bytes"]),
    )


def observe_kept_tokens(model: nn.Module, batch: Any) -> list[list[int]]:
    """``kept[l][b]``: how many tokens of sequence ``b`` ran decoder layer ``l`` on
    ``batch``.

    Dense (unrouted) layers and routed layers at ratio 1 run every real token; a routed
    layer at ratio 0 runs none. See :func:`observe_routing`.
    """
    return observe_routing(model, batch).kept


def normalized_flops(model: nn.Module, batch: Any) -> FlopsReport:
    """:func:`count_flops` of ``model`` on ``batch`` from the counts
    :func:`observe_routing` saw.

    The dense reference is the same model with every layer running every real token and
    no routers. Attention pairs are the observed ones (exact also under sliding windows
    and padding).
    """
    obs = observe_routing(model, batch)
    return count_flops(
        model.config,
        obs.kept,
        obs.seq_lens,
        routed_layers=obs.routed_layers,
        router_hidden_size=obs.router_hidden_sizes,
        attended_keys=obs.attended_keys,
        dense_keys=obs.dense_keys,
        gather_layers=obs.gather_layers,
        dtype_bytes=obs.dtype_bytes,
    )
