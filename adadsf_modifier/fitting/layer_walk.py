"""Walk the decoder stack one layer at a time over the whole calibration set.

A fit per routed layer on the inputs the *routed* model gives it (skip paths, causal
thresholds) needs those inputs final, and they depend on every layer below. Rather than
a forward per layer, :func:`walk_layers` holds every batch's hidden states at one depth:
the caller fits layer ``i``, then the walk runs it (fitted) to make layer ``i + 1``'s
inputs, replaying the masks and rotary embeddings recorded once. About one forward pass
in all, and each layer sees exactly what the finished model gives it. Memory: one depth
of hidden states for every calibration batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.distributed import is_source_process
from adadsf_modifier.fitting.layer_capture import LayerCall, StopForward, capture_layers
from adadsf_modifier.routing.architectures import decoder_layers
from adadsf_modifier.routing.modes import routing_override
from adadsf_modifier.utils import (
    MODEL_INPUT_KEYS,
    model_device,
    real_token_mask,
    tensors_to_device,
)

__all__ = [
    "LayerStep",
    "call_layer",
    "real_tokens_of",
    "router_scores",
    "walk_layers",
]


@dataclass
class LayerStep:
    """One depth of the walk: decoder layer ``index`` (``layer``), every batch's input
    hidden states (``inputs``) and the other arguments of its call (``calls``, one
    ``(args, kwargs)`` per batch).

    Set ``outputs`` to hand the next layer other inputs than this layer's routed
    outputs (a fit on the dense model's activations does).
    """

    index: int
    layer: nn.Module
    inputs: list[torch.Tensor]
    calls: list[tuple]
    outputs: list[torch.Tensor] | None = None

    def run(self) -> list[torch.Tensor]:
        """The layer (as it routes now) on every batch's inputs."""
        return [call_layer(self.layer, x, c) for x, c in zip(self.inputs, self.calls)]


def real_tokens_of(x: torch.Tensor, call: tuple) -> tuple[Any, torch.Tensor]:
    """``(attention_mask, real [batch, seq])`` of a recorded layer call on ``x``."""
    mask = call[1].get("attention_mask")
    return mask, real_token_mask(mask, x.shape[0], x.shape[1], x.device)


def call_layer(layer: nn.Module, x: torch.Tensor, call: tuple) -> torch.Tensor:
    """``layer``'s output hidden states on ``x`` with a recorded call's arguments."""
    args, kwargs = call
    out = layer(x, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def router_scores(layer: nn.Module, x: torch.Tensor, call: tuple) -> torch.Tensor:
    """``layer``'s router scores ``[batch, seq]`` on ``x``, computed inside a call of
    the layer with a recorded call's arguments (the layer itself does not run).

    Inside the call because a router may read the call's context: FTP's takes the
    positions, the attention mask and the layer's retention ratio from a pre-hook of
    the layer; called on its own it would score with none of them.
    """
    scores: list[torch.Tensor] = []

    def score(layer_call: LayerCall) -> None:
        scores.append(layer_call.module.router(layer_call.hidden_states))

    with (
        capture_layers([layer], score, at="input", stop_after_last=True),
        contextlib.suppress(StopForward),
    ):
        call_layer(layer, x, call)
    return scores[0]


def _record_calls(
    model: nn.Module, layers: list[nn.Module], batches: Sequence[Mapping[str, Any]]
) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """First decoder layer's input and every layer's other arguments, per batch.

    Routed layers are switched to ratio 0 for this pass (they pass their input through)
    and each forward stops at the last layer's input, so it costs about the dense
    layers that are left: the arguments (masks, rotary embeddings, positions) do not
    depend on what the layers compute.
    """
    firsts: list[torch.Tensor] = []
    calls: list[list[tuple]] = [[] for _ in layers]

    def record(call: LayerCall) -> None:
        if call.index == 0:
            firsts.append(call.hidden_states)
        rest = {k: v for k, v in call.kwargs.items() if k != "hidden_states"}
        calls[call.index].append((tuple(call.args[1:]), rest))

    device = model_device(model)
    with (
        capture_layers(layers, record, at="input", stop_after_last=True),
        routing_override(layers, retention_ratio=0.0),
    ):
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}
            with contextlib.suppress(StopForward):
                model(**tensors_to_device(inputs, device), use_cache=False)
    return firsts, calls


@torch.no_grad()
def walk_layers(
    model: nn.Module,
    batches: Sequence[Mapping[str, Any]],
    last: int | None = None,
    desc: str = "AdaDSF layers",
) -> Iterator[LayerStep]:
    """Yield a :class:`LayerStep` per decoder layer of ``model``, bottom up, to layer
    ``last`` (default: the top one), with a progress bar over the layers.

    After the caller's work on a step, the walk moves the hidden states up: the step's
    ``outputs`` if the caller set them, else the layer run on its inputs as it is then
    (fitted, in its current routing mode). The model is in eval mode during the walk.
    The walk's own forwards run without a gradient; the caller's work between steps
    runs in the caller's grad mode (a generator cannot set it for its consumer), so a
    caller that runs layers there wraps its loop in ``torch.no_grad()``.
    """
    _, named = decoder_layers(model)
    layers = [m for _, m in named]
    last = len(layers) - 1 if last is None else last
    base = getattr(model, "base_model", model)
    was_training = model.training
    model.eval()
    try:
        xs, calls = _record_calls(base, layers, list(batches))
        bar = tqdm(
            layers[: last + 1], desc=desc, leave=False, disable=not is_source_process()
        )
        for i, layer in enumerate(bar):
            step = LayerStep(i, layer, xs, calls[i])
            yield step
            if i < last:
                xs = step.run() if step.outputs is None else step.outputs
    finally:
        model.train(was_training)
