"""The alignment stage's peak memory is its own, not the process's lifetime peak."""

from __future__ import annotations

import pytest
import torch

from adadsf_modifier.alignment import peak_memory


def test_a_stage_after_a_larger_one_reports_its_own_peak_on_cpu():
    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB resident
    big.add_(1)
    del big
    lifetime = peak_memory.peak_memory_mb(cpu, was_reset=False)[0]
    if not peak_memory.reset_peak_memory(cpu):
        pytest.skip("this kernel does not let a process reset its peak RSS")
    small = torch.ones(8 * 2**20, dtype=torch.uint8)
    small.add_(1)
    mb, kind = peak_memory.peak_memory_mb(cpu, was_reset=True)
    del small
    assert kind == "peak RSS during alignment"
    # the 64 MiB freed before the reset no longer count; the 8 MiB after it do
    assert mb < lifetime - 32
    assert mb >= 8


def test_without_a_reset_the_report_says_it_is_the_process_lifetime_peak(monkeypatch):
    monkeypatch.setattr(peak_memory, "_CLEAR_REFS", peak_memory.Path("/nonexistent/x"))
    cpu = torch.device("cpu")
    assert peak_memory.reset_peak_memory(cpu) is False
    mb, kind = peak_memory.peak_memory_mb(cpu, was_reset=False)
    assert kind == "peak process RSS (since the process began)"
    assert mb > 0
