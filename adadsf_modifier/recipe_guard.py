"""Refuse YAML recipes that name an AdaDSF modifier but would apply none of it.

llm-compressor 0.14's ``Recipe.from_dict`` silently ignores top-level keys not ending
in ``_stage`` and groups not ending in ``_modifiers`` (``sparsity:`` for
``sparsity_stage:`` gives back the dense model), and fails on an empty
``AdaDSFModifier:`` body; the wrapper reads an empty body of our modifiers as "all
defaults" and refuses a recipe that names them more often than it instantiates them.
"""

from __future__ import annotations

import functools
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


def _fill_empty_bodies(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: {} if k in OUR_MODIFIERS and v is None else _fill_empty_bodies(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_fill_empty_bodies(v) for v in obj]
    return obj


def install() -> None:
    if getattr(Recipe.from_dict, _MARK, False):
        return
    original = Recipe.from_dict.__func__

    @functools.wraps(original)
    def from_dict(cls, recipe_dict: dict[str, Any]) -> Recipe:
        recipe_dict = _fill_empty_bodies(recipe_dict)
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

    setattr(from_dict, _MARK, True)
    Recipe.from_dict = classmethod(from_dict)
