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

Entry points:

* :func:`count_flops` -- pure arithmetic from a config and per-layer, per-sequence kept
  counts;
* :func:`observe_routing` / :func:`observe_kept_tokens` -- run a (routed) model on a
  batch and read off how many tokens ran each layer (exact: the routed layers record
  what they ran, see :mod:`adadsf_modifier.routing.recorder`);
* :func:`normalized_flops` -- both together; :func:`stream_flops` over a whole token
  stream, batch by batch.
"""

from adadsf_modifier.flops.count import count_flops, planned_kept
from adadsf_modifier.flops.formulas import (
    FlopsReport,
    LayerFlops,
    LayerShape,
    causal_key_count,
    layer_shape,
)
from adadsf_modifier.flops.observe import (
    ObservedRouting,
    normalized_flops,
    observe_kept_tokens,
    observe_routing,
    stream_flops,
)

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
    "stream_flops",
]
