"""One study run end to end: load the dense model, compress it as the run's method says
(``oneshot`` with ``AdaDSFModifier`` [+ GPTQ]), measure it, return a JSON-able record.

A run is a pure function of its configuration (:class:`~.spec.RunSpec`): every random
choice (calibration text order, router initialisation, random allocation, training
order, llm-compressor's calibration shuffle) is seeded from the run's seed.
"""

from __future__ import annotations

import gc
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from adadsf_lab.study.arms import without_retired
from adadsf_lab.study.measure import (
    TokenStreams,
    budget_sizes,
    keep_model,
    measure_budget_per_text,
    measure_flops,
    measure_other_texts,
    measure_perplexity,
    measure_speed,
    measure_tasks,
    routes_tokens,
    saved_model,
    task_mean,
)
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.spec import RunSpec

# Project APIs used here (one place, so a module move needs one edit).
from adadsf_modifier import AdaDSFModifier, FTPModifier
from adadsf_modifier.evaluation import calibration_dataset
from adadsf_modifier.routing import routed_layers

__all__ = ["RunEnv", "execute_run", "load_dense"]


@dataclass
class RunEnv:
    """What runs share at execution time (loaded once per study)."""

    model_path: str
    device: str
    tokenizer: Any
    streams: TokenStreams
    scratch: str | None = None
    #: where each computed routed run's checkpoint is kept (``None``: not kept), under
    #: ``<phase>/<method>/<run key>``: later questions about inference alone (another
    #: routing mode, another band) then reload it instead of training it again
    keep_models: str | None = None
    _data: dict = field(default_factory=dict)

    def calibration(self, samples: int, seq_len: int, seed: int) -> Any:
        """``calibration_dataset`` rows, built once per (size, seed) and shared by the
        runs that ask for the same rows (tokenizing is not free)."""
        key = (samples, seq_len, seed)
        if key not in self._data:
            self._data[key] = calibration_dataset(
                self.tokenizer, samples, seq_len, seed=seed
            )
        return self._data[key]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch's deps
        pass


def load_dense(env: RunEnv, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        env.model_path, dtype=getattr(torch, dtype)
    )
    return model.to(env.device).eval()


def _compress(model: torch.nn.Module, cfg: dict, env: RunEnv) -> AdaDSFModifier:
    from compressed_tensors.offload import remove_dispatch
    from llmcompressor import oneshot

    data = cfg["data"]
    tok = env.tokenizer
    calib = env.calibration(
        data["calib_samples"], data["calib_seq_len"], data["text_seed"]
    )
    align = None
    if data["align_rows"]:
        align = env.calibration(
            data["align_rows"], data["align_seq_len"], data["text_seed"]
        )
    if METHODS[cfg["method"]].modifier == "ftp":
        modifier = FTPModifier(**without_retired(cfg["modifier"], "ftp"))
    else:
        fields = without_retired(cfg["modifier"], "adadsf")
        modifier = AdaDSFModifier(**fields, align_dataset=align)
    recipe: list[Any] = [modifier]
    if cfg["quantization"]:
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe.append(GPTQModifier(**cfg["quantization"]))
    oneshot(
        model=model,
        processor=tok,
        dataset=calib,
        recipe=recipe,
        num_calibration_samples=data["calib_samples"],
        max_seq_length=data["calib_seq_len"],
        batch_size=data.get("calib_batch_size", 1),
    )
    # oneshot leaves compressed-tensors offload wrappers on every module: they slow
    # every call and make speed comparisons against a reloaded twin meaningless.
    remove_dispatch(model, onload_tensors=True)
    model.to(env.device).eval()
    return modifier


def _alignment_record(rep: Any) -> dict[str, Any]:
    """What an alignment (``AlignmentReport``) did, in the record's fields."""
    return {
        "align_seconds": float(rep.seconds),
        "align_peak_memory_mb": float(rep.peak_memory_mb),
        "align_memory_kind": rep.memory_kind,
        "align_loss_first": rep.first_loss,
        "align_loss_last": rep.last_loss,
        "align_steps_done": rep.steps,
    }


def _finetune_dense(model: torch.nn.Module, cfg: dict, env: RunEnv) -> dict[str, Any]:
    """A dense control: ``align_model`` (no teacher: the LM loss) over the alignment
    rows its routed counterpart trains on, every decoder layer outside ``ignore``
    training; what it did, in the record's alignment fields."""
    from adadsf_modifier.alignment import AlignmentConfig, align_model
    from adadsf_modifier.routing import decoder_layers
    from adadsf_modifier.targeting import targeted_layers

    fields = without_retired(cfg["finetune"], "finetune")
    ignore, seed = fields.pop("ignore"), fields.pop("seed")
    config = AlignmentConfig(**fields)  # LM loss only: align_model needs no teacher
    data = cfg["data"]
    rows = env.calibration(data["align_rows"], data["align_seq_len"], data["text_seed"])
    _, layers = decoder_layers(model)
    params = [
        p
        for _, _, layer in targeted_layers(layers, None, ignore, cfg["method"])
        for p in layer.parameters()
    ]
    rep = align_model(model, None, rows, config, params=params, seed=seed)
    return {
        "retention": 1.0,
        "align_tokens": data["align_rows"] * data["align_seq_len"],
        **_alignment_record(rep),
        "align_lr": config.align_lr,
        "align_layer_lr": config.align_layer_lr,
        "finetuned_parameters": rep.num_trainable,
    }


def _modifier_record(model: torch.nn.Module, mod: Any) -> dict[str, Any]:
    """What the modifier (AdaDSF or FTP) reports about the model it built."""
    out: dict[str, Any] = {
        "retention": mod.retention,
        "retention_ratios": mod.retention_ratios,
        "similarities": getattr(mod, "similarities", None),
        "num_layers": len(mod.retention_ratios),
        "num_routed": len(routed_layers(model)),
        "layers_kept": sum(1 for r in mod.retention_ratios if r > 0),
        # modules a quantization scheme was applied to (GPTQ's targets): a W8A8 arm
        # that quantized nothing would otherwise look like its base arm
        "quantized_modules": sum(
            getattr(m, "quantization_scheme", None) is not None for m in model.modules()
        ),
        "align_seconds": 0.0,
        "align_peak_memory_mb": None,
        "align_memory_kind": None,
        "align_loss_first": None,
        "align_loss_last": None,
    }
    rep = getattr(mod, "alignment_report", None)
    train = getattr(mod, "train_report", None)  # FTP: router-only training
    if train is not None and train.total:
        out.update(
            align_seconds=float(train.seconds),
            align_steps_done=len(train.total),
            align_tokens=train.tokens,
            align_loss_first=train.total[0],
            align_loss_last=train.total[-1],
        )
    if rep is not None:
        out.update(_alignment_record(rep))
    thr = mod.threshold_report
    if thr.topk_agreement:
        out["causal_topk_agreement"] = sum(thr.topk_agreement) / len(thr.topk_agreement)
    return out


def _evaluate(
    model: torch.nn.Module,
    cfg: dict,
    env: RunEnv,
    record: dict,
    keep: Path | None = None,
) -> None:
    """Measure ``model`` into ``record``; ``keep``: where its checkpoint stays, saved
    before the first measurement (the speed benchmark then loads its twins from it
    instead of saving a temporary copy)."""
    ev = cfg["eval"]
    if keep is not None:
        # before any measurement: a run stopped while it measures (its training
        # behind it) still leaves its model
        keep_model(model, env.tokenizer, keep)
        logger.info(f"checkpoint kept in {keep}")
    routed = bool(routed_layers(model))
    ml, stride = ev["ppl_max_length"], ev["ppl_stride"]
    bs = ev.get("ppl_batch_size", 1)
    val = env.streams.get("validation", ev["ppl_val_tokens"])
    record["ppl_val"] = measure_perplexity(model, val, ml, stride, "causal", bs)["ppl"]
    # FLOPs on the very tokens of the perplexity they are plotted against: causal
    # routing's share of kept tokens depends on the text (tuning: validation only)
    tuning = bool(ev.get("validation_only"))
    test = None if tuning else env.streams.get("test", ev["ppl_tokens"])
    flops_text = val if tuning else test
    # top-K FLOPs are reported beside causal ones in main runs only
    for mode in ("causal", "topk") if routed and not tuning else ("causal",):
        fl = measure_flops(
            model, flops_text, ev["flops_batch"], ev["flops_seq_len"], mode
        )
        suffix = "" if mode == "causal" else "_topk"
        record[f"normalized_flops{suffix}"] = fl["normalized"]
        record[f"normalized_flops_with_lm_head{suffix}"] = fl["normalized_with_lm_head"]
    record["flops_tokens"] = fl["tokens"]
    record["flops_split"] = "validation" if tuning else "test"
    if tuning:
        return
    res = measure_perplexity(model, test, ml, stride, "causal", bs)
    record["ppl_test"], record["ppl_tokens"] = res["ppl"], res["tokens"]
    record["ppl_test_topk"] = (
        measure_perplexity(model, test, ml, stride, "topk", bs)["ppl"]
        if routed
        else res["ppl"]
    )
    record["other_texts"] = measure_other_texts(
        model,
        env.streams,
        ev["ppl_val_tokens"],
        ml,
        stride,
        ev["flops_batch"],
        ev["flops_seq_len"],
        bs,
    )
    if routes_tokens(model):  # does the kept share hold on each offline text
        record["budget_per_text"] = measure_budget_per_text(
            model, env.streams, ev["flops_batch"], budget_sizes(ev["flops_seq_len"])
        )
    if not routed:
        record["normalized_flops_topk"] = record["normalized_flops"]
        record["normalized_flops_with_lm_head_topk"] = record[
            "normalized_flops_with_lm_head"
        ]
    acc, n, se = measure_tasks(
        model, env.tokenizer, ev["tasks"], ev["task_limit"], ev["task_batch_size"]
    )
    record.update(tasks=acc, task_n=n, task_stderr=se, task_mean=task_mean(acc))
    speed_cfg = ev.get("speed")
    record["prefill_speedup"] = record["decode_speedup"] = None
    timed = bool(speed_cfg and routed)
    if timed:  # a kept checkpoint serves as the saved copy the twins load
        with saved_model(model, env.tokenizer, keep, env.scratch) as folder:
            need = max(speed_cfg["batch_sizes"]) * max(
                speed_cfg["seq_len"], speed_cfg["decode_prompt"]
            )
            stream = env.streams.get("test", need)
            dtype = next(model.parameters()).dtype
            sp = measure_speed(folder, dtype, stream, speed_cfg, env.device)
            record["speed"] = sp
            b1 = min(speed_cfg["batch_sizes"])
            record["prefill_speedup"] = sp.get(f"prefill_speedup_b{b1}")
            record["decode_speedup"] = sp.get(f"decode_speedup_b{b1}")
    if not timed and METHODS[cfg["method"]].allocation is None:  # dense, or a control
        record["prefill_speedup"] = record["decode_speedup"] = 1.0


def execute_run(spec: RunSpec, env: RunEnv) -> dict[str, Any]:
    """Run ``spec`` and return its record (raises on failure; nothing is cached)."""
    cfg = spec.config
    t0 = time.perf_counter()
    _seed_everything(spec.seed)
    record: dict[str, Any] = {
        "phase": spec.phase,
        "method": spec.method,
        "budget": spec.budget,
        "seed": spec.seed,
        **spec.notes,
    }
    model = load_dense(env, cfg["dtype"])
    try:
        if cfg["modifier"] is not None:
            mod = _compress(model, cfg, env)
            record["align_tokens"] = (
                cfg["data"]["align_rows"] * cfg["data"]["align_seq_len"]
            )  # the aligned rows; FTP's record says what its router trained on
            record.update(_modifier_record(model, mod))
            record["compress_seconds"] = time.perf_counter() - t0
            del mod
        elif cfg.get("finetune"):
            record.update(_finetune_dense(model, cfg, env))
            record["compress_seconds"] = time.perf_counter() - t0
        else:
            record.update(retention=1.0, align_seconds=0.0, align_peak_memory_mb=None)
        if cfg["modifier"] is not None:
            r = cfg["modifier"]
            if "align_lr" in r:  # AdaDSF
                record["align_lr"] = r["align_lr"] if r["align_steps"] else None
                layer_lr = r.get("align_layer_lr")
                record["align_layer_lr"] = layer_lr if r["align_steps"] else None
                record["temperature"], record["beta"] = r["temperature"], r["beta"]
            else:  # FTP: its router's learning rate
                record["align_lr"] = r["lr"] if r["train_steps"] else None
        keep = None
        if env.keep_models and cfg["modifier"] is not None:
            keep = Path(env.keep_models) / spec.phase / spec.method / spec.key
        _evaluate(model, cfg, env, record, keep)
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record["seconds"] = time.perf_counter() - t0
    bad = [
        k
        for k in ("ppl_val", "ppl_test")
        if k in record and not math.isfinite(record[k])
    ]
    if bad:
        logger.warning(f"{spec.label}: non-finite {bad}")
    return record
