"""The FLOPs formulas (``docs/flops.md``): one decoder layer's terms, and the report
of a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field, fields
from typing import Any

from adadsf_modifier.routing.architectures import (
    architecture_for_config,
    sliding_windows,
)
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.skip_path import SkipPath

__all__ = [
    "LayerShape",
    "LayerFlops",
    "FlopsReport",
    "layer_shape",
    "causal_key_count",
]


@dataclass(frozen=True)
class LayerShape:
    """What the FLOPs of one decoder layer depend on, read from a config.

    ``mlp_matmuls``: 3 for SwiGLU, 2 for GPT-NeoX's MLP; ``sliding_windows[l]``: layer
    ``l``'s window or ``None``; ``fused_qkv``: one fused QKV projection (GPT-NeoX), so
    a skipped token's keys/values cost the whole projection.
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
    fused_qkv: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_flops(self, tokens: int) -> int:
        """Q, K, V and output projections: ``2 n (h q + 2 h kv + q h)``."""
        h = self.hidden_size
        return 2 * tokens * (h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h)

    def attention_flops(self, key_pairs: int) -> int:
        """``Q K^T`` and ``A V`` over ``P`` (query, key) pairs: ``4 H d P``."""
        return 4 * self.num_heads * self.head_dim * key_pairs

    def mlp_flops(self, tokens: int) -> int:
        return 2 * tokens * self.mlp_matmuls * self.hidden_size * self.intermediate_size

    def router_flops(self, tokens: int, router_hidden_size: int) -> int:
        return TokenRouter.flops_for(tokens, self.hidden_size, router_hidden_size)

    def kv_only_flops(self, tokens: int) -> int:
        """Keys/values of ``n`` skipped tokens (``skipped_tokens_kv``)."""
        width = 2 * self.kv_dim + (self.q_dim if self.fused_qkv else 0)
        return 2 * tokens * self.hidden_size * width

    def skip_path_flops(self, tokens: int, rank: int | None) -> int:
        return SkipPath.flops_for(tokens, self.hidden_size, rank)

    def lm_head_flops(self, tokens: int) -> int:
        return 2 * tokens * self.hidden_size * self.vocab_size


def layer_shape(config: Any) -> LayerShape:
    """The :class:`LayerShape` of a supported config (or a model carrying one)."""
    config = getattr(config, "config", config)  # accept a model as well
    spec = architecture_for_config(config)
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    return LayerShape(
        model_type=spec.model_type,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=spec.num_kv_heads(config),
        head_dim=head_dim,
        intermediate_size=int(config.intermediate_size),
        mlp_matmuls=spec.mlp_matmuls,
        num_layers=int(config.num_hidden_layers),
        vocab_size=int(config.vocab_size),
        sliding_windows=sliding_windows(config),
        fused_qkv=spec.fused_qkv is not None,
    )


def causal_key_count(queries: int, past: int = 0, window: int | None = None) -> int:
    """(query, key) pairs of ``queries`` new tokens after ``past`` cached ones:
    ``sum_{j=past+1}^{past+n} min(j, window)``."""
    n, p = int(queries), int(past)
    if n <= 0:
        return 0
    lo, hi = p + 1, p + n
    if window is None or window >= hi:
        return (lo + hi) * n // 2
    w = int(window)
    if w <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    below_hi = min(hi, w)  # terms j in [lo, below_hi] contribute j, the rest w
    full = (lo + below_hi) * (below_hi - lo + 1) // 2 if below_hi >= lo else 0
    capped = hi - max(lo - 1, w)
    return full + w * capped


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one decoder layer over the whole batch, by term."""

    projections: int
    attention: int
    mlp: int
    router: int = 0
    #: the fitted skip path on the tokens that skipped the layer
    skip_path: int = 0
    #: keys/values of the tokens that skipped the layer (``skipped_tokens_kv``)
    kv_only: int = 0

    @property
    def total(self) -> int:
        return sum(astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def __add__(self, other: LayerFlops) -> LayerFlops:
        """The same layer's FLOPs over two batches (every term is a sum over tokens)."""
        return LayerFlops(*map(sum, zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class FlopsReport:
    """Dense vs routed FLOPs of one batch (or of several, :meth:`combine`), per
    decoder layer; totals and :attr:`normalized` leave ``lm_head`` out, the
    ``*_with_lm_head`` ones add it to both sides. ``memory_traffic_*``: the routed
    layers' gather/scatter bytes (not FLOPs).
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

    @staticmethod
    def _by_term(layers: Sequence[LayerFlops]) -> dict[str, int]:
        names = [f.name for f in fields(LayerFlops)]
        return {k: sum(getattr(x, k) for x in layers) for k in names}

    @property
    def dense_by_term(self) -> dict[str, int]:
        return self._by_term(self.dense_per_layer)

    @property
    def routed_by_term(self) -> dict[str, int]:
        return self._by_term(self.routed_per_layer)

    @classmethod
    def combine(cls, reports: Sequence[FlopsReport]) -> FlopsReport:
        """One report over several batches of one model: sequences concatenated,
        per-layer FLOPs added, so each batch weighs by its FLOPs as in one large batch
        (a mean of per-batch ratios would not)."""
        if not reports:
            raise ValueError("combine needs at least one FlopsReport")
        first = reports[0]
        for r in reports[1:]:
            if r.shape != first.shape or len(r.kept) != len(first.kept):
                raise ValueError("combine takes reports of one model only")

        def per_layer(column):  # [layer] of each report's [layer]: sum over reports
            return tuple(sum(c[1:], c[0]) for c in zip(*map(column, reports)))

        return cls(
            shape=first.shape,
            kept=per_layer(lambda r: r.kept),  # tuples concatenate: every sequence
            seq_lens=tuple(n for r in reports for n in r.seq_lens),
            routed_layers=frozenset().union(*(r.routed_layers for r in reports)),
            dense_per_layer=per_layer(lambda r: r.dense_per_layer),
            routed_per_layer=per_layer(lambda r: r.routed_per_layer),
            lm_head=sum(r.lm_head for r in reports),
            memory_traffic_per_layer=per_layer(lambda r: r.memory_traffic_per_layer),
            dtype_bytes=first.dtype_bytes,
            notes=tuple(dict.fromkeys(n for r in reports for n in r.notes)),
        )

    def as_dict(self) -> dict[str, Any]:
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
