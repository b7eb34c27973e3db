"""The alignment fine-tune loop: the routed student learns to match its frozen dense
teacher. llm-compressor 0.14 has no training entrypoint and its pipelines run without
gradients or the LM head, so the stage runs its own loop from ``on_initialize`` (as
AutoRound does): AdamW for a fixed number of steps over re-batched rows.

* **Modes.** Student and teacher run in ``eval()`` (no dropout: the target is the
  deterministic dense model, and noise on one side would bias the KL); only the routed
  layers themselves get ``training=True``, so routing runs its training mode (top-k
  with the straight-through gate), and so does every checkpointed layer, as
  transformers only checkpoints a layer in training mode. All restored afterwards.
* **Determinism.** Rows are put in a canonical order (the calibration loader may have
  shuffled them), then drawn in epochs seeded with ``seed``, inside a forked RNG: the
  same data and seed give the same weights, and the caller's RNG is left alone.
* **NaN guard.** The loss and gradient norm must be finite before each step, every
  trainable parameter after it; otherwise the last good values are restored and
  :class:`AlignmentDivergedError` is raised, a decision all ``torchrun`` ranks take
  together.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier import distributed
from adadsf_modifier.alignment.config import (
    AlignmentConfig,
    AlignmentDivergedError,
    AlignmentReport,
)
from adadsf_modifier.alignment.data import RowBatcher, training_rows
from adadsf_modifier.alignment.losses import alignment_loss
from adadsf_modifier.alignment.parallel import data_parallel
from adadsf_modifier.alignment.params import (
    TrainableParams,
    added_by_routing,
    check_alignment_supported,
    make_optimizer,
    select_trainable,
)
from adadsf_modifier.alignment.peak_memory import peak_memory_mb, reset_peak_memory
from adadsf_modifier.alignment.teacher_cache import TeacherCache, rows_read_again
from adadsf_modifier.routing import routed_layers, routing_mode
from adadsf_modifier.utils import tensors_to_device


def _rates(config: AlignmentConfig) -> str:
    layer_lr, rule = config.align_layer_lr, config.align_routing
    layers = "" if layer_lr is None else f" (layers {layer_lr:g})"
    routing = f", {rule} routing" if rule != "topk" else ""
    return f"lr {config.align_lr:g}{layers}{routing}"


def _forward(model: nn.Module, batch: Mapping[str, torch.Tensor], hidden: bool):
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        output_hidden_states=hidden,
    )
    # (embeddings, layer 0 ... L-2 outputs, final normed output): one per decoder layer
    # once the embeddings, identical in both models, are dropped
    states = tuple(out.hidden_states[1:]) if hidden else None
    return out.logits, states


@contextlib.contextmanager
def _student_training_state(
    student: nn.Module, trainable: Sequence[nn.Parameter], gradient_checkpointing: bool
):
    """Freeze all but ``trainable``; eval mode except the routed / checkpointed layers
    themselves; everything restored on exit."""
    modes = {m: m.training for m in student.modules()}
    requires = {p: p.requires_grad for p in student.parameters()}
    had_gc = bool(getattr(student, "is_gradient_checkpointing", False))
    had_input_hook = hasattr(student, "_require_grads_hook")
    try:
        student.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        student.eval()
        for layer in routed_layers(student):
            layer.training = True  # this module only: training routing, no dropout
        if gradient_checkpointing:
            student.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            for m in student.modules():
                if getattr(m, "gradient_checkpointing", False) is True:
                    m.training = True  # transformers checkpoints training layers only
        yield
    finally:
        if gradient_checkpointing and not had_gc:
            student.gradient_checkpointing_disable()
            if not had_input_hook and hasattr(student, "_require_grads_hook"):
                student.disable_input_require_grads()
        for m, mode in modes.items():
            m.training = mode
        for p, flag in requires.items():
            p.requires_grad_(flag)
        for p in trainable:
            p.grad = None


def _diverged(
    trainable: TrainableParams,
    step: int,
    config: AlignmentConfig,
    what: str,
    values: Mapping[str, float],
) -> AlignmentDivergedError:
    """Restore the last good parameters; the error says what to change (a loss that is
    non-finite before any update comes from the model or data, not the optimizer)."""
    trainable.restore()
    detail = ", ".join(f"{k}={v:.6g}" for k, v in values.items())
    restored = (
        f"the values after step {step - 1}"
        if step > 1
        else "their values before alignment"
    )
    if step == 1 and what == "non-finite loss":
        advice = (
            "The model gives non-finite outputs on the training data before any "
            "update: check its weights and data, and load fp16 models in float32 or "
            "bfloat16 (fp16 activations overflow easily)"
        )
    else:
        bf16 = ", or turn off align_bf16" if config.align_bf16 else ""
        advice = f"Try: lower align_lr{bf16}"
    return AlignmentDivergedError(
        f"AdaDSF alignment diverged: {what} at step {step}/{config.align_steps} "
        f"({detail}). The trainable parameters were restored to {restored}. {advice}.",
        step=step,
    )


def _rank_rows(data: Iterable[Mapping[str, Any]], seq_len: int) -> list[torch.Tensor]:
    """This rank's training rows, sorted (the calibration loader shuffles with the
    global RNG). Under ``torchrun`` rows identical on every rank (an ``align_dataset``)
    are split; a rank's own share of the calibration batches is kept."""

    def rows() -> list[torch.Tensor]:
        out = training_rows(data, seq_len)
        out.sort(key=lambda r: (r.numel(), r.tolist()))
        return out

    rows = distributed.agree_on_errors(rows)
    if isinstance(data, distributed.RankPartition):
        return rows
    return distributed.split_if_identical(rows, lambda r: [r], "training rows")


#: Max global gradient norm: a step that would move further is scaled back.
GRAD_CLIP = 1.0


def _total_norm(params: list[torch.Tensor]) -> float:
    """Clip the gradients to :data:`GRAD_CLIP`; their global norm before clipping (an
    FSDP2 DTensor norm is reduced over the ranks)."""
    norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    full = getattr(norm, "full_tensor", None)
    return float(norm if full is None else full())


def align_model(
    student: nn.Module,
    teacher: nn.Module | None,
    data: Iterable[Mapping[str, Any]],
    config: AlignmentConfig,
    params: Sequence[nn.Parameter] | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> AlignmentReport:
    """Fine-tune the routed ``student`` (in place) towards the dense ``teacher``
    (``None`` when no loss term needs it) for ``config.align_steps`` steps on the rows
    of ``data``. ``params``: what trains instead of what ``align_trainable`` selects
    (a dense control fine-tuned by this very loop).

    :raises AlignmentDivergedError: a non-finite loss, gradient or parameter, after
        restoring the last good parameters
    """
    report = AlignmentReport(trainable=config.align_trainable)
    if config.align_steps == 0:
        logger.info("AdaDSF alignment: align_steps=0, stage skipped")
        return report
    weights = config.loss_weights
    if weights.needs_teacher and teacher is None:
        raise ValueError(
            "the KL / hidden alignment terms need the dense teacher, got None"
        )
    check_alignment_supported(student, config)

    if params is None:
        params = select_trainable(student, config.align_trainable)
        what = config.align_trainable
    else:
        params, what = list(params), "the given parameters"
        if not params:
            raise ValueError("align_model: params is empty; nothing would train")
    added = added_by_routing(student, params)
    report.num_trainable = sum(p.numel() for p in params)
    device = params[0].device
    rows = _rank_rows(data, config.align_seq_len)
    report.num_rows = distributed.sum_across_ranks([len(rows)])[0]
    pad_id = getattr(getattr(student, "config", None), "pad_token_id", None)
    batcher = RowBatcher(rows, config.align_batch_size, seed, pad_id or 0)
    peak_reset = reset_peak_memory(device)
    if teacher is not None:
        teacher.eval()
    need_hidden = weights.hidden > 0
    autocast = torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=config.align_bf16
    )

    logger.info(
        f"AdaDSF alignment: {config.align_steps} steps, batch {batcher.batch_size} x "
        f"<= {config.align_seq_len} tokens from {len(rows)} rows, {_rates(config)}, "
        f"loss {config.align_loss}, training {what} ({report.num_trainable:,} "
        "parameters)"
    )
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        )
        torch.manual_seed(seed)
        checkpointing = config.align_gradient_checkpointing
        stack.enter_context(_student_training_state(student, params, checkpointing))
        stack.enter_context(torch.enable_grad())
        run = stack.enter_context(
            data_parallel(student, teacher, params, config.align_parallel, device)
        )
        cache = None
        steps = config.align_steps
        if config.align_teacher_cache and weights.needs_teacher:
            if rows_read_again(len(rows), steps, batcher.batch_size):
                cache = TeacherCache(
                    run.teacher, rows, need_hidden, _forward, run.device
                )
            else:
                logger.warning(
                    f"AdaDSF alignment: align_teacher_cache not used: {steps} "
                    f"steps of {batcher.batch_size} rows read each of the {len(rows)} "
                    "rows at most once, so no cached output would be read back (it "
                    "would only cost memory); the teacher runs every step"
                )
        trainable = TrainableParams(run.params)
        optimizer = make_optimizer(trainable.masters, added, config)
        if config.align_routing != "topk":  # what "auto" does while training
            stack.enter_context(routing_mode(student, config.align_routing))
        bar = tqdm(
            range(1, steps + 1),
            desc="AdaDSF alignment",
            disable=not (show_progress and distributed.show_progress()),
        )
        running: float | None = None
        for step in bar:
            batch = tensors_to_device(batcher.next_batch(), run.device)
            share = run.token_share(batch["attention_mask"])  # None in one process
            teacher_logits = teacher_hidden = None
            if weights.needs_teacher:
                with torch.no_grad(), autocast:
                    teacher_logits, teacher_hidden = (
                        cache.outputs(batch)
                        if cache is not None
                        else _forward(run.teacher, batch, need_hidden)
                    )
            with autocast:
                student_logits, student_hidden = _forward(
                    run.student, batch, need_hidden
                )
            terms = alignment_loss(
                weights,
                batch["input_ids"],
                batch["attention_mask"],
                student_logits,
                student_hidden,
                teacher_logits,
                teacher_hidden,
            )
            values = run.global_values(terms.as_floats(), share)
            if not math.isfinite(values["loss"]):
                raise _diverged(trainable, step, config, "non-finite loss", values)
            trainable.zero_grad()
            (terms.total if share is None else terms.total * share).backward()
            del teacher_logits, teacher_hidden, student_logits, student_hidden, terms
            trainable.grads_to_masters()
            norm = _total_norm(trainable.masters)
            if distributed.any_across_ranks(not math.isfinite(norm)):
                values["grad_norm"] = norm
                raise _diverged(trainable, step, config, "non-finite gradient", values)
            optimizer.step()
            trainable.masters_to_params()
            if distributed.any_across_ranks(not trainable.all_finite()):
                what = "non-finite parameters after the update"
                raise _diverged(trainable, step, config, what, values)
            trainable.keep()

            report.steps = step
            report.losses.append(values["loss"])
            report.grad_norms.append(norm)
            for k, v in values.items():
                if k != "loss":
                    report.terms.setdefault(k, []).append(v)
            loss = values["loss"]
            running = loss if running is None else 0.9 * running + 0.1 * loss
            bar.set_postfix(loss=f"{loss:.4f}", avg=f"{running:.4f}")
        bar.close()
        trainable.zero_grad()
        del optimizer, trainable

        if cache is not None:
            report.teacher_batches = cache.computed
    report.seconds = time.perf_counter() - start
    report.peak_memory_mb, report.memory_kind = peak_memory_mb(device, peak_reset)
    parts = ", ".join(f"{k} {v[0]:.4f} -> {v[-1]:.4f}" for k, v in report.terms.items())
    logger.info(
        f"AdaDSF alignment done: {report.steps} steps in {report.seconds:.1f} s "
        f"({report.seconds / max(report.steps, 1):.2f} s/step), loss "
        f"{report.first_loss:.4f} -> {report.last_loss:.4f} ({parts}), "
        f"{report.memory_kind} {report.peak_memory_mb:.0f} MB"
    )
    return report
