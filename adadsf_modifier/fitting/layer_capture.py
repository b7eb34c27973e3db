"""Seeing decoder layers' inputs and outputs while a pass runs calibration batches.

:func:`capture_layers` puts one read-only callback on each layer for a ``with`` block
and always takes it off again, also when the forward raises; the callback gets a
:class:`LayerCall`, which reads hidden states, attention mask and real tokens the same
way for every pass (similarity, skip-path fit, thresholds, FLOPs observation, FTP), so
the passes agree on what a token is. :class:`StopForward` ends a forward early once the
last layer a pass needs has run.

Not llm-compressor's ``HooksMixin``: these passes are plain functions with no modifier
to own the hooks; ``HooksMixin.disable_hooks()``, entered by the sequential pipeline,
would silently switch them off; and its ``remove_hooks()`` removes every hook of the
modifier at once, where a pass needs exactly its own gone when its block ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from adadsf_modifier.utils import layer_input, real_token_mask

__all__ = [
    "CaptureAt",
    "LayerCall",
    "OnLayerCall",
    "StopForward",
    "capture_layers",
]

#: ``input``: the callback runs before the layer (a forward pre-hook) and sees its
#: arguments; ``output``: after it (a forward hook), and sees its output too.
CaptureAt = Literal["input", "output"]


@dataclass(frozen=True)
class LayerCall:
    """One call of a captured module, as its hook sees it.

    ``index`` is the module's position in the sequence given to
    :func:`capture_layers`; ``output`` is ``None`` when captured at the input.
    """

    index: int
    module: nn.Module
    args: tuple
    kwargs: Mapping[str, Any]
    output: Any = None

    @property
    def hidden_states(self) -> torch.Tensor:
        """The layer's input hidden states (positional or ``hidden_states=``)."""
        return layer_input(self.args, self.kwargs)

    @property
    def output_states(self) -> torch.Tensor:
        """The hidden states the layer returned (the first element of a tuple)."""
        if self.output is None:
            raise ValueError("a call captured at the input has no output yet")
        out = self.output
        return out[0] if isinstance(out, tuple) else out

    @property
    def attention_mask(self) -> torch.Tensor | None:
        return self.kwargs.get("attention_mask")

    def real_tokens(self) -> torch.Tensor:
        """``[batch, seq]`` bool: the real (non-padding) tokens of this call, by the
        rule routed layers use (:func:`~adadsf_modifier.utils.real_token_mask`)."""
        x = self.hidden_states
        return real_token_mask(self.attention_mask, x.shape[0], x.shape[1], x.device)


#: ``on_call(call)``: reads the call; its return value is ignored.
OnLayerCall = Callable[[LayerCall], Any]


class StopForward(Exception):
    """Ends a forward early: raised after the last captured layer with
    ``stop_after_last``, for passes that need nothing of the layers above it. The
    caller runs the forward under ``contextlib.suppress(StopForward)``."""


def _hook(
    index: int, on_call: OnLayerCall, at: CaptureAt = "output", stop: bool = False
) -> Callable[..., Any]:
    """The torch hook (registered with ``with_kwargs=True``) that hands each call of
    one module to ``on_call`` as a :class:`LayerCall` of ``index``; with ``stop`` it
    then raises :class:`StopForward`. The callback's return value is ignored: passes
    read a layer's arguments and output, they do not change them."""
    if at == "input":

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            on_call(LayerCall(index, module, args, kwargs))
            if stop:
                raise StopForward

        return pre_hook
    if at != "output":
        raise ValueError(f"at must be 'input' or 'output', got {at!r}")

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        on_call(LayerCall(index, module, args, kwargs, output))
        if stop:
            raise StopForward

    return hook


@contextmanager
def capture_layers(
    modules: Sequence[nn.Module],
    on_call: OnLayerCall,
    *,
    at: CaptureAt = "output",
    stop_after_last: bool = False,
) -> Iterator[None]:
    """Within the block, every call of ``modules[i]`` goes to ``on_call`` as a
    :class:`LayerCall` of index ``i``, before (``at="input"``) or after
    (``at="output"``) the module runs.

    ``stop_after_last``: raise :class:`StopForward` once the last module's callback
    has run, so a forward costs only the layers up to it. The hooks are removed when
    the block ends, whatever ends it.
    """
    handles: list[RemovableHandle] = []
    last = len(modules) - 1
    try:
        for i, module in enumerate(modules):
            hook = _hook(i, on_call, at, stop_after_last and i == last)
            register = (
                module.register_forward_pre_hook
                if at == "input"
                else module.register_forward_hook
            )
            handles.append(register(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
