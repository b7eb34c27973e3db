"""The model ``oneshot`` returns runs in the same process, for every shipped recipe,
and gives the logits of the checkpoint it saved: using the returned model is the most
common llm-compressor flow (llm-compressor leaves compressed-tensors' offload wrappers
on its modules, which move every keyword tensor a module receives)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from llmcompressor import oneshot
from tiny_models import save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

pytestmark = pytest.mark.usefixtures("single_thread")


def _tiny(recipe: str) -> str:
    """The shipped recipe at a tiny model's size and a CPU test's time."""
    data = yaml.safe_load((RECIPES / recipe).read_text())
    for stage in data.values():
        for group in stage.values():
            block = group.get("AdaDSFModifier") if isinstance(group, dict) else None
            if block:
                block["align_steps"] = min(block.get("align_steps", 0), 2)
                if block.get("skip_path_rank"):
                    block["skip_path_rank"] = 8  # below the hidden size (32)
    return yaml.safe_dump(data, sort_keys=False)  # stage order matters


@pytest.mark.parametrize(
    "recipe",
    ["adadsf.yaml", "adadsf_w8a8.yaml", "adadsf_w4a16.yaml", "adadsf_paper.yaml"],
)
def test_the_returned_model_runs_and_equals_its_saved_checkpoint(tmp_path, recipe):
    path = save_tiny_model("llama", str(tmp_path / "llama"), num_layers=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = tmp_path / "out"
    model = oneshot(model=model, dataset=token_dataset(8, 16), recipe=_tiny(recipe),
                    num_calibration_samples=8, max_seq_length=16,
                    output_dir=str(out))  # fmt: skip
    ids = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        in_process = model(ids).logits
        reloaded = adadsf_modifier.from_pretrained(out)(ids).logits
    torch.testing.assert_close(in_process, reloaded, rtol=0, atol=1e-5)
