"""Outputs the CLI writes (``eval`` / ``bench --output``): atomically, under a name
nobody can predict, as strict JSON."""

from __future__ import annotations

import json
import math

from adadsf_modifier.cli.checks import write_json


def test_a_link_planted_at_the_old_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "result.json"
    (tmp_path / "result.json.tmp").symlink_to(victim)
    write_json(out, {"ppl": 12.5})
    assert victim.read_text() == "keep me"
    assert not out.is_symlink() and json.loads(out.read_text()) == {"ppl": 12.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "result.json", "result.json.tmp", "victim.txt"
    ]  # fmt: skip


def test_a_non_finite_number_is_written_as_null(tmp_path):
    out = tmp_path / "result.json"
    write_json(out, {"ppl": math.inf, "tasks": {"piqa": {"acc": math.nan}}})
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"ppl": None, "tasks": {"piqa": {"acc": None}}}
