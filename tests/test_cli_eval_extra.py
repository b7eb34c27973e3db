"""The evaluation stack (lm-eval, matplotlib) is the `[eval]` extra: the package and
the modifier work without it, and each place that needs it says which extra to
install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adadsf_modifier.evaluation.lm_eval_tasks import evaluate_tasks

TESTS = Path(__file__).resolve().parent

WITHOUT_EXTRA = """
import sys
sys.modules["lm_eval"] = None  # as if not installed
sys.modules["matplotlib"] = None
import adadsf_modifier, adadsf_modifier.cli, adadsf_modifier.evaluation
from llmcompressor import oneshot
from tiny_models import save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", "m", 2))
modifier = adadsf_modifier.AdaDSFModifier(
    retention=0.5, router_init_steps=2
)
oneshot(model=model, recipe=[modifier], dataset=token_dataset(4, 8),
        num_calibration_samples=4, max_seq_length=8)
assert len(adadsf_modifier.routed_layers(model)) == 2
assert sys.modules["lm_eval"] is None and sys.modules["matplotlib"] is None
print("routed without the eval extra")
"""


def test_package_and_modifier_run_without_the_eval_extra(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "routed without the eval extra" in done.stdout


def test_lm_eval_tasks_name_the_extra_when_lm_eval_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ModuleNotFoundError, match=r"adadsf-modifier\[eval\]"):
        evaluate_tasks(None, None, ["piqa"])
