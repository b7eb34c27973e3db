"""Dense calibration: how much does each decoder layer change its input?

``s_i = mean over real tokens of cos(x_in, x_out)`` for every decoder layer, accumulated
by forward hooks while the dense model runs over the calibration batches. Padding is
excluded with the same rule the routed layers use to find real tokens, so statistics and
routing agree on what a token is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from adadsf_modifier import distributed
from adadsf_modifier.fitting.layer_capture import LayerCall, capture_layers
from adadsf_modifier.utils import run_calibration_batches

__all__ = [
    "SimilarityAccumulator",
    "token_cosine_similarity",
    "run_calibration_batches",
]


def token_cosine_similarity(x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` cosine similarity per token, computed in float32."""
    return torch.nn.functional.cosine_similarity(
        x_in.float(), x_out.float(), dim=-1, eps=1e-8
    )


class SimilarityAccumulator:
    """Running sum and count of per-token cosine similarity for each decoder layer.

    With ``sample_tokens > 0`` it also keeps, per layer, a random sample of real tokens'
    layer inputs and their per-token similarity: the supervision for the routers' warm
    start (:mod:`adadsf_modifier.fitting.warm_start`), gathered in the same dense pass
    at no extra forward cost.

    Under ``torchrun`` each rank sees its own partition: :meth:`all_reduce` sums the
    sums and counts over ranks (so the similarities are those of the union of the
    data), and each rank samples ``ceil(sample_tokens / world_size)`` tokens, so the
    warm start's gathered sample keeps the single-process size.
    """

    def __init__(
        self,
        num_layers: int,
        sample_tokens: int = 0,
        seed: int = 0,
    ):
        self.sums = [0.0] * num_layers
        self.counts = [0] * num_layers
        self.sample_tokens = -(-sample_tokens // distributed.world_size())
        self.samples: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(num_layers)
        ]
        self._kept = [0] * num_layers
        self._generator = torch.Generator().manual_seed(seed)

    @contextlib.contextmanager
    def capturing(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """Within the block, every forward of the decoder ``layers`` (in index order)
        adds to the statistics."""
        with capture_layers(layers, self._record):
            yield

    def _record(self, call: LayerCall) -> None:
        index, x_in, x_out = call.index, call.hidden_states, call.output_states
        real = call.real_tokens()
        cos = token_cosine_similarity(x_in, x_out)
        self.sums[index] += float(cos[real].double().sum())
        self.counts[index] += int(real.sum())
        if self._kept[index] < self.sample_tokens:
            self._sample(index, x_in[real], cos[real])

    def _sample(self, index: int, x: torch.Tensor, cos: torch.Tensor) -> None:
        # at most a quarter of the budget per batch, so the sample spans several batches
        take = min(
            self.sample_tokens - self._kept[index],
            max(1, self.sample_tokens // 4),
            len(x),
        )
        pick = torch.randperm(len(x), generator=self._generator)[:take].to(x.device)
        self.samples[index].append(
            (x[pick].detach().float().cpu(), cos[pick].detach().cpu())
        )
        self._kept[index] += take

    def sampled(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [N, hidden], similarity [N])`` sampled at decoder layer
        ``index``."""
        if not self.samples[index]:
            raise ValueError(f"no tokens were sampled at decoder layer {index}")
        xs, cs = zip(*self.samples[index])
        return torch.cat(xs), torch.cat(cs)

    def all_reduce(self) -> None:
        """Sum the per-layer sums and counts over all ranks (no-op in one process)."""
        self.sums = distributed.sum_across_ranks(self.sums)
        self.counts = distributed.sum_across_ranks(self.counts)

    def local_sample(self, index: int, hidden_size: int):
        """This rank's ``(inputs, similarity)`` sample at layer ``index``; empty
        tensors (``[0, hidden_size]``, ``[0]``) when it sampled nothing there."""
        if not self.samples[index]:
            return torch.zeros(0, hidden_size), torch.zeros(0)
        return self.sampled(index)

    @property
    def num_tokens(self) -> int:
        return self.counts[0] if self.counts else 0

    def similarities(self) -> list[float]:
        if any(c == 0 for c in self.counts):
            raise ValueError(
                "calibration saw no real tokens: the calibration set is empty or all "
                "padding"
            )
        return [s / c for s, c in zip(self.sums, self.counts)]
