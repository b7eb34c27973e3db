"""FTP's static router: the first token (the attention sink) and the last few always
run, the rest of the budget goes by key-probe score. Untrained, it serves what needs a
router before one is trained (the scheduler's fitness, the guide loss); it looks at the
sequence's end, so top-k only."""

from __future__ import annotations

import torch

from adadsf_modifier.routing.selection import select_topk, tokens_to_keep_per_row

_BOOST = 1e30  # finite, so a sigmoid or a sort of these scores stays well defined


def static_scores(
    probe: torch.Tensor, real: torch.Tensor, keep_last: int
) -> torch.Tensor:
    """Probe scores with each row's first and last ``keep_last`` real tokens pushed to
    the top."""
    forced = real & (real.cumsum(dim=1) == 1)
    if keep_last > 0:
        from_end = real.flip(1).cumsum(dim=1).flip(1)
        forced = forced | (real & (from_end <= keep_last))
    return probe.float().masked_fill(forced, _BOOST)


@torch.no_grad()
def static_keep_mask(
    probe: torch.Tensor, real: torch.Tensor, ratio: float, keep_last: int
) -> torch.Tensor:
    """``[batch, seq]``: the tokens the static router keeps at ``ratio`` (AdaDSF's
    top-k keep-count rule)."""
    if ratio >= 1.0:
        return real.clone()
    keep = tokens_to_keep_per_row(real, ratio)
    k_max = int(keep.max()) if keep.numel() else 0
    out = torch.zeros(
        real.shape[0], real.shape[1] + 1, dtype=torch.bool, device=real.device
    )
    if k_max == 0:
        return out[:, :-1]
    index, valid = select_topk(static_scores(probe, real, keep_last), real, keep, k_max)
    return out.scatter(1, index, valid)[:, :-1]
