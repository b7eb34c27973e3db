"""Helpers shared by the benchmark scripts (not part of the installed package)."""

from __future__ import annotations

import atexit
import math
import random
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def build_routed_checkpoint(
    model_path: str,
    output_dir: str,
    retention: float = 0.8,
    calibration_samples: int = 16,
    seq_len: int = 256,
    dtype: torch.dtype = torch.float32,
    fields: dict[str, Any] | None = None,
) -> str:
    """AdaDSF at ``retention`` (no alignment) on ``model_path``, saved to
    ``output_dir``; ``fields``: further ``AdaDSFModifier`` fields (a variant such as
    ``skip_path: ridge``), checked by the modifier itself.

    What the speed benchmarks time: speed depends on how many tokens run each layer, not
    on how well the routers were trained.
    """
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.evaluation import calibration_dataset

    tok = AutoTokenizer.from_pretrained(model_path)
    oneshot(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype),
        dataset=calibration_dataset(tok, calibration_samples, seq_len),
        recipe=[AdaDSFModifier(retention=retention, **(fields or {}))],
        output_dir=output_dir,
    )
    return output_dir


def temporary_routed_checkpoint(
    model_path: str, prefix: str, retention: float, fields: dict[str, Any] | None = None
) -> str:
    """:func:`build_routed_checkpoint` (16 calibration samples) into a temporary
    directory that is removed when the process exits."""
    checkpoint = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, checkpoint, ignore_errors=True)
    return build_routed_checkpoint(model_path, checkpoint, retention, 16, fields=fields)


def variant_fields() -> dict[str, Any]:
    """The quality study's variant as the study builds it: the method's own fields
    and the study's default temperature and dense layers."""
    from adadsf_lab.study.methods import METHODS
    from adadsf_lab.study.settings import StudySettings

    defaults = StudySettings()
    return {
        **METHODS["adadsf_ridge_kv_err"].fields,
        "temperature": defaults.temperature,
        "ignore": list(defaults.ignore),
    }


def interleaved(
    fns: dict[str, Callable[[], float]],
    repeats: int,
    rng: random.Random | None = None,
) -> dict[str, float]:
    """Median seconds of each of ``fns``, all of them run ``repeats`` times, in a
    shuffled order each time (``rng``, default seeded 0), so drift hits every arm."""
    rng = rng or random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        order = list(fns)
        rng.shuffle(order)
        for k in order:
            times[k].append(fns[k]())
    return {k: statistics.median(v) for k, v in times.items()}


@contextmanager
def thresholds_at(model: torch.nn.Module, value: float | None) -> Iterator[None]:
    """Every routed layer's causal threshold set to ``value`` (``None``: unchanged;
    ``-inf``: every token runs, ``+inf``: only forced ones do), restored after."""
    from adadsf_modifier.routing import routed_layers

    layers = routed_layers(model)
    saved = [layer.causal_threshold for layer in layers]
    try:
        if value is not None:
            for layer in layers:
                layer.causal_threshold = value
        yield
    finally:
        for layer, threshold in zip(layers, saved):
            layer.causal_threshold = threshold


@torch.inference_mode()
def row_perplexity(model: torch.nn.Module, rows: torch.Tensor, batch: int) -> float:
    """Teacher-forced perplexity over every predicted token of ``rows [n, seq]``, in
    forwards of ``batch`` rows (each row a sequence of its own, no cache)."""
    nll, count = 0.0, 0
    for start in range(0, rows.shape[0], batch):
        ids = rows[start : start + batch]
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                ids[:, 1:].reshape(-1),
                reduction="sum",
            )
        )
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


def load_routed(checkpoint: str) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, model)`` of a routed checkpoint folder, the model in float32 and
    eval mode (the quality probes' precision)."""
    from transformers import AutoTokenizer

    import adadsf_modifier

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = adadsf_modifier.from_pretrained(checkpoint, dtype=torch.float32)
    return tokenizer, model.eval()


@contextmanager
def retention_ratios(
    model: torch.nn.Module, change: Callable[[float], float] | None
) -> Iterator[None]:
    """Every routed layer's retention ratio ``r`` set to ``change(r)`` (``None``:
    unchanged), restored after."""
    from adadsf_modifier.routing import routed_layers

    layers = routed_layers(model)
    saved = [layer.retention_ratio for layer in layers]
    try:
        if change is not None:
            for layer, ratio in zip(layers, saved):
                layer.retention_ratio = change(ratio)
        yield
    finally:
        for layer, ratio in zip(layers, saved):
            layer.retention_ratio = ratio
