"""FTP + GPTQ W8A8 (recipes/ftp_w8a8.yaml) on a tiny Llama: oneshot -> save -> load_ftp.

The shipped recipe with its search and training shortened (CPU time only). GPTQ must
quantize the decoder's Linear layers and leave every router tensor in full precision,
and the reloaded compressed model must reproduce the in-memory one's logits exactly
(same int8 weights, same deterministic kernels, bit-identical routers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llmcompressor import oneshot  # noqa: E402
from tiny_models import save_tiny_model, token_dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import adadsf_modifier  # noqa: E402, F401
from adadsf_modifier import routed_layers  # noqa: E402
from adadsf_modifier.ftp import FTPLayerRouter, load_ftp  # noqa: E402

pytestmark = pytest.mark.integration

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ftp_w8a8.yaml"


def test_ftp_then_gptq_w8a8_saves_and_reloads_exactly(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "dense"), num_layers=4)
    data = yaml.safe_load(RECIPE.read_text())
    body = data["sparsity_stage"]["sparsity_modifiers"]["FTPModifier"]
    body.update(validation_batches=2, ga_population=4, ga_generations=1, train_steps=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = tmp_path / "out"
    oneshot(model=model, recipe=yaml.safe_dump(data), dataset=token_dataset(8, 16),
            num_calibration_samples=8, max_seq_length=16,
            output_dir=str(out))  # fmt: skip
    layers = routed_layers(model)
    assert len(layers) == 3 and all(
        isinstance(m.router, FTPLayerRouter) for m in layers
    )
    schemes = {
        n: getattr(m, "quantization_scheme", None) for n, m in model.named_modules()
    }
    assert schemes["model.layers.1.self_attn.q_proj"] is not None
    assert all(s is None for n, s in schemes.items() if ".router" in n)
    again = load_ftp(out, dtype=torch.float32)
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = (m(input_ids=ids, use_cache=False).logits for m in (model, again))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
