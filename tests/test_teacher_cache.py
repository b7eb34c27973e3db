"""``align_teacher_cache``: the teacher's outputs kept per row equal a fresh forward,
training with them matches training without, and what it cannot do is refused early."""

from __future__ import annotations

import pytest
import torch
from llmcompressor import oneshot
from test_alignment import config, routed_pair, router_state, snapshot
from tiny_models import VOCAB, save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier.alignment.teacher_cache as tc
from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.alignment import (
    AlignmentConfig,
    RowBatcher,
    align_model,
    training_rows,
)
from adadsf_modifier.alignment.teacher_cache import TeacherCache
from adadsf_modifier.alignment.trainer import _forward


def _rows(n=6, lengths=(16, 9, 12, 16, 5, 11)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, VOCAB, (k,), generator=g) for k in lengths[:n]]


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("need_hidden", [True, False])
def test_cached_outputs_equal_a_fresh_teacher_forward_on_new_batch_compositions(
    arch, need_hidden
):
    _, teacher = routed_pair(arch)
    rows = _rows()
    cache = TeacherCache(teacher, rows, need_hidden, _forward, torch.device("cpu"))
    batcher = RowBatcher(rows, 4, seed=1)  # 6 rows, batches of 4: they recombine
    with torch.no_grad():
        for _ in range(6):
            batch = batcher.next_batch()
            logits, hidden = cache.outputs(batch)
            ref_logits, ref_hidden = _forward(teacher, batch, True)
            real = batch["attention_mask"].bool()
            torch.testing.assert_close(logits[real], ref_logits[real])
            if need_hidden:
                assert (
                    len(hidden) == len(ref_hidden) == teacher.config.num_hidden_layers
                )
                for h, r in zip(hidden, ref_hidden):
                    torch.testing.assert_close(h[real], r[real])
            else:
                assert hidden is None
    assert cache.reused > 0 and cache.computed + cache.reused == 6


def test_one_epoch_is_bit_identical_and_later_epochs_match_without_the_cache():
    data = token_dataset(4, 16)
    runs, reports = [], []
    for cached, steps in ((False, 2), (True, 2), (False, 6), (True, 6)):
        student, teacher = routed_pair()
        reports.append(
            align_model(
                student,
                teacher,
                data,
                config(steps=steps, batch_size=2, teacher_cache=cached),
            )
        )
        runs.append(router_state(student))
    for k in runs[0]:  # one epoch: no row comes back, so no cache is built at all
        assert torch.equal(runs[0][k], runs[1][k]), k
    for k in runs[2]:  # three epochs: the last two read the cache
        torch.testing.assert_close(runs[2][k], runs[3][k], rtol=1e-4, atol=1e-5)
    assert reports[0].teacher_batches is None and reports[1].teacher_batches is None
    assert reports[3].teacher_batches == 2 and reports[3].steps == 6
    torch.testing.assert_close(
        torch.tensor(reports[2].losses), torch.tensor(reports[3].losses), rtol=1e-4,
        atol=1e-5,
    )  # fmt: skip


def test_logits_that_are_not_the_head_of_the_last_state_are_refused():
    _, teacher = routed_pair()
    forward = teacher.forward

    def scaled(*a, **kw):  # a scaled head (as Cohere's logit_scale), say
        out = forward(*a, **kw)
        out.logits = out.logits / 0.7 + 0.01
        return out

    teacher.forward = scaled
    rows = _rows(4, (16, 16, 16, 16))
    cache = TeacherCache(teacher, rows, False, _forward, torch.device("cpu"))
    with pytest.raises(ValueError, match="not its output embedding"):
        cache.outputs(RowBatcher(rows, 2, seed=0).next_batch())


def test_a_cache_larger_than_half_the_free_memory_is_refused(monkeypatch):
    _, teacher = routed_pair()
    rows = _rows()
    need = tc.teacher_cache_bytes(rows, teacher, True)
    assert need == sum(map(len, rows)) * 32 * 4 * 4  # tokens x hidden x layers x fp32
    monkeypatch.setattr(tc, "_free_bytes", lambda device: 2 * need - 1)
    with pytest.raises(MemoryError, match="align_teacher_cache needs"):
        TeacherCache(teacher, rows, True, _forward, torch.device("cpu"))
    monkeypatch.setattr(tc, "_free_bytes", lambda device: 2 * need)
    TeacherCache(teacher, rows, True, _forward, torch.device("cpu"))


def test_the_modifier_refuses_a_cache_that_does_not_fit_before_calibration(
    tmp_path, monkeypatch
):
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=4)
    import adadsf_modifier.modifier as modifier_module

    monkeypatch.setattr(tc, "_free_bytes", lambda device: 1024)

    def no_calibration(*a, **kw):
        raise AssertionError("calibration must not start")

    monkeypatch.setattr(modifier_module.AdaDSFModifier, "_calibrate", no_calibration)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = snapshot(model)
    mod = AdaDSFModifier(retention=0.6, align_steps=3, align_batch_size=4,
                         align_teacher_cache=True)  # 12 > 8 rows  # fmt: skip
    with pytest.raises(MemoryError, match="align_teacher_cache needs"):
        oneshot(model=model, recipe=[mod], dataset=token_dataset(8, 16),
                num_calibration_samples=8, max_seq_length=16)  # fmt: skip
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_modifier_trains_with_the_cache_as_it_does_without(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=4)
    states, reports = [], []
    for cached in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        mod = AdaDSFModifier(retention=0.6, align_steps=6, align_batch_size=4,
                             align_seq_len=16, align_teacher_cache=cached)  # fmt: skip
        oneshot(model=model, recipe=[mod], dataset=token_dataset(8, 16),
                num_calibration_samples=8, max_seq_length=16)  # fmt: skip
        states.append(router_state(model))
        reports.append(mod.alignment_report)
    for k in states[0]:
        torch.testing.assert_close(states[0][k], states[1][k], rtol=1e-4, atol=1e-5)
    assert reports[1].teacher_batches == 2  # 8 rows, batches of 4: one epoch


def test_fsdp_with_the_cache_is_refused():
    with pytest.raises(ValueError, match="teacher_cache cannot be used"):
        AlignmentConfig(align_steps=2, align_teacher_cache=True, align_parallel="fsdp")


def test_lm_only_alignment_builds_no_cache():
    student, _ = routed_pair()
    report = align_model(student, None, token_dataset(4, 16),
                         config(steps=2, loss="lm", teacher_cache=True))  # fmt: skip
    assert report.teacher_batches is None


def test_rows_are_named_in_every_batch():
    rows = training_rows(token_dataset(5, 8), 8)
    batcher = RowBatcher(rows, 2, seed=0)
    seen = []
    for _ in range(5):
        b = batcher.next_batch()
        for i, ids in zip(b["row_index"].tolist(), b["input_ids"]):
            assert torch.equal(ids, rows[i])
            seen.append(i)
    assert sorted(seen) == sorted(list(range(5)) * 2)


def test_rows_are_read_again_only_past_one_pass():
    assert not tc.rows_read_again(800, 100, 8)  # the study: one pass of fresh rows
    assert tc.rows_read_again(128, 100, 8)  # the modifier's 128 calibration rows
    assert tc.rows_read_again(8, 2, 4) is False and tc.rows_read_again(8, 3, 4)
    assert tc.rows_read_again(3, 2, 8)  # fewer rows than a batch: all, every step


def test_one_pass_over_the_rows_builds_no_cache_and_says_so(
    monkeypatch, logged_warnings
):
    student, teacher = routed_pair()
    built = []
    monkeypatch.setattr(
        "adadsf_modifier.alignment.trainer.TeacherCache",
        lambda *a, **kw: built.append(a) or TeacherCache(*a, **kw),
    )
    cfg = config(steps=2, batch_size=4, teacher_cache=True)  # 8 rows, once
    report = align_model(student, teacher, token_dataset(8, 16), cfg)
    assert not built and report.teacher_batches is None  # the teacher ran every step
    assert any("align_teacher_cache not used" in m for m in logged_warnings)


def test_the_modifier_skips_the_memory_check_of_a_cache_it_will_not_build(
    tmp_path, monkeypatch
):
    path = save_tiny_model("llama", str(tmp_path / "m"), num_layers=4)
    monkeypatch.setattr(tc, "_free_bytes", lambda device: 1024)  # no cache would fit
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mod = AdaDSFModifier(retention=0.6, align_steps=2, align_batch_size=4,
                         align_seq_len=16, align_teacher_cache=True)  # fmt: skip
    oneshot(model=model, recipe=[mod], dataset=token_dataset(8, 16),
            num_calibration_samples=8, max_seq_length=16)  # fmt: skip
    assert mod.alignment_report.teacher_batches is None
