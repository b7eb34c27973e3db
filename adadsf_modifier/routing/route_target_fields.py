"""Which part of a decoder layer the routers decide: the ``route_target`` recipe field,
a pydantic mixin that :class:`~adadsf_modifier.AdaDSFModifier` inherits (through
:class:`~adadsf_modifier.routing.skip_fields.SkipPathFields`).

Kept next to the code it configures (:mod:`~adadsf_modifier.routing.sub_blocks`). The
mixin declares no ``model_config``: the modifier keeps llm-compressor's
``extra="forbid"``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from torch import nn

from adadsf_modifier.routing.sub_blocks import RouteTarget, check_route_target

__all__ = ["RouteTargetFields"]


class RouteTargetFields(BaseModel):
    """Route whole decoder layers, or only their attention or MLP sub-block
    (Router-Tuning / MindSkip skip attention only; SkipGPT routes both separately).

    ```yaml
    AdaDSFModifier:
      retention: 0.5
      route_target: attention   # layer (default, the paper) | attention | mlp
    ```

    :param route_target: ``layer``: a skipped token skips the whole layer (the paper);
        ``attention``: it skips only the attention sub-block (input norm, attention and
        its residual add) and still runs the MLP sub-block; ``mlp``: every token runs
        the attention, skipped tokens skip the post-attention norm and MLP. Retention is
        then the mean fraction of tokens running the routed *sub-block*, so the FLOPs
        saved at a given retention are much smaller than for ``layer`` (on SmolLM2-135M
        at 512 tokens the attention sub-block is ~31% of a layer's FLOPs, the MLP ~69%):
        compare settings at *measured* FLOPs
        (:func:`~adadsf_modifier.flops.normalized_flops`), not at equal retention. The
        calibration similarity driving allocation and the routers' warm start is that of
        the routed sub-block. ``attention`` combines with ``skipped_tokens_kv``; a ridge
        ``skip_path`` needs ``layer``. Needs sequential pre-norm sub-blocks (Llama,
        Qwen2, Mistral; GPT-NeoX is refused before calibration)
    """

    route_target: RouteTarget = "layer"

    def check_route_target(self, model: nn.Module) -> None:
        """Refuse, before any calibration, a target the model's architecture or the
        other skip options cannot take."""
        check_route_target(
            self.route_target,
            model.config,
            skip_path=getattr(self, "skip_path", "identity") != "identity",
            kv=bool(getattr(self, "skipped_tokens_kv", False)),
        )

    def configure_route_target(self, layer: Any) -> None:
        """Give a freshly routed layer its ``route_target``."""
        if self.route_target != "layer":
            layer.route_target = self.route_target
