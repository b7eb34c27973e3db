"""Wall-clock time per stage of a modifier's construction, recorded by the modifier
(what users budget for; ``benchmarks/compress_cost.py`` reports it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageClock:
    """Seconds per named stage (a stage entered twice adds up), in order of first
    run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed

    def summary(self) -> str:
        """``"calibration 16 s, thresholds 20 s (total 36 s)"``."""
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        return f"{parts} (total {sum(self.seconds.values()):.0f} s)"
