"""Is bfloat16 native on this CPU? The studies' CPU runs are bfloat16; a CPU without
AVX512-BF16/AMX emulates it. Prints the flags and a float32-vs-bfloat16 matmul the size
of SmolLM2-135M's MLP on 512 tokens, interleaved, medians (``lab/NOTEBOOK.md``
§14).

    OMP_NUM_THREADS=2 python benchmarks/bf16_cpu.py
"""

from __future__ import annotations

import statistics
import time

import torch

from adadsf_modifier.precision import cpu_has_native_bfloat16


def main(repeats: int = 30) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(512, 576), torch.randn(1536, 576)
    pairs = {dt: (x.to(dt), w.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in pairs}
    for a, b in pairs.values():
        a @ b.T  # warm-up
    for _ in range(repeats):
        for dt, (a, b) in pairs.items():
            t = time.perf_counter()
            a @ b.T
            times[dt].append(time.perf_counter() - t)
    f32, bf16 = (statistics.median(times[dt]) for dt in pairs)
    print(
        f"capability {torch.backends.cpu.get_cpu_capability()}, native bfloat16 "
        f"{cpu_has_native_bfloat16()}, threads {torch.get_num_threads()}"
    )
    print(f"matmul 512x576 @ 576x1536: bfloat16 / float32 time = {bf16 / f32:.2f}x")


if __name__ == "__main__":
    main()
