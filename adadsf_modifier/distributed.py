"""AdaDSF under ``torchrun`` (NCCL on GPUs, gloo on CPU): each rank calibrates on its
own partition, but statistics, routers and thresholds must be identical on every rank
(else a checkpoint would depend on the rank that saved it), so every stage reduces what
it measured through these helpers. Without a process group each returns its input.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from compressed_tensors.distributed import (
    get_source_rank,
    is_distributed,
    is_source_process,
)
from loguru import logger
from torch import nn

from adadsf_modifier.constraints import InputError

T = TypeVar("T")
_QPARAM = re.compile(r"(weight|input|output)_(scale|zero_point|g_idx|global_scale)$")


class DistributedMismatchError(InputError):
    """Ranks disagree on something that must be identical (model, settings, data)."""


class RankPartition(list):
    """Batches that already are this rank's share: later stages must not split them."""


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_distributed() -> bool:
    """Initialise the process group from ``torchrun``'s environment (compressed-tensors'
    ``init_dist`` with an accelerator, else gloo); True when this call created it."""
    if not dist.is_available() or dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if torch.accelerator.is_available():
        from compressed_tensors.offload import init_dist

        init_dist()
    else:
        dist.init_process_group("gloo")
    return True


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_across_ranks(values: Sequence[float] | torch.Tensor) -> Any:
    """Element-wise sum over ranks of numbers (a list back) or of a tensor. Reduce sums
    and counts, never means (a mean of means weights ranks, not tokens)."""
    if not is_distributed():
        return values
    if isinstance(values, torch.Tensor):
        out = values.detach().to(_comm_device(), copy=True)
        dist.all_reduce(out)
        return out.to(values.device)
    ints = all(isinstance(v, int) for v in values)
    t = torch.tensor(list(values), dtype=torch.int64 if ints else torch.float64)
    return sum_across_ranks(t).tolist()


def any_across_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is on any: a decision to raise is taken
    together, or the others wait forever in the next collective."""
    if not is_distributed():
        return flag
    return bool(sum_across_ranks(torch.tensor([int(bool(flag))]))[0] > 0)


def all_gather_object(obj: T) -> list[T]:
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T) -> T:
    """``obj`` from the source rank, on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=get_source_rank())
    return box[0]


def all_gather_variable(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (first dimensions
    may differ)."""
    if not is_distributed():
        return tensor
    device = _comm_device()
    local = tensor.detach().to(device).contiguous()
    sizes = torch.tensor([local.shape[0]], dtype=torch.int64, device=device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world_size())]
    dist.all_gather(all_sizes, sizes)
    lengths = [int(s) for s in all_sizes]
    longest = max(lengths)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(pieces, padded)
    out = torch.cat([p[:n] for p, n in zip(pieces, lengths)])
    return out.to(tensor.device)


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int | None = None) -> None:
    if not is_distributed():
        return
    src = get_source_rank() if src is None else src
    device = _comm_device()
    with torch.no_grad():
        for t in tensors:
            buf = t.detach().to(device).contiguous()
            dist.broadcast(buf, src=src)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)


def broadcast_module(module: nn.Module, src: int | None = None) -> None:
    broadcast_tensors([*module.parameters(), *module.buffers()], src)


def check_same_across_ranks(
    what: str, value: Any, why: str = "every rank must run the same model and recipe"
) -> None:
    """Raise :class:`DistributedMismatchError` on every rank unless all hold an equal
    ``value``."""
    if not is_distributed():
        return
    values = all_gather_object(value)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise DistributedMismatchError(
            f"AdaDSF under torchrun: {what} differs between ranks (rank 0 vs ranks "
            f"{differ}: {_first_difference(values[0], values[differ[0]])}); {why}"
        )


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return f"{key}: {a.get(key)!r} vs {b.get(key)!r}"
    return f"{a!r} vs {b!r}"[:300]


def check_same_model(model: nn.Module, settings: Mapping[str, Any]) -> None:
    """Refuse, before any calibration, ranks with different models or settings (not
    comparing quantization parameters a modifier initialised before: uninitialised
    memory)."""
    if not is_distributed():
        return
    config = getattr(model, "config", None)
    config = {} if config is None else config.to_dict()
    config.pop("_name_or_path", None)
    check_same_across_ranks("the model config", config)
    with torch.no_grad():
        weights = {
            n: (tuple(p.shape), float(p.detach().double().sum()).hex())
            for n, p in model.named_parameters()
            if not (_QPARAM.search(n) or p.is_meta)
        }
    check_same_across_ranks(
        "the model weights (shape, checksum)",
        weights,
        "every rank must load the same checkpoint (a random initialisation needs the "
        "same seed)",
    )
    check_same_across_ranks("the AdaDSFModifier settings", dict(settings))


def agree_on_errors(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it raised on any, raise on every rank (else the others
    would wait in their next collective)."""
    if not is_distributed():
        return fn()
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, on every rank
        error = e
    messages = all_gather_object(
        None if error is None else f"{type(error).__name__}: {error}"
    )
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, message = failed[0]
        if error is not None and r == rank():
            raise error
        raise RuntimeError(f"rank {r} failed: {message}") from error
    return result


def partition_bounds(n: int) -> tuple[int, int]:
    """``(start, end)`` of this rank's share of ``n`` items, split as llm-compressor
    splits its calibration set."""
    r, w = rank(), world_size()
    return math.floor(n * r / w), math.floor(n * (r + 1) / w)


def split_if_identical(
    items: list[T],
    tensors: Callable[[T], Iterable[torch.Tensor]],
    what: str,
    hint: str = "",
) -> list[T]:
    """This rank's share of ``items``: items identical on every rank (by a digest of
    ``tensors(item)``) are split, different ones kept."""
    if not is_distributed():
        return items
    digest = hashlib.sha256()
    for item in items:
        for t in tensors(item):
            t = torch.as_tensor(t).detach().cpu().to(torch.int64)
            digest.update(f"{tuple(t.shape)}".encode() + t.numpy().tobytes())
    gathered = all_gather_object((digest.hexdigest(), len(items)))
    same = all(g == gathered[0] for g in gathered)
    counts = [n for _, n in gathered]
    empty = [r for r, n in enumerate(counts) if n < (len(counts) if same else 1)]
    if empty:
        raise ValueError(
            f"AdaDSF under torchrun: {counts[0] if same else sum(counts)} {what} for "
            f"{len(counts)} ranks{'' if same else f', and ranks {empty} got none'}; "
            f"use at least one per rank{hint}"
        )
    if not same:
        return items
    start, end = partition_bounds(len(items))
    return items[start:end]


def rank_batches(loader: Iterable[Any], seed: int = 0) -> Iterable[Any]:
    """This rank's calibration batches (``loader`` itself in one process).

    llm-compressor 0.14 builds the sampler over the rank's slice of the dataset, but
    the loader still indexes the full dataset, so every rank reads the first rows: here
    batches are read from the slice. A shuffling loader is read once, seeded.
    """
    if not is_distributed():
        return loader
    if isinstance(loader, torch.utils.data.DataLoader):
        loader = _sampled_slice(loader)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batches = list(loader)
    w = world_size()
    hint = f" (num_calibration_samples >= {w} x batch_size)"
    mine = split_if_identical(batches, _batch_tensors, "calibration batches", hint)
    return RankPartition(mine)


def _batch_tensors(batch: Any) -> list[Any]:
    keys = ("input_ids", "attention_mask")
    return [batch[k] for k in keys if isinstance(batch, Mapping) and k in batch]


def _sampled_slice(loader: torch.utils.data.DataLoader) -> Any:
    source = getattr(loader.sampler, "data_source", None)
    if source is None or source is loader.dataset:
        return loader
    if is_source_process():
        logger.info(
            "AdaDSF: llm-compressor's calibration loader reads the first rows of the "
            "full dataset on every rank; AdaDSF reads each rank's own partition. "
            "Later modifiers of the recipe (GPTQ, SmoothQuant) still see those first "
            "rows: give each rank its own slice to change that (docs/distributed.md)"
        )
    return torch.utils.data.DataLoader(
        source,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
    )


def setup_rank(
    model: nn.Module, calib: Iterable[Any], settings: Mapping[str, Any], seed: int = 0
) -> Iterable[Any]:
    """What the modifier does first under ``torchrun``: logs from the source rank only
    (until :func:`restore_logging`), the same model and settings on every rank, this
    rank's calibration batches."""
    if not is_distributed():
        return calib
    if not is_source_process():
        logger.disable("adadsf_modifier")
    check_same_model(model, settings)
    return rank_batches(calib, seed)


def restore_logging() -> None:
    if is_distributed() and not is_source_process():
        logger.enable("adadsf_modifier")


def show_progress() -> bool:  # progress bars on the source rank only
    return is_source_process()
