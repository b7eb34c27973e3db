"""The speed benchmark's plumbing on tiny models (no timing is asserted: only what it
reports)."""

import pytest
import torch
from compressed_tensors.offload import remove_dispatch, set_onload_device
from test_causal_routing import causal_model
from tiny_models import tiny_model

from adadsf_modifier.evaluation.speed import (
    format_table,
    is_dispatched,
    run_speed_benchmark,
)


def pair():
    """A calibrated routed tiny Llama and its dense twin (same seed, so the same
    weights)."""
    routed, _ = causal_model("llama")
    return tiny_model("llama"), routed


def test_benchmark_reports_every_cell_with_consistent_ratios():
    dense, routed = pair()
    stream = torch.randint(4, 128, (500,), generator=torch.Generator().manual_seed(1))
    results = run_speed_benchmark(
        dense,
        routed,
        stream,
        seq_lens=(8, 16),
        batch_sizes=(1, 2),
        decode_prompt=6,
        decode_tokens=3,
        repeats=2,
    )
    kinds = [(r.kind, r.batch_size, r.seq_len) for r in results]
    assert kinds == [
        ("prefill", 1, 8),
        ("prefill", 2, 8),
        ("prefill", 1, 16),
        ("prefill", 2, 16),
        ("decode", 1, 6),
        ("decode", 2, 6),
    ]
    for r in results:
        assert r.speedup == pytest.approx(r.dense_s / r.routed_s)
        assert r.flops_ideal == pytest.approx(1.0 / r.normalized_flops)
        assert 0.0 < r.normalized_flops < 1.0  # some tokens skipped some layers
        assert r.flops_ideal_with_lm_head < r.flops_ideal
    table = format_table(results)
    assert table.count("\n") == 1 + len(results)


def test_benchmark_refuses_models_in_different_dispatch_states():
    dense, routed = pair()
    set_onload_device(
        routed, "cpu"
    )  # what llm-compressor's pipelines leave after oneshot
    assert is_dispatched(routed) and not is_dispatched(dense)
    stream = torch.randint(4, 128, (100,))
    with pytest.raises(ValueError, match="remove_dispatch"):
        run_speed_benchmark(
            dense, routed, stream, seq_lens=(8,), batch_sizes=(1,), repeats=1
        )
    remove_dispatch(routed, onload_tensors=True)
    assert not is_dispatched(routed)


def test_zero_decode_tokens_skips_decoding():
    dense, routed = pair()
    stream = torch.randint(4, 128, (200,), generator=torch.Generator().manual_seed(1))
    results = run_speed_benchmark(
        dense, routed, stream, seq_lens=(8,), batch_sizes=(1,), decode_tokens=0,
        repeats=1,
    )  # fmt: skip
    assert [r.kind for r in results] == ["prefill"]


@pytest.mark.parametrize(
    "grid, message",
    [
        (dict(seq_lens=(0,)), "seq_len 0"),
        (dict(batch_sizes=(1, 0)), "batch size 0"),
        (dict(batch_sizes=()), "no batch sizes"),
        (dict(repeats=0), "repeats 0"),
        (dict(decode_tokens=-1), "decode_tokens -1"),
        (dict(decode_prompt=0), "decode_prompt 0"),
        (dict(decode_repeats=0), "decode_repeats 0"),
    ],
)
def test_unmeasurable_grids_are_refused_before_any_forward(grid, message):
    calls = []

    class Counting(torch.nn.Module):
        def forward(self, *args, **kwargs):
            calls.append(1)

    kwargs = dict(seq_lens=(8,), batch_sizes=(1,), decode_prompt=4, decode_tokens=2)
    kwargs.update(grid)
    with pytest.raises(ValueError, match=message):
        run_speed_benchmark(Counting(), Counting(), torch.arange(100), **kwargs)
    assert not calls
