"""The study's hardware record and its bfloat16 warning: bfloat16 on a CPU without
bfloat16 instructions is emulated (slow, and rounded unlike a CPU with them)."""

from __future__ import annotations

import pytest
import torch

from adadsf_lab.study.hardware import bfloat16_warning, hardware


def _cpu_flags(monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def test_bfloat16_warning_only_for_emulated_bfloat16_on_cpu(monkeypatch):
    _cpu_flags(monkeypatch, False, False)
    emulated = hardware("cpu")
    assert "without bfloat16 instructions" in bfloat16_warning(emulated, "bfloat16")
    assert bfloat16_warning(emulated, "float32") is None
    assert bfloat16_warning({"device": "cuda"}, "bfloat16") is None
    _cpu_flags(monkeypatch, False, True)
    assert bfloat16_warning(hardware("cpu"), "bfloat16") is None


def test_hardware_summary_says_when_bfloat16_is_emulated(monkeypatch):
    _cpu_flags(monkeypatch, False, False)
    info = hardware("cpu")
    assert info["cpu_native_bfloat16"] is False
    assert info["summary"].endswith(", no GPU, no native bfloat16")
    _cpu_flags(monkeypatch, True, False)
    info = hardware("cpu")
    assert info["cpu_native_bfloat16"] is True
    assert "bfloat16" not in info["summary"]
