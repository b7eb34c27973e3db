"""Every shipped recipe on tiny config-built models, saved and reloaded: the logits and
tokens it gives, written to a folder, so that two versions of the code can be compared
bit for bit (a refactor that must not move a number).

    # before the change (a worktree of the old commit first on the path)
    PYTHONPATH=/tmp/base python benchmarks/recipe_logits.py --out /tmp/logits/base
    # after it
    python benchmarks/recipe_logits.py --out /tmp/logits/new
    python benchmarks/recipe_logits.py --compare /tmp/logits/base /tmp/logits/new

Per architecture (Llama, GPT-NeoX, Qwen2) and recipe (FTP's only on architectures it
supports), ``oneshot`` runs the recipe with its expensive stages cut to seconds (3
alignment or router-training steps, a rank-8 skip path, a small genetic search) on 16
random rows of 32 tokens, saves the model and reloads it with
``adadsf_modifier.from_pretrained``. Recorded: eval-mode logits of a batch with a
left-padded row and of one row alone, greedy ``generate()`` with and without the KV
cache, and the training-mode logits (top-k routing). ``--compare`` exits 1 when any
tensor differs. Run with ``OMP_NUM_THREADS=1`` on both sides: thread count changes the
reduction order of some kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: config-built models, no hub

ARCHITECTURES = ("llama", "gpt_neox", "qwen2")
FTP_ARCHITECTURES = ("llama", "qwen2")  # FTP's key probe needs q/k projections


def _cheap(data: dict) -> dict:
    """The recipe with its expensive stages cut to seconds, everything else as it
    ships."""
    mods = data["sparsity_stage"]["sparsity_modifiers"]
    if "AdaDSFModifier" in mods:
        block = mods["AdaDSFModifier"]
        if block.get("skip_path") == "ridge":
            block["skip_path_rank"] = 8
        if block.get("align_steps"):
            block.update(align_steps=3, align_batch_size=2, align_seq_len=32)
        block["router_init_tokens"] = 256
    else:
        block = mods["FTPModifier"]
        block.update(train_steps=3, ga_population=4, ga_generations=2)
        block.update(validation_batches=2)
        if "guide_steps" in block:
            block["guide_steps"] = 1
    return data


def record(out: Path, architectures: list[str], recipes: list[str]) -> None:
    from llmcompressor import oneshot
    from tiny_models import save_tiny_model, token_dataset
    from transformers import AutoModelForCausalLM

    import adadsf_modifier

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(4, 128, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row
    for arch in architectures:
        for name in recipes:
            if name.startswith("ftp") and arch not in FTP_ARCHITECTURES:
                continue
            torch.manual_seed(0)
            tmp = tempfile.mkdtemp()
            path = save_tiny_model(arch, f"{tmp}/dense", num_layers=4)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            data = _cheap(yaml.safe_load((ROOT / "recipes" / name).read_text()))
            model = oneshot(
                model=model,
                dataset=token_dataset(16, 32),
                recipe=yaml.safe_dump(data, sort_keys=False),  # stage order matters
                num_calibration_samples=16,
                max_seq_length=32,
            )
            model.save_pretrained(f"{tmp}/routed")
            loaded = adadsf_modifier.from_pretrained(
                f"{tmp}/routed", dtype=torch.float32
            )
            loaded.eval()
            with torch.no_grad():
                tensors = {
                    "logits": loaded(ids, attention_mask=mask).logits,
                    "logits_one_row": loaded(ids[:1]).logits,
                    "generate": loaded.generate(
                        ids[:1, :10], max_new_tokens=8, do_sample=False
                    ),
                    "generate_no_cache": loaded.generate(
                        ids[:1, :10], max_new_tokens=8, do_sample=False, use_cache=False
                    ),
                }
                loaded.train()
                tensors["train_logits"] = loaded(ids[:1]).logits
            torch.save(tensors, out / f"{arch}_{Path(name).stem}.pt")
            print(f"{arch} {name}: recorded", flush=True)


def compare(a: Path, b: Path) -> int:
    """Number of tensors (and files) that differ between two recordings."""
    bad = 0
    for f in sorted(a.glob("*.pt")):
        other = b / f.name
        if not other.exists():
            print(f"{f.name}: missing in {b}")
            bad += 1
            continue
        x, y = torch.load(f), torch.load(other)
        for k in x:
            if not torch.equal(x[k], y[k]):
                bad += 1
                gap = (
                    (x[k].float() - y[k].float()).abs().max().item()
                    if x[k].shape == y[k].shape
                    else "shape"
                )
                print(f"{f.name} {k}: differs (max gap {gap})")
    print(f"{len(list(a.glob('*.pt')))} recordings compared, {bad} differences")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder to record into")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    p.add_argument("--architectures", default=",".join(ARCHITECTURES))
    p.add_argument(
        "--recipes",
        default=",".join(sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))),
    )
    args = p.parse_args(argv)
    if args.compare:
        return 1 if compare(*args.compare) else 0
    if args.out is None:
        p.error("give --out (to record) or --compare A B")
    record(args.out, args.architectures.split(","), args.recipes.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
