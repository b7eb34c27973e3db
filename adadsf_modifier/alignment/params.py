"""What the alignment stage trains: which parameters, in which precision, and whether
this model can train them at all."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from adadsf_modifier.alignment.config import AlignmentConfig
from adadsf_modifier.alignment.parallel import check_parallel_supported
from adadsf_modifier.routing import decoder_layers, routed_layers


def check_alignment_supported(model: nn.Module, config: AlignmentConfig) -> None:
    """Refuse, before any calibration, an alignment stage this ``model`` cannot run:
    gradient checkpointing it does not support, integer (quantized) layer weights
    that ``routers_and_layers`` would train, a parallel mode that does not suit it."""
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


def select_trainable(model: nn.Module, trainable: str) -> list[nn.Parameter]:
    """The parameters that train under ``trainable`` (``routers`` or
    ``routers_and_layers``), each once."""
    layers = routed_layers(model)
    sources = [m.router if trainable == "routers" else m for m in layers]
    chosen = {id(p): p for source in sources for p in source.parameters()}
    if not chosen:
        raise ValueError(
            "AdaDSF alignment found no routed layers to train: route the model before "
            "aligning it"
        )
    return list(chosen.values())


def added_by_routing(model: nn.Module, params: Sequence[nn.Parameter]) -> list[bool]:
    """For each of ``params``: whether routing added it (a router or a skip path), not
    a pre-trained weight."""
    added = {
        id(p)
        for layer in routed_layers(model)
        for child in (layer.router, getattr(layer, "skip_path", None))
        if child is not None
        for p in child.parameters()
    }
    return [id(p) in added for p in params]


class TrainableParams:
    """The trainable parameters, the float32 masters the optimizer updates, and a copy
    of the last good values (the NaN guard's fallback).

    A fp16/bf16 parameter gets a float32 master: AdamW's ``eps`` (1e-8) is 0 in fp16,
    so a zero second moment gives 0/0, and bf16 rounds small updates away.
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
    """AdamW over ``masters`` in two groups: what routing added (``added[i]``) at
    ``align_lr``, the pre-trained weights at ``align_layer_lr``. No weight decay: the
    targets are the dense model's own outputs."""
    lr = config.align_lr
    layer_lr = lr if config.align_layer_lr is None else config.align_layer_lr
    groups = [
        {"params": [m for m, a in zip(masters, added) if a], "lr": lr},
        {"params": [m for m, a in zip(masters, added) if not a], "lr": layer_lr},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, weight_decay=0.0)
