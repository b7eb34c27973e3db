"""What machine computed a study's runs: stored with every run and in results.json,
so numbers are never read without their hardware."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from adadsf_modifier.precision import cpu_has_native_bfloat16

__all__ = ["bfloat16_warning", "hardware"]


def hardware(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "device": device,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device == "cpu":
        info["cpu_native_bfloat16"] = cpu_has_native_bfloat16()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ", no GPU"
    bf16 = "" if info.get("cpu_native_bfloat16", True) else ", no native bfloat16"
    info["summary"] = (
        f"{cpu}, {info['cpu_count']} CPUs, torch threads {info['torch_threads']}"
        f"{gpu}{bf16}"
    )
    return info


def bfloat16_warning(hw: dict[str, Any], dtype: str) -> str | None:
    """A warning, before any run, when bfloat16 is asked of a CPU that emulates it;
    ``hw`` is :func:`hardware`'s record (a GPU's has no ``cpu_native_bfloat16``)."""
    if dtype != "bfloat16" or hw.get("cpu_native_bfloat16", True):
        return None
    return (
        "dtype=bfloat16 on a CPU without bfloat16 instructions (no AVX512-BF16, no "
        "AMX): torch emulates it, several times slower than float32, and its numbers "
        "differ from a CPU that has them; use --set dtype=float32 here, or a machine "
        "with AMX/AVX512-BF16 to resume a bfloat16 study computed on one"
    )
