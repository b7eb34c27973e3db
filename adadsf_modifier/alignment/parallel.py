"""Data parallelism of the alignment stage under ``torchrun`` (llm-compressor has no
training): each rank trains on its own rows, gradients are averaged every step, and the
weights stay identical on every rank. ``align_parallel`` chooses how:

* ``ddp``: ``DistributedDataParallel`` around the student; every rank holds the whole
  student and teacher. The trainable parameters are broadcast from the source rank
  (DDP's start-up broadcast of the whole model is skipped: the ranks were checked to
  hold the same model).
* ``fsdp``: FSDP2 ``fully_shard`` of every decoder layer and the root, for when student
  and teacher do not fit one device together. The student is never made an FSDP
  module: a *shell* (new module objects, parameters aliasing the student's storage) is
  sharded and trained while the student's own parameters are emptied; after the last
  step each is gathered back into the student's own ``nn.Parameter``. The teacher is
  sharded in place (it is dropped after the stage).

Each rank's loss is weighted by its share of the step's real tokens, so the averaged
gradient (and the logged loss) is the mean over all ranks' tokens, as one process
training on the concatenated batch would get.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.alignment.config import AlignmentDivergedError
from adadsf_modifier.routing import decoder_layers, routed_layers


@dataclasses.dataclass
class ParallelRun:
    """What the training loop calls, updates (FSDP: the shell's sharded parameters) and
    feeds, under one parallel setting."""

    student: nn.Module
    teacher: nn.Module | None
    params: list[nn.Parameter]
    device: torch.device
    world: int = 1

    def token_share(self, attention_mask: torch.Tensor) -> float | None:
        """``world * local real tokens / all ranks' real tokens``, the factor on this
        rank's loss (``None`` in one process)."""
        if self.world == 1:
            return None
        local = int(attention_mask.sum())
        total = distributed.sum_across_ranks([local])[0]
        return self.world * local / max(total, 1)

    def global_values(
        self, values: Mapping[str, float], share: float | None
    ) -> dict[str, float]:
        """The token-weighted mean of each logged value over the ranks."""
        if share is None:
            return dict(values)
        keys = list(values)
        local = torch.tensor([values[k] * share / self.world for k in keys])
        summed = distributed.sum_across_ranks(local.double()).tolist()
        return dict(zip(keys, summed))


def check_parallel_supported(model: nn.Module, mode: str) -> None:
    """Refuse, before calibration, a parallel setting this model cannot train with."""
    if not distributed.is_distributed():
        return
    import torch.distributed as dist

    on_cpu = next(model.parameters()).device.type == "cpu"
    if mode == "ddp" and dist.get_backend() == "nccl" and on_cpu:
        raise ValueError(
            "align_parallel=ddp under NCCL needs the model on this rank's GPU "
            "(model.to(f'cuda:{LOCAL_RANK}')); or keep it on the CPU and use "
            "align_parallel=fsdp, which trains sharded copies on the GPUs"
        )
    wrapped = [n for n, m in model.named_modules() if "forward" in vars(m)]
    if mode == "fsdp" and wrapped:
        raise ValueError(
            f"align_parallel=fsdp: module `{wrapped[0] or type(model).__name__}` has a "
            "per-instance forward (an offloaded or dispatched model), which FSDP2 "
            "cannot shard; load the model without offloading, or use "
            "align_parallel=ddp"
        )


@contextlib.contextmanager
def data_parallel(
    student: nn.Module,
    teacher: nn.Module | None,
    params: Sequence[nn.Parameter],
    mode: str,
    device: torch.device,
) -> Iterator[ParallelRun]:
    """The student, teacher and parameters to train under ``mode``; its inputs outside
    ``torchrun``. Enter it after setting the trainable parameters' ``requires_grad``."""
    params = list(params)
    if not distributed.is_distributed():
        yield ParallelRun(student, teacher, params, device)
        return
    if mode == "fsdp":
        with _fsdp(student, teacher, params) as run:
            yield run
        return
    yield from _ddp(student, teacher, params, device)


def _ddp(student, teacher, params, device) -> Iterator[ParallelRun]:
    from torch.nn.parallel import DistributedDataParallel

    distributed.broadcast_tensors(params)
    # removed layers (ratio 0) never call their router: its gradient never comes
    unused = any(m.retention_ratio <= 0.0 for m in routed_layers(student))
    ddp = DistributedDataParallel(
        student,
        device_ids=[device.index] if device.type == "cuda" else None,
        init_sync=False,  # no start-up broadcast of the whole model
        forward_sync_buffers=False,
        find_unused_parameters=unused,
    )
    run = ParallelRun(ddp, teacher, params, device, distributed.world_size())
    del ddp
    try:
        yield run
    finally:
        # the last reference: the wrapper's reducer, and with it the gradient hooks it
        # put on the parameters, goes now
        run.student = student


@contextlib.contextmanager
def _fsdp(student, teacher, params) -> Iterator[ParallelRun]:
    from torch.distributed.fsdp import fully_shard

    shell, aliases = _shell(student)
    own = list({id(p): p for p in student.parameters()}.values())  # tied: once
    where = _locations(shell, [aliases[id(p)] for p in own])
    del aliases  # FSDP replaces the shell's aliases with shards: none is left
    for model in (shell, teacher):
        if model is not None:
            for _, layer in decoder_layers(model)[1]:
                fully_shard(layer)
            fully_shard(model)
    shards = {id(p): getattr(module, name) for p, (module, name) in zip(own, where)}
    for p in own:  # the student's own copy is rebuilt from the shards afterwards
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    mine = [shards[id(p)] for p in params]
    run = ParallelRun(shell, teacher, mine, mine[0].device, distributed.world_size())
    try:
        yield run
    except AlignmentDivergedError:  # a decision all ranks took: all can gather
        _restore(own, shards)  # the last good values
        raise
    # Any other failure may be this rank's alone: gathering would wait for ranks that
    # never come, so the student is left without weights (any use fails loudly).
    _restore(own, shards)


def _restore(own: Sequence[nn.Parameter], shards: Mapping[int, nn.Parameter]):
    """Every parameter of the student, gathered from its shards (in place)."""
    with torch.no_grad():
        for p in own:
            p.data = shards[id(p)].full_tensor().to(device=p.device, dtype=p.dtype)


def _locations(model: nn.Module, params: Sequence[nn.Parameter]):
    """``(module, name)`` under which each of ``params`` is registered in ``model``."""
    found = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), (module, name))
    return [found[id(p)] for p in params]


def _shell(model: nn.Module) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """A structural copy of ``model`` for FSDP to shard (every module a new object with
    its own dicts, every parameter a new ``nn.Parameter`` on the original storage, tied
    ones still tied), and ``id(original parameter) -> its alias``."""
    aliases: dict[int, nn.Parameter] = {}
    modules: dict[int, nn.Module] = {}

    def alias(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in aliases:
            aliases[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
        return aliases[id(p)]

    def clone(m: nn.Module) -> nn.Module:
        if id(m) in modules:
            return modules[id(m)]
        c = copy.copy(m)
        modules[id(m)] = c
        for key, value in vars(m).items():
            if isinstance(value, (dict, set)):  # hooks, non-persistent buffer names
                c.__dict__[key] = copy.copy(value)
        c._parameters = {
            n: None if p is None else alias(p) for n, p in m._parameters.items()
        }
        c._buffers = {
            n: None if b is None else b.detach() for n, b in m._buffers.items()
        }
        c._modules = {
            n: None if ch is None else clone(ch) for n, ch in m._modules.items()
        }
        return c

    return clone(model), aliases
