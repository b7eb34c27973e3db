"""Wall-clock seconds per stage of a modifier's construction (what users budget for)."""

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
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        return f"{parts} (total {sum(self.seconds.values()):.0f} s)"
