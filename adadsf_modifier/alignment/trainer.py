"""The alignment fine-tune loop: a routed (sparse) student learns to match its frozen
dense teacher.

llm-compressor 0.14 has no training entrypoint and its calibration pipelines run without
gradients and without the LM head, so AdaDSF runs its own small loop from
``on_initialize`` (as AutoRound does): plain PyTorch, AdamW, ``torch.enable_grad()``, a
fixed number of steps over re-batched calibration (or user-given) rows
(:mod:`~adadsf_modifier.alignment.data`).

Design decisions (why):

* **Modes.** The student is put in ``eval()`` mode while it trains (gradients on,
  dropout off) and the teacher stays in ``eval()`` under ``no_grad``: the target is the
  *deterministic* dense model, and dropout noise on one side only would bias the KL.
  Only the routed decoder layers themselves (not their children: attention, MLP,
  dropout) get ``training=True``, so routing runs in its training mode (top-k with the
  straight-through gate, whatever the eval-time routing mode is), and with gradient
  checkpointing every checkpointed layer gets it too, because transformers only
  checkpoints a layer whose ``training`` flag is set. Every module's mode is restored
  afterwards.
* **What trains.** ``routers`` (default): only the routers' parameters; the pre-trained
  weights are untouched, so the stage is cheap in optimizer memory and cannot damage the
  dense model's knowledge. ``routers_and_layers``: also the routed decoder layers' own
  weights (more capacity to compensate for skipped tokens). Embeddings, LM head, final
  norm and un-routed layers never train. The routers learn through the straight-through
  gate of the routed layers (1 in value, so the forward is unchanged; its gradient
  reaches the router's scores).
* **Precision.** Trainable parameters stored in fp16 or bf16 are updated through float32
  master copies (the model keeps its dtype): AdamW applied to fp16 values diverges at
  the first step (its ``eps`` of 1e-8 is 0 in fp16, so a zero second moment gives
  0/0), and bf16 rounds small updates away.
* **Determinism.** Rows are put in a canonical order (the calibration loader may have
  shuffled them), then drawn in epochs shuffled by a ``torch.Generator`` seeded with
  ``seed`` (the modifier's); the loop runs inside ``torch.random.fork_rng`` seeded
  with it. Two runs with the same data and seed give identical weights, and the
  caller's global RNG state is left alone.
* **NaN guard.** Before each optimizer step the loss and the gradient norm must be
  finite, after it every trainable parameter. On failure the trainable parameters are
  restored from a snapshot of the last good step (never NaN weights) and
  :class:`AlignmentDivergedError` is raised.
* **Under torchrun** (:mod:`~adadsf_modifier.alignment.parallel`): each rank trains on
  its own partition of the rows (rows identical on every rank, e.g. an
  ``align_dataset``, are split the way llm-compressor splits calibration data),
  gradients are averaged every step (DDP or FSDP2, ``align_parallel``), the logged
  losses
  are the mean over every rank's tokens, and every NaN-guard decision is taken by all
  ranks together; the progress bar is drawn on the source rank only.
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

__all__ = ["align_model"]


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
    # hidden_states = (embeddings, layer 0 ... layer L-2 outputs, final normed output):
    # one entry per decoder layer after dropping the embeddings, which are identical in
    # both models.
    states = tuple(out.hidden_states[1:]) if hidden else None
    return out.logits, states


@contextlib.contextmanager
def _student_training_state(
    student: nn.Module, trainable: Sequence[nn.Parameter], gradient_checkpointing: bool
):
    """Freeze all but ``trainable``; eval mode except the routed / checkpointed layers
    themselves.

    Everything (modes, ``requires_grad``, gradient checkpointing, leftover ``.grad``) is
    restored on exit, also when training raises.
    """
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
    """Restore the last good parameters; the error says what to change, and only what
    applies: a loss that is non-finite before any update comes from the model or the
    data, not from the optimizer settings."""
    trainable.restore()
    detail = ", ".join(f"{k}={v:.6g}" for k, v in values.items())
    if step == 1 and what == "non-finite loss":
        restored = "their values before alignment"
        advice = (
            "The model gives non-finite outputs on the training data before any "
            "update: check its weights and data, and load fp16 models in float32 or "
            "bfloat16 (fp16 activations overflow easily)"
        )
    else:
        restored = (
            f"the values after step {step - 1}"
            if step > 1
            else "their values before alignment"
        )
        tips = ["lower align_lr"]
        if config.align_bf16:
            tips.append("turn off align_bf16")
        advice = "Try: " + ", or ".join(tips)
    return AlignmentDivergedError(
        f"AdaDSF alignment diverged: {what} at step {step}/{config.align_steps} "
        f"({detail}). The trainable parameters were restored to {restored}. {advice}.",
        step=step,
    )


def _rank_rows(data: Iterable[Mapping[str, Any]], seq_len: int) -> list[torch.Tensor]:
    """This rank's training rows, in a canonical order.

    Sorted before the seeded shuffle: llm-compressor's calibration loader shuffles with
    the global RNG, and the stage must give the same weights for the same rows and
    seed. Under ``torchrun``, rows that are identical on every rank (an
    ``align_dataset``) are split into contiguous parts; ranks that hold different rows,
    or their share of the calibration batches, keep them. A rank whose data holds no
    rows fails on every rank.
    """

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
    """Fine-tune the routed ``student`` towards the dense ``teacher`` for
    ``config.align_steps`` steps (``seed``: data order and any other randomness of
    the loop; ``show_progress``: a tqdm bar on the source rank).

    ``data`` yields rows or batches with ``input_ids`` (and ``attention_mask``), see
    :func:`~adadsf_modifier.alignment.data.training_rows`. ``teacher`` may be ``None``
    only when no loss term needs it (LM-only). ``params``: the parameters to train
    instead of those ``config.align_trainable`` selects in the routed layers; the
    study's dense control passes a dense model's decoder-layer weights, so that it is
    fine-tuned by this very loop (rows, order, schedule, precision, guards) and differs
    from the routed arm it controls only in the routing. The student is modified in
    place; its modes, ``requires_grad`` flags, dtypes and gradient checkpointing
    setting are restored afterwards. Raises :class:`AlignmentDivergedError` (a
    ``FloatingPointError``) on a non-finite loss/gradient/parameter, after restoring the
    last good parameters.
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
        params = [p for _, p in select_trainable(student, config.align_trainable)]
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
