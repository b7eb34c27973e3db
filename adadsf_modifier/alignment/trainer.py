"""The alignment fine-tune loop: a routed (sparse) student learns to match its frozen
dense teacher.

llm-compressor 0.14 has no training entrypoint and its calibration pipelines run without
gradients and without the LM head, so AdaDSF runs its own small loop from
``on_initialize`` (as AutoRound does): plain PyTorch, AdamW, ``torch.enable_grad()``, a
fixed number of steps over re-batched calibration (or user-given) rows.

Design decisions (why):

* **Modes.** The student is put in ``eval()`` mode while it trains (gradients on,
  dropout off) and the teacher stays in ``eval()`` under ``no_grad``: the target is the
  *deterministic* dense model, and dropout noise on one side only would bias the KL.
    Only the routed decoder layers themselves
  (not their children: attention, MLP, dropout) get ``training=True``, so routing runs
  in its training mode (top-k with the straight-through gate, whatever the eval-time
  routing mode is), and with gradient checkpointing every checkpointed layer gets it
  too, because transformers only checkpoints a layer whose ``training`` flag is set.
  Every module's mode is restored afterwards.
* **What trains.** ``routers`` (default): only the routers' parameters; the pre-trained
  weights are untouched, so the stage is cheap in optimizer memory and cannot damage the
  dense model's knowledge. ``routers_and_layers``: also the routed decoder layers' own
  weights (more capacity to compensate for skipped tokens). Embeddings, LM head, final
  norm and un-routed layers never train. The routers learn through the straight-through
  gate of the routed layers (METHOD.md §1 step 3).
* **Determinism.** Rows are put in a canonical order (the calibration loader may have
  shuffled them), then drawn in epochs shuffled by a ``torch.Generator`` seeded with
  ``seed``; the loop runs inside ``torch.random.fork_rng`` seeded with it. Two runs with
  the same data and seed give identical weights, and the caller's global RNG state is
  left alone.
* **NaN guard.** Before each optimizer step the loss and the gradient norm must be
  finite, after it every trainable parameter. On failure the trainable parameters are
  restored from a snapshot of the last good step (never NaN weights) and
  :class:`AlignmentDivergedError` is raised.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import resource
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.alignment.losses import AlignmentLossWeights, alignment_loss
from adadsf_modifier.routing.routed_layer import RoutedLayer

__all__ = [
    "TRAINABLE_SETS",
    "AlignmentConfig",
    "AlignmentDivergedError",
    "AlignmentReport",
    "RowBatcher",
    "align_model",
    "make_teacher",
    "release_memory",
    "select_trainable",
    "training_rows",
]

TRAINABLE_SETS = ("routers", "routers_and_layers")
"""``routers``: router parameters only. ``routers_and_layers``: plus the routed layers' weights."""


# ----------------------------------------------------------------------------------
# validation Shared by AlignmentConfig and the modifier's pydantic fields, so the
# messages are identical.


def check_steps(value: int, name: str = "steps") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{name} must be an integer >= 0 (0 skips the alignment stage), got {value!r}"
        )
    return value


def check_positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")
    return value


def check_lr(value: float, name: str = "lr") -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} (learning rate) must be a finite number > 0, got {value!r}"
        )
    return float(value)


def check_non_negative(value: float, name: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_grad_clip(value: float | None, name: str = "grad_clip") -> float | None:
    """Max gradient norm: > 0 clips, 0 (or ``None``) disables clipping."""
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{name} (max gradient norm) must be a finite number > 0, or 0 to disable "
            f"clipping, got {value!r}"
        )
    return float(value)


def check_trainable(value: str, name: str = "trainable") -> str:
    if value not in TRAINABLE_SETS:
        raise ValueError(f"{name} must be one of {list(TRAINABLE_SETS)}, got {value!r}")
    return value


# ----------------------------------------------------------------------------------
# config/report


@dataclass(frozen=True)
class AlignmentConfig:
    """Everything the loop needs; the modifier builds it from its ``align_*`` fields.

    :param steps: optimizer steps (0: nothing happens)
    :param lr: AdamW learning rate (constant)
    :param batch_size: rows per step (capped at the number of rows available)
    :param seq_len: rows are truncated to their first ``seq_len`` real tokens
    :param weights: loss weights (KL, hidden alignment, causal LM)
    :param trainable: one of :data:`TRAINABLE_SETS`
    :param grad_clip: max global gradient norm; 0 or ``None``: no clipping
    :param weight_decay: AdamW weight decay
    :param seed: data order and any other randomness of the loop
    :param bf16: run forward passes under bf16 autocast (losses stay float32)
    :param gradient_checkpointing: recompute decoder layers in backward to save
        activation memory
    :param show_progress: show a tqdm bar with the running loss
    """

    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 4
    seq_len: int = 512
    weights: AlignmentLossWeights = field(default_factory=AlignmentLossWeights)
    trainable: str = "routers"
    grad_clip: float | None = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        check_steps(self.steps)
        check_lr(self.lr)
        check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.seq_len, "seq_len")
        check_trainable(self.trainable)
        check_grad_clip(self.grad_clip)
        check_non_negative(self.weight_decay, "weight_decay")
        if not isinstance(self.weights, AlignmentLossWeights):
            raise TypeError(
                f"weights must be AlignmentLossWeights, got {type(self.weights)}"
            )


@dataclass
class AlignmentReport:
    """What the stage did: per-step losses (weighted total and unweighted terms), time,
    memory."""

    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    terms: dict[str, list[float]] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    num_trainable: int = 0
    trainable: str = "routers"
    num_rows: int = 0
    peak_memory_mb: float = 0.0
    memory_kind: str = "peak RSS"

    @property
    def first_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


class AlignmentDivergedError(FloatingPointError):
    """A non-finite loss, gradient or parameter; the trainable parameters were
    restored."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------------
# teacher


def make_teacher(model: nn.Module) -> nn.Module:
    """A frozen, independent deep copy of ``model`` (call it *before* routing).

    Deep-copied rather than shared: with ``routers_and_layers`` the student's layer
    weights change, and even with ``routers`` only a shared module would be one refactor
    away from training the teacher too. The copy is in eval mode, needs no gradients,
    and its parameters and buffers are checked to share no storage with the student's.
    """
    teacher = copy.deepcopy(model)
    teacher.eval()
    teacher.requires_grad_(False)
    student_ptrs = {
        t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()
    }
    shared = [
        n
        for n, t in (*teacher.named_parameters(), *teacher.named_buffers())
        if t.numel() and t.data_ptr() in student_ptrs
    ]
    if shared:
        raise RuntimeError(
            f"teacher copy shares storage with the student: {shared[:5]}"
        )
    return teacher


def release_memory() -> None:
    """Collect garbage (and empty the CUDA cache) after the teacher has been dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------
# data


def _as_long_tensor(value: Any) -> torch.Tensor:
    return (
        value
        if isinstance(value, torch.Tensor)
        else torch.as_tensor(value, dtype=torch.long)
    )


def training_rows(
    source: Iterable[Mapping[str, Any]], seq_len: int
) -> list[torch.Tensor]:
    """Flatten ``source`` into 1-D rows of real token ids, each cut to its first
    ``seq_len`` tokens.

    ``source`` yields mappings with ``input_ids`` and optionally ``attention_mask``,
    either one row each (a ``datasets.Dataset``, a list of dicts) or a batch each
    (llm-compressor's calibration ``DataLoader``). Padding is removed using the
    attention mask (left or right padding alike), so the rows can be re-batched at any
    batch size; other keys (``labels``...) are ignored.
    """
    check_positive_int(seq_len, "seq_len")
    rows: list[torch.Tensor] = []
    for item in source:
        if "input_ids" not in item:
            raise ValueError(
                f"alignment data needs an `input_ids` column, got {sorted(item)}"
            )
        ids = _as_long_tensor(item["input_ids"])
        mask = item.get("attention_mask")
        mask = _as_long_tensor(mask) if mask is not None else torch.ones_like(ids)
        if ids.dim() == 1:
            ids, mask = ids.unsqueeze(0), mask.unsqueeze(0)
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"alignment data: input_ids {tuple(ids.shape)} / attention_mask "
                f"{tuple(mask.shape)} must be matching 1-D rows or 2-D batches"
            )
        for row, row_mask in zip(ids.cpu(), mask.cpu()):
            real = row[row_mask.bool()][:seq_len]
            if real.numel() > 0:
                rows.append(real.clone())
    if not rows:
        raise ValueError("alignment data holds no real tokens (empty, or all padding)")
    return rows


class RowBatcher:
    """Endless batches of ``batch_size`` rows, cycling over shuffled epochs of ``rows``.

    Each epoch is a fresh permutation drawn from a generator seeded with ``seed``; a
    batch that crosses an epoch boundary takes its remaining rows from the next epoch,
    so every batch has the same number of rows. Rows of different lengths are
    right-padded with ``pad_token_id`` and masked out in ``attention_mask``.
    """

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        batch_size: int,
        seed: int,
        pad_token_id: int = 0,
    ):
        if not rows:
            raise ValueError("RowBatcher needs at least one row")
        check_positive_int(batch_size, "batch_size")
        self.rows = list(rows)
        self.batch_size = min(batch_size, len(self.rows))
        if self.batch_size < batch_size:
            logger.warning(
                f"AdaDSF alignment: only {len(self.rows)} rows of training data, using batch size "
                f"{self.batch_size} instead of {batch_size}"
            )
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    def _next_index(self) -> int:
        if not self._order:
            self._order = torch.randperm(
                len(self.rows), generator=self._generator
            ).tolist()
        return self._order.pop(0)

    def next_batch(self) -> dict[str, torch.Tensor]:
        chosen = [self.rows[self._next_index()] for _ in range(self.batch_size)]
        width = max(r.numel() for r in chosen)
        input_ids = torch.full(
            (len(chosen), width), self.pad_token_id, dtype=torch.long
        )
        attention_mask = torch.zeros((len(chosen), width), dtype=torch.long)
        for i, r in enumerate(chosen):
            input_ids[i, : r.numel()] = r
            attention_mask[i, : r.numel()] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()


# ----------------------------------------------------------------------------------
# parameters


def select_trainable(
    model: nn.Module, trainable: str
) -> list[tuple[str, nn.Parameter]]:
    """Named parameters that train under ``trainable`` (see :data:`TRAINABLE_SETS`)."""
    check_trainable(trainable)
    chosen: dict[int, tuple[str, nn.Parameter]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, RoutedLayer):
            continue
        source = module.router if trainable == "routers" else module
        prefix = f"{name}.router" if trainable == "routers" else name
        for pname, param in source.named_parameters():
            chosen.setdefault(
                id(param), (f"{prefix}.{pname}" if prefix else pname, param)
            )
    if not chosen:
        raise ValueError(
            "AdaDSF alignment found no routed layers to train: route the model before aligning it"
        )
    return list(chosen.values())


class _ParamSnapshot:
    """Copy of the trainable parameters after the last good step (the NaN guard's
    fallback)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self.copies = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        for p, c in zip(self.params, self.copies):
            c.copy_(p)

    @torch.no_grad()
    def restore(self) -> None:
        for p, c in zip(self.params, self.copies):
            p.copy_(c)


def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak CUDA memory allocated since the stage began, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "peak CUDA allocated"
    rss = resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "peak process RSS"


# ----------------------------------------------------------------------------------
# loop


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
        for m in student.modules():
            if isinstance(m, RoutedLayer):
                m.training = (
                    True  # the layer itself only: routing in training mode, no dropout
                )
        if gradient_checkpointing:
            if not getattr(student, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"align_gradient_checkpointing: {type(student).__name__} does not support "
                    "gradient checkpointing"
                )
            student.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            for m in student.modules():
                if getattr(m, "gradient_checkpointing", False) is True:
                    m.training = (
                        True  # transformers checkpoints a layer only in training mode
                    )
        yield
    finally:
        if (
            gradient_checkpointing
            and not had_gc
            and hasattr(student, "gradient_checkpointing_disable")
        ):
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
    snapshot: _ParamSnapshot,
    step: int,
    total: int,
    what: str,
    values: Mapping[str, float],
) -> AlignmentDivergedError:
    snapshot.restore()
    detail = ", ".join(f"{k}={v:.6g}" for k, v in values.items())
    restored = (
        f"the values after step {step - 1}"
        if step > 1
        else "their values before alignment"
    )
    return AlignmentDivergedError(
        f"AdaDSF alignment diverged: {what} at step {step}/{total} ({detail}). The trainable "
        f"parameters were restored to {restored}. Lower align_lr, set align_grad_clip, or "
        f"turn off align_bf16.",
        step=step,
    )


def align_model(
    student: nn.Module,
    teacher: nn.Module | None,
    data: Iterable[Mapping[str, Any]],
    config: AlignmentConfig,
) -> AlignmentReport:
    """Fine-tune the routed ``student`` towards the dense ``teacher`` for
    ``config.steps`` steps.

    ``data`` yields rows or batches with ``input_ids`` (and ``attention_mask``), see
    :func:`training_rows`. ``teacher`` may be ``None`` only when no loss term needs it
    (LM-only). The student is modified in place; its modes, ``requires_grad`` flags and
    gradient checkpointing setting are restored afterwards. Raises
    :class:`AlignmentDivergedError` (a ``FloatingPointError``) on a non-finite
    loss/gradient/parameter, after restoring the last good parameters.
    """
    report = AlignmentReport(trainable=config.trainable)
    if config.steps == 0:
        logger.info("AdaDSF alignment: align_steps=0, stage skipped")
        return report
    weights = config.weights
    if weights.needs_teacher and teacher is None:
        raise ValueError(
            "the KL / hidden alignment terms need the dense teacher, got None"
        )

    named = select_trainable(student, config.trainable)
    params = [p for _, p in named]
    report.num_trainable = sum(p.numel() for p in params)
    device = params[0].device
    rows = training_rows(data, config.seq_len)
    # Canonical order before the seeded shuffle: llm-compressor's calibration loader
    # shuffles with the global RNG, and the stage must give the same weights for the
    # same rows and seed.
    rows.sort(key=lambda r: (r.numel(), r.tolist()))
    report.num_rows = len(rows)
    pad_id = getattr(getattr(student, "config", None), "pad_token_id", None)
    batcher = RowBatcher(
        rows, config.batch_size, config.seed, pad_id if pad_id is not None else 0
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if teacher is not None:
        teacher.eval()
    need_hidden = weights.hidden > 0
    autocast = torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=config.bf16
    )

    logger.info(
        f"AdaDSF alignment: {config.steps} steps, batch {batcher.batch_size} x <= {config.seq_len} "
        f"tokens from {len(rows)} rows, lr {config.lr:g}, weights kl={weights.kl:g} "
        f"hidden={weights.hidden:g} lm={weights.lm:g}, training {config.trainable} "
        f"({report.num_trainable:,} parameters)"
    )
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        )
        torch.manual_seed(config.seed)
        stack.enter_context(
            _student_training_state(student, params, config.gradient_checkpointing)
        )
        stack.enter_context(torch.enable_grad())
        optimizer = torch.optim.AdamW(
            params, lr=config.lr, weight_decay=config.weight_decay
        )
        snapshot = _ParamSnapshot(params)
        max_norm = (
            config.grad_clip if config.grad_clip else math.inf
        )  # still measures the norm
        bar = tqdm(
            range(1, config.steps + 1),
            desc="AdaDSF alignment",
            disable=not config.show_progress,
        )
        running: float | None = None
        for step in bar:
            batch = {k: v.to(device) for k, v in batcher.next_batch().items()}
            teacher_logits = teacher_hidden = None
            if weights.needs_teacher:
                with torch.no_grad(), autocast:
                    teacher_logits, teacher_hidden = _forward(
                        teacher, batch, need_hidden
                    )
            with autocast:
                student_logits, student_hidden = _forward(student, batch, need_hidden)
            terms = alignment_loss(
                weights,
                batch["input_ids"],
                batch["attention_mask"],
                student_logits,
                student_hidden,
                teacher_logits,
                teacher_hidden,
            )
            values = terms.as_floats()
            if not math.isfinite(values["loss"]):
                raise _diverged(snapshot, step, config.steps, "non-finite loss", values)
            optimizer.zero_grad(set_to_none=True)
            terms.total.backward()
            del teacher_logits, teacher_hidden, student_logits, student_hidden, terms
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if not math.isfinite(grad_norm):
                values["grad_norm"] = grad_norm
                raise _diverged(
                    snapshot, step, config.steps, "non-finite gradient", values
                )
            optimizer.step()
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise _diverged(
                    snapshot,
                    step,
                    config.steps,
                    "non-finite parameters after the update",
                    values,
                )
            snapshot.update()

            report.steps = step
            report.losses.append(values["loss"])
            report.grad_norms.append(grad_norm)
            for k, v in values.items():
                if k != "loss":
                    report.terms.setdefault(k, []).append(v)
            running = (
                values["loss"]
                if running is None
                else 0.9 * running + 0.1 * values["loss"]
            )
            bar.set_postfix(loss=f"{values['loss']:.4f}", avg=f"{running:.4f}")
        bar.close()
        optimizer.zero_grad(set_to_none=True)
        del optimizer, snapshot

    report.seconds = time.perf_counter() - start
    report.peak_memory_mb, report.memory_kind = _peak_memory_mb(device)
    parts = ", ".join(f"{k} {v[0]:.4f} -> {v[-1]:.4f}" for k, v in report.terms.items())
    logger.info(
        f"AdaDSF alignment done: {report.steps} steps in {report.seconds:.1f} s "
        f"({report.seconds / max(report.steps, 1):.2f} s/step), loss {report.first_loss:.4f} -> "
        f"{report.last_loss:.4f} ({parts}), {report.memory_kind} {report.peak_memory_mb:.0f} MB"
    )
    return report
