"""Which floating-point precision to load a model in on this machine: bfloat16 only
where the device has bfloat16 instructions (emulated, it is slower than float32 and
rounds differently)."""

from __future__ import annotations

import torch

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "auto")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """``float32``/``bfloat16`` as asked; ``auto``: bfloat16 where ``device`` (default:
    CUDA when available, else the CPU) has bfloat16 instructions, else float32."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        native = torch.cuda.is_bf16_supported()
    else:
        native = cpu_has_native_bfloat16()
    return torch.bfloat16 if native else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
