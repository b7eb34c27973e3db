"""Tiny random models of every supported architecture, built from configs (no hub
access)."""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 128
ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt_neox")


def tiny_config(arch: str, num_layers: int = 4, attn: str = "sdpa"):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(num_key_value_heads=2, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=2, **common)
    elif arch == "mistral":
        cfg = MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.5, **common)
    else:
        raise ValueError(arch)
    cfg._attn_implementation = attn
    cfg.pad_token_id = 0
    cfg.eos_token_id = 1
    cfg.bos_token_id = 2
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
