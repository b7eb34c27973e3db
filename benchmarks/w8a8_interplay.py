"""Does SmoothQuant still fit between AdaDSF and GPTQ W8A8? Held-out perplexity per
pipeline.

    OMP_NUM_THREADS=1 python benchmarks/w8a8_interplay.py                 # all rows, ~6
    min CPU OMP_NUM_THREADS=1 python benchmarks/w8a8_interplay.py --rows recipe+sq

Rows: ``dense`` (no oneshot), ``recipe`` (``recipes/adadsf_w8a8.yaml``'s GPTQ W8A8
stage after the AdaDSF block it shipped when this was measured, ``MEASURED_ADADSF``:
the paper's AdaDSF at retention 0.9 with layer 0 dense and a 20-step router alignment;
the recipe now ships the study's variant, whose alignment alone takes ~45 min) and
``recipe+sq`` (the same with ``SmoothQuantModifier`` inserted before GPTQ).
Calibration: 8 x 128 tokens of the calibration split; perplexity: the first 1,024 tokens
of the test split.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "adadsf_w8a8.yaml"
MEASURED_ADADSF = {  # the recipe's AdaDSF block until 2026-12-02 (measurements §2)
    "retention": 0.9,
    "temperature": 0.05,
    "beta": 10.0,
    "allocation": "similarity",
    "ignore": ["re:.*layers\\.0$"],
    "router_hidden_size": 64,
    "seed": 0,
    "align_steps": 20,
    "align_lr": 1.0e-3,
    "align_batch_size": 4,
    "align_seq_len": 256,
    "align_loss": "kl_hidden",
    "align_trainable": "routers",
}


def build_recipe(smoothquant: float | None) -> str:
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["sparsity_stage"]["sparsity_modifiers"]["AdaDSFModifier"] = MEASURED_ADADSF
    if smoothquant is not None:
        stage = recipe["quantization_stage"]
        stage["quantization_modifiers"] = {
            "SmoothQuantModifier": {"smoothing_strength": smoothquant},
            **stage["quantization_modifiers"],
        }
    return yaml.safe_dump(recipe, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows",
        nargs="+",
        default=["dense", "recipe", "recipe+sq"],
        choices=["dense", "recipe", "recipe+sq"],
    )
    p.add_argument("--smoothing-strength", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    from compressed_tensors.offload import remove_dispatch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import adadsf_modifier  # noqa: F401  (registers the modifier for the YAML recipe)
    from adadsf_modifier.evaluation import (
        calibration_dataset,
        load_text_splits,
        resolve_model,
    )
    from adadsf_modifier.evaluation.perplexity import perplexity

    torch.set_num_threads(args.threads)
    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    text = "\n\n".join(load_text_splits()["test"]["text"])
    results = {}
    for row in args.rows:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if row != "dense":
            recipe = build_recipe(
                args.smoothing_strength if row == "recipe+sq" else None
            )
            model = oneshot(
                model=model, dataset=calibration_dataset(tok, 8, 128), recipe=recipe
            )
            remove_dispatch(model, onload_tensors=True)
        res = perplexity(
            model.eval(),
            tok,
            text,
            max_length=512,
            stride=512,
            max_tokens=1024,
            show_progress=False,
        )
        results[row] = res.ppl
        print(f"{row}: PPL {res.ppl:.2f} over {res.tokens} tokens", flush=True)
    print("\n| pipeline | PPL |\n|---|---|")
    for row, ppl in results.items():
        print(f"| {row} | {ppl:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
