"""One model's evaluation record: perplexity, lm-eval accuracies, normalized FLOPs
(``adadsf eval``; dense and sparse measured by the same code on the same text)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from adadsf_modifier.checkpoint import checkpoint_sidecar, from_pretrained
from adadsf_modifier.constraints import InputError, NonNegativeFloat, PositiveFloat
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.evaluation.embedded_model import resolve_model
from adadsf_modifier.evaluation.perplexity import perplexity, token_stream
from adadsf_modifier.evaluation.text_splits import load_text_splits
from adadsf_modifier.flops import stream_flops
from adadsf_modifier.routing import routed_layers, routing_modes_of, set_routing_mode

__all__ = ["EvalRecord", "load_for_eval", "evaluate_model"]


@dataclass
class EvalRecord:
    label: str
    model: str
    routed: bool
    routing_mode: str | None
    # what the perplexity and FLOPs read: the embedded test split, or the user's files
    text: str = "test split"
    # the annotations check a record read back from disk (``adadsf report``)
    ppl: PositiveFloat | None = None
    ppl_tokens: int | None = None
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    normalized_flops: PositiveFloat = 1.0
    normalized_flops_with_lm_head: PositiveFloat = 1.0
    flops_tokens: int = 0
    # the routed layers' kept share and its target (evaluation.budget); None if dense
    kept_fraction: NonNegativeFloat | None = None
    retention_target: NonNegativeFloat | None = None
    seconds: NonNegativeFloat = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_for_eval(
    name_or_path: str | None, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Any, bool]:
    """``(model, tokenizer, routed)``: checkpoints of either kind this package writes
    (AdaDSF's or FTP's) reload routed, anything else dense."""
    path = resolve_model(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    routed = checkpoint_sidecar(path) is not None
    load = from_pretrained if routed else AutoModelForCausalLM.from_pretrained
    return load(path, dtype=dtype).eval(), tokenizer, routed


def evaluate_model(
    model: nn.Module,
    tokenizer: Any,
    label: str,
    model_name: str = "",
    ppl: bool = True,
    ppl_max_tokens: int | None = 16384,
    ppl_max_length: int = 512,
    ppl_stride: int = 256,
    tasks: tuple[str, ...] | list[str] = (),
    limit: int | None = None,
    routing_mode: str | None = None,
    flops_seq_len: int = 512,
    texts: dict[str, str] | None = None,
) -> EvalRecord:
    """Perplexity on the *test* split (or on ``texts``, ``{name: text}``, joined as
    the split's documents are), lm-eval ``tasks``, and normalized FLOPs.

    ``routing_mode=None`` keeps the layers' modes (a checkpoint's saved ones). FLOPs
    are counted on the perplexity's tokens (the first ``ppl_max_tokens``, in rows of
    ``flops_seq_len``), as the model routes them: causal routing's kept share depends
    on the text, so a few rows could miss by points. That costs one forward over those
    tokens, also with ``ppl=False``.
    """
    if ppl_max_tokens is not None and ppl_max_tokens < 2:
        raise ValueError(
            f"ppl_max_tokens must be at least 2 (or None), got {ppl_max_tokens}"
        )
    t0 = time.perf_counter()
    routed = bool(routed_layers(model))
    if routed and routing_mode is not None:
        set_routing_mode(model, routing_mode)
    model.eval()
    record = EvalRecord(
        label=label,
        model=model_name,
        routed=routed,
        routing_mode=routing_modes_of(model) if routed else None,
    )
    if texts:
        record.text = ", ".join(texts)
        test_ids = token_stream(tokenizer, list(texts.values()), None)
    else:
        test_ids = token_stream(tokenizer, load_text_splits()["test"]["text"], None)
    test_ids = test_ids[:ppl_max_tokens]
    if test_ids.numel() < 2:
        raise InputError(
            f"{record.text} holds {test_ids.numel()} token(s): perplexity needs at "
            "least 2"
        )
    if ppl:
        res = perplexity(
            model, None, None, ppl_max_length, ppl_stride, input_ids=test_ids
        )
        record.ppl, record.ppl_tokens = float(res.ppl), int(res.tokens)
        logger.info(
            f"{label}: perplexity {record.ppl:.3f} over {record.ppl_tokens} tokens of "
            f"{record.text}"
        )
    if tasks:
        from adadsf_modifier.evaluation.lm_eval_tasks import evaluate_tasks

        record.tasks = evaluate_tasks(model, tokenizer, list(tasks), limit=limit)
    report = stream_flops(model, test_ids, flops_seq_len)
    record.normalized_flops = float(report.normalized)
    record.normalized_flops_with_lm_head = float(report.normalized_with_lm_head)
    record.flops_tokens = int(sum(report.seq_lens))
    share = KeptShare(model)
    share.add(report)
    record.kept_fraction, record.retention_target = share.fraction, share.target
    share.warn(f"{label} on {record.text}")
    record.seconds = time.perf_counter() - t0
    return record
