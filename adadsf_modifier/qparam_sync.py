"""Make every rank wait for the quantization parameters the other ranks computed.

Under ``torchrun`` llm-compressor 0.14's GPTQ and ``QuantizationModifier`` split the
modules between ranks, then ``broadcast_qparams_and_cleanup`` broadcasts each one's
qparams from its owner, except on CPU: those live in compressed-tensors'
``DistributedCPUCache``, shared memory updated asynchronously, and nothing calls the
``dist.barrier()`` it needs after, so a rank could read scales not yet written.
:func:`install` adds the barrier; ``tests/test_qparam_sync.py`` flags an upgrade of
:data:`TARGETS`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

TARGETS: dict[str, str] = {"llmcompressor": "0.14", "compressed-tensors": "0.19"}
# The modules that imported broadcast_qparams_and_cleanup by name.
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
    """Wrap ``broadcast_qparams_and_cleanup`` where the modifiers call it, once."""
    for name in _USERS:
        module = importlib.import_module(name)
        fn = getattr(module, "broadcast_qparams_and_cleanup", None)
        if fn is not None and not getattr(fn, _MARK, False):
            module.broadcast_qparams_and_cleanup = _synced(fn)
