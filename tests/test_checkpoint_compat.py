"""Every upstream workaround in ``adadsf_modifier.checkpoint._compat`` is tagged with
the release it was written for; this test fails when an installed package moved on, so
that the workaround is re-checked (and the tag updated) instead of silently kept."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from adadsf_modifier.checkpoint import _compat


def test_every_workaround_is_tagged():
    assert set(_compat.WORKAROUNDS) == {
        "single_decompress_hook",
        "make_recipe_safe",
        "load_with_expected_extra_keys",
        "write_model_recipe",
    }


@pytest.mark.parametrize(
    ("workaround", "distribution", "target"),
    [(name, dist, target) for name, tags in sorted(_compat.WORKAROUNDS.items())
     for dist, target in sorted(tags.items())],
)  # fmt: skip
def test_workaround_targets_the_installed_release(workaround, distribution, target):
    installed = version(distribution)
    assert installed == target or installed.startswith(target + "."), (
        f"{workaround} was written for {distribution} {target}, installed is "
        f"{installed}: check whether it is still needed, then update its tag"
    )


def test_recipe_with_python_tags_becomes_safe_yaml(tmp_path):
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(
        "stage:\n  mods:\n    M:\n      mappings: !!python/tuple [a, b]\n"
        "      actorder: !!python/object/apply:mod.Enum [static]\n"
    )
    _compat.make_recipe_safe(path)
    data = yaml.safe_load(path.read_text())
    assert data == {"stage": {"mods": {"M": {"mappings": ["a", "b"],
                                             "actorder": "static"}}}}  # fmt: skip
