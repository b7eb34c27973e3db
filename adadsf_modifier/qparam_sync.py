"""Make every rank wait for the quantization parameters the other ranks computed.

Under ``torchrun``, llm-compressor 0.14's GPTQ (and ``QuantizationModifier``) splits
the modules of each subgraph between the ranks, quantizes its own, then calls
``llmcompressor.utils.dist.broadcast_qparams_and_cleanup``, which broadcasts each
module's ``weight``/``weight_scale``/... from its owning rank, except for modules whose
execution device is the CPU (``skip_cpu=True``, the default). Those live in
compressed-tensors' ``DistributedCPUCache``: shared memory that the owning rank
updates in place, and whose ``update_offload`` documents "performed asynchronously. If
you need the offloaded value to update across all ranks, call ``dist.barrier()``
after". Nothing does, so on a CPU run a rank can go on, propagate the next calibration
pass through, or save, modules the other rank has not finished writing: it then reads
the ``torch.empty`` scales the owner has not filled yet (uninitialised memory, values
such as ``-5.3e36``), now and then, on a loaded machine
(``integration_tests/test_distributed_torchrun.py`` runs two CPU ranks).

:func:`install` wraps that function, where the two modifiers imported it, so that
every rank waits at a barrier after it: the owners' writes are then complete and
visible everywhere. On a GPU (broadcast path) the barrier costs one round trip per
subgraph. Targets llm-compressor 0.14 and compressed-tensors 0.19
(:data:`TARGETS`; ``tests/test_qparam_sync.py`` flags an upgrade).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["TARGETS", "install"]

TARGETS: dict[str, str] = {"llmcompressor": "0.14", "compressed-tensors": "0.19"}
"""Releases (major.minor) this workaround was written against."""

#: Modules that imported ``broadcast_qparams_and_cleanup`` by name.
_USERS = (
    "llmcompressor.modifiers.gptq.base",
    "llmcompressor.modifiers.quantization.quantization.base",
)
_MARK = "_adadsf_synced"


def _synced(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def broadcast_qparams_and_cleanup(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the owners' in-place writes are done on every rank
        return out

    setattr(broadcast_qparams_and_cleanup, _MARK, True)
    return broadcast_qparams_and_cleanup


def install() -> None:
    """Wrap ``broadcast_qparams_and_cleanup`` where the modifiers call it (once per
    process; a module that no longer has it is left alone)."""
    for name in _USERS:
        module = importlib.import_module(name)
        fn = getattr(module, "broadcast_qparams_and_cleanup", None)
        if fn is not None and not getattr(fn, _MARK, False):
            module.broadcast_qparams_and_cleanup = _synced(fn)
