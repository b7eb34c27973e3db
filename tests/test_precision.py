"""The precision a model is loaded in: ``auto`` is bfloat16 only where the hardware
has bfloat16 instructions (emulated bfloat16 is slower than float32 on a CPU)."""

from __future__ import annotations

import pytest
import torch

from adadsf_modifier.precision import cpu_has_native_bfloat16, resolve_dtype


def _cpu_flags(monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native"),
    [(False, False, False), (True, False, True), (False, True, True)],
)
def test_native_bfloat16_follows_the_cpu_flags(monkeypatch, avx512_bf16, amx, native):
    _cpu_flags(monkeypatch, avx512_bf16, amx)
    assert cpu_has_native_bfloat16() is native


@pytest.mark.parametrize(("amx", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_auto_is_bfloat16_only_on_a_cpu_with_bfloat16_instructions(
    monkeypatch, amx, expected
):
    _cpu_flags(monkeypatch, False, amx)
    assert resolve_dtype("auto", "cpu") == getattr(torch, expected)


def test_auto_on_cuda_asks_the_gpu(monkeypatch):
    _cpu_flags(monkeypatch, False, True)  # the CPU's flags do not decide for a GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16


def test_explicit_dtypes_are_kept_whatever_the_hardware(monkeypatch):
    _cpu_flags(monkeypatch, False, False)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")
