"""Measurements of one model for the study: perplexity, FLOPs, lm-eval tasks, speed.

Every number comes from the project's public evaluation code; this module only decides
which text each measurement sees: the validation split for choosing hyper-parameters,
the test split for reported results (``load_text_splits``; both disjoint from the
calibration split every run calibrates and trains on).
"""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from typing import Any

import torch
from loguru import logger
from torch import nn

# Project APIs used here (one place, so a module move needs one edit).
from adadsf_modifier.evaluation import load_text_splits, perplexity
from adadsf_modifier.evaluation.lm_eval_tasks import evaluate_tasks
from adadsf_modifier.evaluation.speed import load_pair, run_speed_benchmark
from adadsf_modifier.flops import stream_flops
from adadsf_modifier.routing import routed_layers, routing_mode

__all__ = [
    "TokenStreams",
    "measure_flops",
    "measure_perplexity",
    "measure_speed",
    "measure_tasks",
    "task_mean",
]

_MARGIN = 64  # extra tokens so the cut never falls on a document boundary's merge


class TokenStreams:
    """Token streams of the validation and test splits, tokenized once per study.

    The stream of a split is ``"\\n\\n".join(documents)`` tokenized (the text
    ``perplexity`` would build), cut to the tokens needed: only as many documents as
    needed are tokenized.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._streams: dict[str, tuple[torch.Tensor, bool]] = {}

    def get(self, split: str, tokens: int) -> torch.Tensor:
        """The first ``tokens`` tokens of ``split`` (fewer if the split is shorter)."""
        have = self._streams.get(split)
        if have is not None and (have[0].numel() >= tokens or have[1]):
            return have[0][:tokens]
        docs = load_text_splits()[split]["text"]
        take = 8
        while True:
            text = "\n\n".join(docs[:take])
            ids = self.tokenizer(text, verbose=False)["input_ids"]
            if len(ids) >= tokens + _MARGIN or take >= len(docs):
                break
            take *= 2
        stream = torch.tensor(ids, dtype=torch.long)
        self._streams[split] = (stream, take >= len(docs))
        if stream.numel() < tokens:
            logger.warning(
                f"{split} split has only {stream.numel()} tokens, {tokens} requested"
            )
        return stream[:tokens]


def _in_mode(model: nn.Module, mode: str):
    """Routing ``mode`` for a routed model; nothing to switch for a dense one."""
    return routing_mode(model, mode) if routed_layers(model) else nullcontext()


def measure_perplexity(
    model: nn.Module,
    stream: torch.Tensor,
    max_length: int,
    stride: int,
    mode: str,
    batch_size: int = 1,
) -> dict[str, float | int]:
    """Sliding-window perplexity in routing ``mode`` (``causal``: what ``generate``
    uses; ``topk``: per-sequence top-K as in training)."""
    with _in_mode(model, mode):
        res = perplexity(
            model,
            None,
            None,
            max_length=max_length,
            stride=stride,
            input_ids=stream,
            show_progress=False,
            batch_size=batch_size,
        )
    return {"ppl": float(res.ppl), "tokens": int(res.tokens)}


def measure_flops(
    model: nn.Module, stream: torch.Tensor, batch: int, seq_len: int, mode: str
) -> dict[str, float | int]:
    """Normalized FLOPs counted from the tokens that actually ran each layer on the
    whole test ``stream`` (the perplexity's tokens), in consecutive rows of ``seq_len``
    tokens, ``batch`` rows per forward (decoder stack incl. routers; and with the
    lm_head on both sides)."""
    with _in_mode(model, mode):
        report = stream_flops(model, stream, seq_len, batch)
    return {
        "normalized": float(report.normalized),
        "normalized_with_lm_head": float(report.normalized_with_lm_head),
        "tokens": int(sum(report.seq_lens)),
    }


def measure_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[str],
    limit: int | None,
    batch_size: int,
) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """lm-eval zero-shot accuracy per task under causal routing: ``(acc, n,
    acc_stderr)``."""
    if not tasks:
        return {}, {}, {}
    with _in_mode(model, "causal"):
        out = evaluate_tasks(
            model, tokenizer, tasks, limit=limit, batch_size=batch_size
        )
    acc = {t: float(r["acc"]) for t, r in out.items()}
    n = {t: int(r["n"]) for t, r in out.items()}
    se = {t: r.get("acc_stderr") for t, r in out.items()}
    return acc, n, se


def task_mean(acc: dict[str, float]) -> float | None:
    return sum(acc.values()) / len(acc) if acc else None


def measure_speed(
    model: nn.Module,
    tokenizer: Any,
    stream: torch.Tensor,
    cfg: dict[str, Any],
    device: str,
    scratch: str | None = None,
) -> dict[str, Any]:
    """Prefill and decode speedup of the routed model against its dense twin (same
    checkpoint, routing removed; :func:`~adadsf_modifier.evaluation.speed.load_pair`).

    The model is saved to a temporary folder first: both twins are then loaded the
    same way, which is what makes CPU timings comparable (see ``load_pair``).
    """
    with tempfile.TemporaryDirectory(prefix="adadsf_study_speed_", dir=scratch) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        dense, routed = load_pair(
            tmp, dtype=next(model.parameters()).dtype, device=device
        )
        results = run_speed_benchmark(
            dense,
            routed,
            stream,
            seq_lens=(cfg["seq_len"],),
            batch_sizes=tuple(cfg["batch_sizes"]),
            decode_prompt=cfg["decode_prompt"],
            decode_tokens=cfg["decode_tokens"],
            repeats=cfg["repeats"],
        )
        del dense, routed
    cells = [r.as_dict() for r in results]
    out: dict[str, Any] = {"cells": cells}
    for r in results:
        out[f"{r.kind}_speedup_b{r.batch_size}"] = float(r.speedup)
        out[f"{r.kind}_flops_ideal_b{r.batch_size}"] = float(r.flops_ideal)
    return out
