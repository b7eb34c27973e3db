"""Refuse YAML recipes that name an AdaDSF modifier but would apply none of it.

llm-compressor 0.14's ``Recipe.from_dict`` reads only top-level keys ending in
``_stage`` and, inside them, groups ending in ``_modifiers``, and silently ignores the
rest (``sparsity:`` instead of ``sparsity_stage:`` gives back the dense model); an empty
``AdaDSFModifier:`` body fails with ``'NoneType' object has no attribute 'get'``. The
wrapper reads an empty body of our modifiers as "all defaults" and refuses a recipe
that names them more often than it instantiates them. Idempotent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmcompressor.recipe import Recipe

OUR_MODIFIERS: tuple[str, ...] = ("AdaDSFModifier", "FTPModifier")
_MARK = "_adadsf_guarded"


def _mentions(obj: Any, name: str) -> int:
    if isinstance(obj, dict):
        return sum((k == name) + _mentions(v, name) for k, v in obj.items())
    if isinstance(obj, list):
        return sum(_mentions(v, name) for v in obj)
    return 0


def _fill_empty_bodies(obj: Any, names: Iterable[str]) -> Any:
    if isinstance(obj, dict):
        return {
            k: ({} if (k in names and v is None) else _fill_empty_bodies(v, names))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_fill_empty_bodies(v, names) for v in obj]
    return obj


def install() -> None:
    if getattr(Recipe.from_dict, _MARK, False):
        return
    original = Recipe.from_dict.__func__

    def from_dict(cls, recipe_dict: dict[str, Any]) -> Recipe:
        recipe_dict = _fill_empty_bodies(recipe_dict, OUR_MODIFIERS)
        recipe = original(cls, recipe_dict)
        for name in OUR_MODIFIERS:
            wanted = _mentions(recipe_dict, name)
            made = sum(type(m).__name__ == name for m in recipe.modifiers)
            if wanted > made:
                raise ValueError(
                    f"the recipe names {name} {wanted} time(s) but llm-compressor "
                    f"instantiated {made}: it reads no modifiers outside top-level "
                    "keys ending in `_stage` and, inside them, groups ending in "
                    f"`_modifiers` (e.g. `sparsity_stage: {{sparsity_modifiers: "
                    f"{{{name}: ...}}}}`); "
                    "rename the stage/group keys"
                )
        return recipe

    from_dict.__doc__ = original.__doc__
    setattr(from_dict, _MARK, True)
    Recipe.from_dict = classmethod(from_dict)
