"""FTP's static router: always keep the first token (the attention sink) and the last
few tokens, fill the rest of the layer's budget by key-probe score.

It needs no training, so it bootstraps the two things that need a router before one
is trained: the sparsity scheduler scores candidate ratios with it, and the guide loss
teaches the learned router to imitate it early on. It looks at the end of the sequence,
so it is a top-k (whole-sequence) rule, never used for KV-cache decoding.
"""

from __future__ import annotations

import torch

from adadsf_modifier.routing.selection import select_topk, tokens_to_keep_per_row

__all__ = ["first_and_last", "static_scores", "static_keep_mask"]

_BOOST = 1e30  # finite, so a sigmoid or a sort of these scores stays well defined


def first_and_last(real: torch.Tensor, keep_last: int) -> torch.Tensor:
    """``[batch, seq]`` bool: each row's first real token and its last ``keep_last``
    real tokens."""
    first = real & (real.cumsum(dim=1) == 1)
    if keep_last <= 0:
        return first
    from_end = real.flip(1).cumsum(dim=1).flip(1)
    return first | (real & (from_end <= keep_last))


def static_scores(
    probe: torch.Tensor, real: torch.Tensor, keep_last: int
) -> torch.Tensor:
    """Probe scores with the first and last ``keep_last`` real tokens pushed to the
    top."""
    forced = first_and_last(real, keep_last)
    return probe.float().masked_fill(forced, _BOOST)


@torch.no_grad()
def static_keep_mask(
    probe: torch.Tensor, real: torch.Tensor, ratio: float, keep_last: int
) -> torch.Tensor:
    """``[batch, seq]`` bool: the tokens the static router keeps at retention
    ``ratio`` (the same keep-count rule as AdaDSF's top-k routing)."""
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
