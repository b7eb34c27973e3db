"""The embedded SmolLM2 is a real trained model and the offline text gives sane
perplexity.

The first run converts the GGUF into the user cache (~30-60 s); later runs load it in ~1
s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from adadsf_modifier.evaluation import (
    embedded_model_path,
    load_text_splits,
    perplexity,
    resolve_model,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """On a shared 2-core machine one intra-op thread is several times faster than two
    (measured: 18 s vs 112 s for this perplexity run under load); on an idle machine it
    costs little."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_path() -> str:
    return embedded_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def test_embedded_folder_is_a_plain_hf_model(model_path, model, tokenizer):
    folder = Path(model_path)
    assert (folder / "config.json").is_file() and (
        folder / "model.safetensors"
    ).is_file()
    assert resolve_model(None) == resolve_model("smollm2") == model_path
    assert embedded_model_path() == model_path  # cached: no second conversion
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert (
        tokenizer.eos_token == "<|im_end|>"
        and tokenizer.eos_token_id == model.config.eos_token_id
    )


def test_greedy_generation_knows_paris(model, tokenizer):
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(
        out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True
    )
    assert "Paris" in completion, completion


def test_perplexity_on_test_split_is_sane(model, tokenizer):
    texts = load_text_splits()["test"]["text"]
    result = perplexity(
        model, tokenizer, texts, max_length=512, stride=256, max_tokens=2048
    )
    assert result.tokens == 2047
    assert 5.0 < result.ppl < 100.0, result
