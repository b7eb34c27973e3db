"""The alignment stage's peak memory, measured from the stage's start.

On CUDA the allocator's peak resets. On a CPU the process's peak resident set
(``ru_maxrss``) covers its whole life, so a run after a larger one in the same process
would report that one's peak; where Linux allows, ``/proc/self/clear_refs`` resets it
and ``VmHWM`` reports it. The report says which measure it gave.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak for ``device``; ``False`` where only the process-lifetime peak
    is available (a CPU without a writable ``/proc/self/clear_refs``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size
    except OSError:
        return False
    return _vm_hwm_kib() is not None


def peak_memory_mb(device: torch.device, was_reset: bool) -> tuple[float, str]:
    """The peak since :func:`reset_peak_memory` (MB), and what it measured."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "peak CUDA allocated"
    hwm = _vm_hwm_kib() if was_reset else None
    if hwm is not None:
        return hwm / 2**10, "peak RSS during alignment"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (Linux), B (macOS)
    return (
        rss / (2**20 if sys.platform == "darwin" else 2**10),
        "peak process RSS (since the process began)",
    )


def _vm_hwm_kib() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
