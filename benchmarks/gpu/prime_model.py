"""Rebuild the embedded model's weights on a machine that has the GGUF but no time to
spare: the payload carries the converted folder without ``model.safetensors`` (the
tokenizer conversion, ~45 s, was done where the payload was built); this loads only the
weights from the GGUF, exactly as ``adadsf_modifier.evaluation.embedded_model`` does,
and writes them into that folder.

    python benchmarks/gpu/prime_model.py MODEL.gguf CACHE/smollm2-135m-instruct
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main(gguf: str, folder: str) -> None:
    src = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        Path(tmp, "model.safetensors").rename(Path(folder, "model.safetensors"))
    from adadsf_modifier.evaluation import embedded_model_path

    path = embedded_model_path()  # checks the folder; would rebuild it if broken
    print(f"embedded model ready at {path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
