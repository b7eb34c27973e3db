"""Recipe checks that :class:`~adadsf_modifier.AdaDSFModifier` runs before any work.

Routers and fitted skip paths must stay in full precision: a quantized router would
silently change which tokens run each layer (its ``fc2`` has one output row, so one
rounding step moves every score), and both are a rounding error of the model's size. A
quantization modifier later in the recipe resolves its targets after AdaDSF added them,
so a broad target (``Linear``, or a name pattern for the skip paths) would pick them
up; such a recipe is refused before calibration. Quantization modifiers are recognised
by llm-compressor's ``QuantizationMixin`` and "later" by its ``initialized`` flag.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from adadsf_modifier.constraints import InputError

__all__ = [
    "ROUTER_HINT",
    "SKIP_PATH_HINT",
    "check_recipe_keeps_routers_unquantized",
    "check_recipe_keeps_skip_paths_unquantized",
]

ROUTER_HINT = "add 're:.*router.*' to the quantization modifier's `ignore` list"
"""How to fix a recipe that would quantize the routers (used in every such error)."""
SKIP_PATH_HINT = "add 're:.*skip_path.*' to the quantization modifier's `ignore` list"
"""How to fix a recipe that would quantize the skip paths."""


def session_recipe_of(owner: Any) -> list[Any]:
    """The modifiers of the active llm-compressor session's recipe if ``owner`` (a
    modifier) is one of them, else none.

    The session outlives ``oneshot``: it keeps the last recipe, including one whose
    run was refused. A modifier applied directly (``apply_to``, outside ``oneshot``)
    must not be judged by that stale recipe's quantization modifiers.
    """
    modifiers = _active_recipe_modifiers()
    if modifiers is None or not any(m is owner for m in modifiers):
        return []
    return modifiers


def _active_recipe_modifiers() -> list[Any] | None:
    try:
        from llmcompressor.core import active_session

        return list(active_session().lifecycle.recipe.modifiers)
    except Exception:  # no session (direct use outside oneshot): nothing to check
        return None


def check_recipe_keeps_routers_unquantized(
    layer_names: Sequence[str], modifiers: Iterable[Any] | None = None
) -> None:
    """Raise ``ValueError`` if a quantization modifier would quantize a router of
    ``layer_names``.

    ``modifiers`` defaults to the active llm-compressor session's recipe. Only
    modifiers that have not initialised yet are checked: one that initialised earlier
    (placed before AdaDSF in the recipe) attached its schemes before the routers
    existed, so it cannot reach them. Called by :class:`AdaDSFModifier` with the names
    of the layers it is about to route.
    """
    probe = nn.Linear(1, 1)  # routers are made of nn.Linear; class targets match it
    names = [
        f"{layer}.router.{part}" for layer in layer_names for part in ("fc1", "fc2")
    ]
    _refuse_matches(names, probe, "router", ROUTER_HINT, modifiers)


def check_routed_model_keeps_routing(
    model: nn.Module, recipe: Any, routed: Sequence[str], skip_probe: nn.Module | None
) -> None:
    """Refuse a recipe for an already routed ``model`` (``oneshot`` on a routed
    checkpoint, or on the model a first ``oneshot`` returned) whose quantization
    modifiers would reach its routers or skip paths.

    Such a model has its routers before any modifier initialises, so the checks the
    AdaDSF modifier makes when it routes never run; without this one, GPTQ would
    calibrate the whole model and only the save would refuse. ``routed``: the names of
    ``model``'s routed decoder layers; ``skip_probe``: one of their skip paths
    (``None``: none has one).
    """
    if not routed:
        return
    from llmcompressor.recipe import Recipe

    modifiers = Recipe.create_instance(recipe).modifiers
    check_recipe_keeps_routers_unquantized(routed, modifiers)
    if skip_probe is not None:
        check_recipe_keeps_skip_paths_unquantized(routed, skip_probe, modifiers)


def check_recipe_keeps_skip_paths_unquantized(
    layer_names: Sequence[str], probe: nn.Module, modifiers: Iterable[Any] | None = None
) -> None:
    """:func:`check_recipe_keeps_routers_unquantized` for the ``skip_path`` modules
    (``skip_path: ridge``) of ``layer_names``; ``probe``: a module of their class
    (class-name targets match it)."""
    names = [f"{layer}.skip_path" for layer in layer_names]
    _refuse_matches(names, probe, "skip path", SKIP_PATH_HINT, modifiers)


def _refuse_matches(
    names: list[str],
    probe: nn.Module,
    what: str,
    hint: str,
    modifiers: Iterable[Any] | None,
) -> None:
    if modifiers is None:
        modifiers = _active_recipe_modifiers()
        if modifiers is None:
            return
    from compressed_tensors.utils import is_match
    from llmcompressor.modifiers.quantization.quantization.mixin import (
        QuantizationMixin,
    )

    for mod in modifiers:
        if not isinstance(mod, QuantizationMixin) or getattr(mod, "initialized", False):
            continue
        try:
            targets = mod.resolved_targets
            ignore = list(mod.ignore or [])
        except Exception:  # let the modifier report its own configuration error later
            continue
        for name in names:
            if is_match(name, probe, targets, ignore):
                raise InputError(
                    f"{type(mod).__name__} (targets={sorted(targets)}, "
                    f"ignore={ignore}) would quantize the AdaDSF {what} `{name}`; "
                    f"{what}s must stay in full precision: {hint}"
                )
