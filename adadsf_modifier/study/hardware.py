"""What machine computed a study's runs: stored with every run and in results.json,
so numbers are never read without their hardware."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["hardware"]


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
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ", no GPU"
    info["summary"] = (
        f"{cpu}, {info['cpu_count']} CPUs, torch threads {info['torch_threads']}{gpu}"
    )
    return info
