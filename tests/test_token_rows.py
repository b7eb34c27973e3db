"""Calibration and alignment rows whose token ids fall outside the vocabulary (or are
negative), or whose attention mask is not as long as their ids, are refused in one
line naming the row before calibration starts: not an ``IndexError`` inside the
embedding, an SDPA size error, or (for ``align_dataset``) a refusal after calibration
and routing."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from llmcompressor import oneshot
from test_ftp_routing import calib_batches
from tiny_models import VOCAB, save_tiny_model, tiny_model
from transformers import AutoModelForCausalLM

import adadsf_modifier.ftp.features as ftp_features
import adadsf_modifier.modifier as modifier_module
from adadsf_modifier import AdaDSFModifier, FTPModifier
from adadsf_modifier.constraints import InputError
from adadsf_modifier.token_rows import check_token_rows

pytestmark = pytest.mark.usefixtures("single_thread")

GOOD = [[5, 6, 7, 8, 9, 10, 11, 12]] * 4
ONES = [[1] * 8] * 4
# case: (input_ids, attention_mask, the bad row, what the message says of it)
BAD_ROWS = {
    "past_the_vocabulary": ([GOOD[0], GOOD[1][:7] + [VOCAB + 3]] + GOOD[2:], ONES, 1,
                            f"token id {VOCAB + 3} is outside"),
    "negative": ([GOOD[0], GOOD[1], GOOD[2][:7] + [-1]] + GOOD[3:], ONES, 2,
                 "token id -1 is outside"),
    "mask_longer": (GOOD, [[1] * 10] + ONES[1:], 0, r"attention_mask has shape "
                    r"\((1, )?10,?\) but its input_ids \((1, )?8,?\)"),
    "mask_shorter": (GOOD, ONES[:3] + [[1] * 6], 3, r"attention_mask has shape "
                     r"\((1, )?6,?\)"),
}  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("rows") / "m"), 2)


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if the dense calibration starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("calibration started before the rows were checked")

    monkeypatch.setattr(modifier_module, "run_calibration_batches", refuse)
    monkeypatch.setattr(ftp_features, "run_calibration_batches", refuse)


def _oneshot(path, modifier, ids, mask):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": mask})
    oneshot(model=model, recipe=[modifier], dataset=dataset,
            num_calibration_samples=len(ids), max_seq_length=16)  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_calibration_rows_are_refused_before_calibration(
    llama_dir, no_calibration, case
):
    ids, mask, _, says = BAD_ROWS[case]
    # the loader shuffles the rows into batches of one: which batch is not known
    with pytest.raises(InputError, match=r"calibration batch \d+: " + says):
        _oneshot(llama_dir, AdaDSFModifier(retention=0.6), ids, mask)


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_align_dataset_rows_are_refused_before_calibration(
    llama_dir, no_calibration, case
):
    ids, mask, row, says = BAD_ROWS[case]
    rows = Dataset.from_dict({"input_ids": ids, "attention_mask": mask})
    modifier = AdaDSFModifier(retention=0.6, align_steps=1, align_dataset=rows)
    with pytest.raises(InputError, match=f"align_dataset row {row}: " + says):
        _oneshot(llama_dir, modifier, GOOD, ONES)


def test_ftp_refuses_bad_calibration_rows_before_its_features(no_calibration):
    batches = calib_batches()
    batches[1]["input_ids"][0, 3] = VOCAB
    with pytest.raises(InputError, match=f"calibration batch 1: token id {VOCAB} "):
        FTPModifier(retention=0.6, schedule="uniform").apply_to(
            tiny_model("llama", num_layers=2), batches
        )


def test_rows_without_ids_or_with_non_integer_ids():
    with pytest.raises(InputError, match=r"batch 0: needs an `input_ids` column"):
        check_token_rows([{"text": "x"}], VOCAB, "batch")
    with pytest.raises(InputError, match="must be integers, got torch.float32"):
        check_token_rows([{"input_ids": [1.5, 2.0]}], VOCAB, "batch")
    with pytest.raises(InputError, match="`input_ids` is not a list of integers"):
        check_token_rows([{"input_ids": [[1, 2], [3]]}], VOCAB, "batch")


def test_good_rows_pass_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    loader = torch.utils.data.DataLoader(
        [{"input_ids": torch.tensor(r)} for r in GOOD], shuffle=True, batch_size=2
    )
    assert check_token_rows(loader, VOCAB, "calibration batch") == 2
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_one_shot_iterator_is_left_whole_for_the_stage_that_reads_it():
    rows = ({"input_ids": [VOCAB + 1]} for _ in range(2))
    assert check_token_rows(rows, VOCAB, "align_dataset row") == 0
    assert len(list(rows)) == 2
