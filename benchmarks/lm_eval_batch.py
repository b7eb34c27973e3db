"""lm-eval on this CPU: one request per forward against batches, same model, same
examples (``lab/NOTEBOOK.md`` §13; why the study's CPU default is 8).

    OMP_NUM_THREADS=1 python benchmarks/lm_eval_batch.py [--checkpoint DIR]

Without ``--checkpoint`` the embedded dense SmolLM2; with one, that routed checkpoint
in causal routing (what ``generate()`` uses). bfloat16, as the studies run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from adadsf_modifier.checkpoint import from_pretrained
from adadsf_modifier.evaluation import resolve_model
from adadsf_modifier.evaluation.lm_eval_tasks import evaluate_tasks
from adadsf_modifier.routing import set_routing_mode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--tasks", default="hellaswag,piqa")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--batch-sizes", default="1,8")
    a = p.parse_args(argv)
    path = resolve_model(None)
    if a.checkpoint:
        model = from_pretrained(a.checkpoint, dtype=torch.bfloat16)
        set_routing_mode(model, "causal")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    for bs in (int(b) for b in a.batch_sizes.split(",")):
        t0 = time.perf_counter()
        res = evaluate_tasks(
            model, tok, a.tasks.split(","), limit=a.limit, batch_size=bs
        )
        acc = {t: r["acc"] for t, r in res.items()}
        print(f"batch {bs}: {time.perf_counter() - t0:.1f} s, acc {acc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
