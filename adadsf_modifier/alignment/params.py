"""What the alignment stage trains: which parameters, in which precision, and whether
this model can train them at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from adadsf_modifier.alignment.config import TRAINABLE_SETS, AlignmentConfig
from adadsf_modifier.alignment.parallel import check_parallel_supported
from adadsf_modifier.routing import decoder_layers, routed_layers

__all__ = [
    "TrainableParams",
    "added_by_routing",
    "check_alignment_supported",
    "make_optimizer",
    "select_trainable",
]


def check_alignment_supported(model: nn.Module, config: AlignmentConfig) -> None:
    """Refuse, before any calibration, an alignment stage this ``model`` cannot run.

    Call it with the dense model before routing (the modifier does so first thing in
    ``on_initialize``); ``align_model`` calls it again. Checks that gradient
    checkpointing, when asked for, is supported, and that the decoder layers' weights
    are floating point when ``routers_and_layers`` would train them (a model loaded
    with integer-quantized weights cannot be fine-tuned), and, under ``torchrun``, that
    ``parallel`` suits the model (see :func:`check_parallel_supported`). fp16 and bf16
    models are supported (see :class:`TrainableParams`).
    """
    if config.align_steps == 0:
        return
    check_parallel_supported(model, config.align_parallel)
    if config.align_gradient_checkpointing and not getattr(
        model, "supports_gradient_checkpointing", False
    ):
        raise ValueError(
            f"align_gradient_checkpointing: {type(model).__name__} does not support "
            "gradient checkpointing; set align_gradient_checkpointing to false"
        )
    if config.align_trainable == "routers_and_layers":
        _, layers = decoder_layers(model)
        frozen = sorted(
            {
                str(p.dtype)
                for _, layer in layers
                for p in layer.parameters()
                if not p.is_floating_point()
            }
        )
        if frozen:
            raise ValueError(
                f"align_trainable=routers_and_layers needs floating-point decoder "
                f"layer weights, this model has {', '.join(frozen)} ones (quantized?); "
                "use align_trainable=routers"
            )


def select_trainable(
    model: nn.Module, trainable: str
) -> list[tuple[str, nn.Parameter]]:
    """Named parameters that train under ``trainable`` (``routers`` or
    ``routers_and_layers``)."""
    if trainable not in TRAINABLE_SETS:
        raise ValueError(
            f"trainable must be one of {TRAINABLE_SETS}, got {trainable!r}"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    chosen: dict[int, tuple[str, nn.Parameter]] = {}
    for layer in routed_layers(model):
        source = layer.router if trainable == "routers" else layer
        for param in source.parameters():
            chosen.setdefault(id(param), (names[id(param)], param))
    if not chosen:
        raise ValueError(
            "AdaDSF alignment found no routed layers to train: route the model before "
            "aligning it"
        )
    return list(chosen.values())


def added_by_routing(model: nn.Module, params: Sequence[nn.Parameter]) -> list[bool]:
    """For each of ``params``: True when routing added it (a router or a skip path),
    False for a decoder layer's pre-trained weight (they may train at another rate,
    :func:`make_optimizer`)."""
    added = {
        id(p)
        for layer in routed_layers(model)
        for child in (layer.router, getattr(layer, "skip_path", None))
        if child is not None
        for p in child.parameters()
    }
    return [id(p) in added for p in params]


class TrainableParams:
    """The trainable parameters, the float32 tensors the optimizer updates, and a copy
    of the last good values (the NaN guard's fallback).

    A float32 (or float64) parameter is its own master; a fp16/bf16 one gets a float32
    master copy whose gradient is the parameter's, upcast.
    """

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self.masters = [
            p if torch.finfo(p.dtype).bits >= 32 else p.detach().float()
            for p in self.params
        ]
        self.good = [p.detach().clone() for p in self.params]

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = m.grad = None

    def grads_to_masters(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def all_finite(self) -> bool:
        """On this rank's values (an FSDP parameter's local shard)."""
        return all(bool(torch.isfinite(_local(p)).all()) for p in self.params)

    @torch.no_grad()
    def keep(self) -> None:
        for p, c in zip(self.params, self.good):
            c.copy_(p)

    @torch.no_grad()
    def restore(self) -> None:
        for p, c in zip(self.params, self.good):
            p.copy_(c)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 parameter); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def make_optimizer(
    masters: Sequence[torch.Tensor],
    added: Sequence[bool],
    config: AlignmentConfig,
) -> torch.optim.Optimizer:
    """AdamW over ``masters`` (``added[i]``: the i-th was added by routing), in two
    groups: the parameters routing *added* (routers, skip paths), which start from a
    warm start or a closed-form fit, at ``align_lr``, and the decoder layers'
    *pre-trained* weights at ``align_layer_lr``. A rate high enough to move a fresh
    router can move a pre-trained weight too far, so the two rates are separate
    fields. No weight decay: the targets are the dense model's own outputs."""
    lr = config.align_lr
    layer_lr = lr if config.align_layer_lr is None else config.align_layer_lr
    groups = [
        {"params": [m for m, a in zip(masters, added) if a], "lr": lr},
        {"params": [m for m, a in zip(masters, added) if not a], "lr": layer_lr},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, weight_decay=0.0)
