"""Dense vs routed FLOPs, counted term by term from the tokens that ran each layer
(``docs/flops.md``: formulas and conventions).

:func:`count_flops` is the arithmetic on kept counts; :func:`observe_routing` runs a
model and reads the counts off its routed layers' own records; :func:`normalized_flops`
does both on a batch, :func:`stream_flops` on a token stream.
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
