"""The frozen dense teacher of the alignment stage, and freeing it afterwards."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn


def make_teacher(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` (taken before routing). A copy, not shared
    modules, so that training the student's layers can never move the teacher; it is
    checked to share no storage with the student."""
    teacher = copy.deepcopy(model)
    teacher.eval()
    teacher.requires_grad_(False)
    student_ptrs = {
        t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()
    }
    shared = [
        n
        for n, t in (*teacher.named_parameters(), *teacher.named_buffers())
        if t.numel() and t.data_ptr() in student_ptrs
    ]
    if shared:
        raise RuntimeError(
            f"teacher copy shares storage with the student: {shared[:5]}"
        )
    return teacher


def release_memory() -> None:
    """Collect garbage (and empty the CUDA cache) after the teacher has been dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
