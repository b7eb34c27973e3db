"""What building the shipped recipe's routed model costs, as a multiple of one dense
forward pass over the same calibration set, stage by stage.

    python benchmarks/compress_cost.py                          # embedded SmolLM2
    python benchmarks/compress_cost.py --shape llama-3.2-1b --samples 16

The recipe is ``recipes/adadsf.yaml`` with its alignment switched off (the issue's
"compress cost": calibration, allocation, router fits, skip-path fits, thresholds). The
dense reference is the plug-in's own calibration driver (``run_calibration_batches``,
the base model, batch 1, no KV cache) over exactly the rows ``oneshot`` then calibrates
on, run twice before the compression (the faster run counts, so a cold first pass does
not flatter the ratio). Stage times are the modifier's own (``stage_seconds``).

``--shape llama-3.2-1b`` builds a model of that shape with random weights (the
embedded SmolLM2 tokenizer feeds it; its ids fit the larger vocabulary): the passes
cost what they cost at that width whatever the weights, although random routers rank
nothing. Ratios only: absolute times on a shared CPU mean little.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.evaluation import calibration_dataset
from adadsf_modifier.evaluation.embedded_model import embedded_model_path
from adadsf_modifier.utils import run_calibration_batches

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "adadsf.yaml"

LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)  # fmt: skip


def shipped_fields() -> dict:
    """The shipped recipe's AdaDSFModifier fields, alignment off."""
    stages = yaml.safe_load(RECIPE.read_text())
    fields = stages["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"]
    return {**fields, "align_steps": 0}


def load_model(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    if shape == "smollm2-135m":
        return AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=dtype)
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # oneshot re-reads the config from the model's name_or_path: give it a folder
    folder = tempfile.mkdtemp(prefix="llama-1b-shape-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config.save_pretrained(folder)
    model.config.name_or_path = folder
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["smollm2-135m", "llama-3.2-1b"],
                   default="smollm2-135m")  # fmt: skip
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    data = calibration_dataset(tok, args.samples, args.seq_len, seed=0)
    model = load_model(args.shape, dtype)
    rows = [
        {k: torch.tensor([row[k]]) for k in ("input_ids", "attention_mask")}
        for row in data
    ]
    dense = []
    for _ in range(2):
        start = time.perf_counter()
        run_calibration_batches(model.model, rows, desc="dense forward")
        dense.append(time.perf_counter() - start)
    forward = min(dense)

    modifier = AdaDSFModifier(**shipped_fields())
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=tok,
        dataset=data,
        recipe=modifier,
        num_calibration_samples=args.samples,
        max_seq_length=args.seq_len,
    )
    total = time.perf_counter() - start

    print(
        f"\n{args.shape}, {args.samples} x {args.seq_len} calibration tokens, "
        f"{args.dtype}, {args.threads} threads; dense forward {forward:.1f} s "
        f"(runs: {', '.join(f'{d:.1f}' for d in dense)})\n"
    )
    print("| stage | seconds | x dense forward |")
    print("|---|---:|---:|")
    for stage, secs in modifier.stage_seconds.items():
        print(f"| {stage} | {secs:.1f} | {secs / forward:.2f} |")
    staged = sum(modifier.stage_seconds.values())
    print(f"| all stages | {staged:.1f} | {staged / forward:.2f} |")
    print(f"| oneshot, end to end | {total:.1f} | {total / forward:.2f} |")


if __name__ == "__main__":
    main()
