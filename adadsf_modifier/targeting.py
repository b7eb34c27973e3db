"""Which decoder layers a modifier routes (``targets`` / ``ignore``, matched as
llm-compressor's own modifiers match modules), and the refusal to route twice."""

from __future__ import annotations

from compressed_tensors.utils import is_match
from torch import nn

from adadsf_modifier.constraints import InputError
from adadsf_modifier.routing import RoutedLayer

Layers = list[tuple[str, nn.Module]]


def check_not_routed(layers: Layers, who: str = "AdaDSFModifier") -> None:
    routed = [name for name, layer in layers if isinstance(layer, RoutedLayer)]
    if routed:
        raise InputError(
            f"{who}: decoder layers {routed[:3]}"
            f"{' ...' if len(routed) > 3 else ''} are already routed (a second "
            "routing modifier in the recipe, oneshot run twice on one model, or a "
            "model loaded with adadsf_modifier.from_pretrained); route a dense "
            "model once"
        )


def targeted_layers(
    layers: Layers,
    targets: str | list[str] | None,
    ignore: list[str],
    who: str = "AdaDSFModifier",
) -> list[tuple[int, str, nn.Module]]:
    """``(index, name, layer)`` of the layers matching ``targets`` (all when None;
    names, ``re:`` regexes or class names) and not ``ignore``."""
    wanted = "re:.*" if targets is None else targets
    chosen = [
        (i, n, m) for i, (n, m) in enumerate(layers) if is_match(n, m, wanted, ignore)
    ]
    if not chosen:
        raise InputError(
            f"{who}: targets={targets!r} / ignore={ignore!r} "
            f"match no decoder layer (first layer is `{layers[0][0]}`)"
        )
    return chosen
