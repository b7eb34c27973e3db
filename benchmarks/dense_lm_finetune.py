"""The control a routed model trained on the LM loss needs: the *dense* model fine-tuned
with the same loss on the same rows (the study's alignment rows: ``calibration_dataset``
with the run's seed, one pass of ``steps x batch`` rows), then its validation and test
perplexity as the study measures them. The calibration and test texts are disjoint
documents of one corpus, so an LM-loss fine-tune adapts any model to that corpus: a
routed model's test PPL under dense's then says little about depth sparsity unless
dense fine-tuned alike is beside it (docs/measurements.md §16.1).

    OMP_NUM_THREADS=2 python benchmarks/dense_lm_finetune.py --steps 50 --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from adadsf_modifier.evaluation import calibration_dataset
from adadsf_modifier.evaluation.embedded_model import resolve_model
from adadsf_modifier.study.measure import TokenStreams, measure_perplexity
from adadsf_modifier.study.settings import StudySettings


def main() -> None:
    study = StudySettings()  # the study's alignment rows and perplexity windows
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=study.align_batch_size)
    p.add_argument("--seq-len", type=int, default=study.align_seq_len)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    rows = calibration_dataset(tok, a.steps * a.batch_size, a.seq_len, seed=a.seed)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    t0, losses = time.perf_counter(), []
    for step in tqdm(range(a.steps), desc="dense LM fine-tune"):
        batch = rows[step * a.batch_size : (step + 1) * a.batch_size]
        ids = torch.tensor(batch["input_ids"])
        mask = torch.tensor(batch["attention_mask"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    model = model.to(torch.bfloat16).eval()
    streams = TokenStreams(tok)
    out = {"steps": a.steps, "lr": a.lr, "seed": a.seed, "train_seconds": seconds,
           "loss_first": losses[0], "loss_last": losses[-1]}  # fmt: skip
    for split, n in (("validation", study.ppl_val_tokens), ("test", study.ppl_tokens)):
        stream = streams.get(split, n)
        res = measure_perplexity(
            model, stream, study.ppl_max_length, study.ppl_stride, "causal", 1
        )
        out[f"ppl_{split}"] = res["ppl"]
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
