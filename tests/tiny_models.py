"""Tiny random models of every supported architecture, built from configs (no hub
access)."""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 128
ARCHITECTURES = (
    "llama",
    "qwen2",
    "mistral",
    "gpt_neox",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
)
#: one architecture per kind of decoder layer (Qwen2's and Mistral's are Llama's)
DISTINCT_ARCHITECTURES = tuple(
    a for a in ARCHITECTURES if a not in ("qwen2", "mistral")
)


def tiny_config(arch: str, num_layers: int = 4, attn: str = "sdpa"):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if arch == "llama":
        cfg = LlamaConfig(num_key_value_heads=2, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=2, **common)
    elif arch == "mistral":
        cfg = MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.5, **common)
    elif arch == "qwen3":  # per-head q/k norms
        cfg = Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    elif arch == "olmo2":  # post-norm; q/k norms over all heads
        cfg = Olmo2Config(num_key_value_heads=2, **common)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj, partial rotary
        cfg = Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5, **common)
    elif arch in ("gemma2", "gemma3_text"):
        # four norms per layer, alternating 4-key windows (the rows tested are
        # longer), soft-capped logits (Gemma 2), q/k norms (Gemma 3)
        config_class = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        cfg = config_class(
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=[
                ("sliding_attention", "full_attention")[i % 2]
                for i in range(num_layers)
            ],  # fmt: skip
            **common,
        )
    else:
        raise ValueError(arch)
    cfg._attn_implementation = attn
    return cfg


def tiny_model(arch: str, num_layers: int = 4, seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, num_layers, attn), dtype=torch.float32
    )
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a fixed vocabulary: enough for oneshot's processor
    checks."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3}
    for i in range(4, VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
    )


def save_tiny_model(arch: str, path: str, num_layers: int = 4, seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    tiny_model(arch, num_layers, seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def token_dataset(num_samples: int = 8, seq_len: int = 16, seed: int = 0) -> Dataset:
    """Pre-tokenised calibration rows (random ids, no padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (num_samples, seq_len), generator=g)
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
