"""``adadsf study --quick``: the study's settings shrunk for a CPU smoke test."""

from __future__ import annotations

from typing import Any

from adadsf_lab.study.settings import StudySettings

__all__ = ["quick_settings"]


def quick_settings(**overrides: Any) -> StudySettings:
    """One seed, budget 0.8 and tiny limits: every method through the whole pipeline
    (one run each; ``adadsf study --quick --plan`` prints how many and its time
    estimate, the W8A8 arms the slowest). A smoke test: its numbers are not evidence
    of anything.
    ``overrides`` (e.g. ``budgets`` or ``methods``) replace any of it."""
    base: dict[str, Any] = dict(
        seeds=1,
        budgets=(0.8,),
        calib_samples=8,
        calib_seq_len=128,
        router_init_steps=20,
        router_init_tokens=256,
        align_steps=2,
        align_batch_size=1,
        align_seq_len=64,
        tune_lrs=(3e-4, 1e-3),
        tune_temperatures=(0.05,),
        ppl_tokens=1024,
        ppl_val_tokens=512,
        ppl_max_length=256,
        ppl_stride=256,
        task_limit=2,
        flops_batch=1,
        flops_seq_len=256,
        speed_seq_len=128,
        speed_batch_sizes=(1,),
        speed_repeats=1,
        decode_prompt=32,
        decode_tokens=2,
    )
    base.update(overrides)
    return StudySettings(**base)
