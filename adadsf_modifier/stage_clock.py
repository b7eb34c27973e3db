"""Wall-clock time per stage of a modifier's construction.

Building a routed model costs several passes over the calibration data (calibration,
router fits, skip-path fits, alignment, thresholds); how that compares with a dense
forward pass over the same data is what users budget for and what the compress-cost
benchmark (``benchmarks/compress_cost.py``) reports, so the modifier records each
stage's seconds itself instead of leaving them to be read off log timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StageClock"]


class StageClock:
    """Seconds spent in each named stage (a stage entered twice adds up), in the
    order the stages first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` (also when it raises)."""
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
