"""What a (routed) model ran on one batch, read off the routed layers' own records."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.fitting.layer_capture import LayerCall, capture_layers
from adadsf_modifier.flops.count import count_flops
from adadsf_modifier.flops.formulas import FlopsReport, layer_shape
from adadsf_modifier.routing.architectures import decoder_layers, original_class
from adadsf_modifier.routing.recorder import RoutingRecorder
from adadsf_modifier.routing.routed_layer import RoutedLayer
from adadsf_modifier.routing.skip_path import skip_path_of
from adadsf_modifier.utils import allowed_by_mask, model_device, real_token_mask

__all__ = [
    "ObservedRouting",
    "observe_routing",
    "observe_kept_tokens",
    "normalized_flops",
    "stream_flops",
]


@dataclass(frozen=True)
class ObservedRouting:
    """What a model ran on one batch: :func:`count_flops`'s arguments, observed.

    ``routed_layers``: routed layers whose router ran (charged also at ratio 1, where
    inference skips it); ``dense_keys``: the pairs the dense layer computes on the
    same batch.
    """

    kept: list[list[int]]
    seq_lens: list[int]
    attended_keys: list[list[int]]
    dense_keys: list[list[int]]
    routed_layers: frozenset[int]
    gather_layers: frozenset[int]
    router_hidden_sizes: dict[int, int]
    dtype_bytes: int
    skip_path_tokens: list[list[int]] | None = None
    skip_path_ranks: dict[int, int | None] | None = None
    kv_only_tokens: list[list[int]] | None = None
    #: asked of each router itself (AdaDSF's and FTP's alike)
    router_flops_per_token: dict[int, int] | None = None


def _dense_pairs(
    mask: torch.Tensor | None, real: torch.Tensor, past: int, window: int | None
) -> torch.Tensor:
    """``[batch]`` (query, key) pairs the dense layer computes for the real queries:
    read off its 4D mask, else (SDPA's causal fast path, a 2D padding mask) the causal
    rule after ``past`` cached keys within ``window``."""
    batch, n = real.shape
    if mask is not None and mask.dim() == 4:
        allowed = allowed_by_mask(mask[:, 0, -n:, :]).expand(batch, n, -1)
    else:
        kv = mask.shape[-1] if mask is not None else past + n
        q = torch.arange(n, device=real.device).view(n, 1) + (kv - n)
        k = torch.arange(kv, device=real.device).view(1, kv)
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        allowed = allowed.unsqueeze(0).expand(batch, n, kv)
        if mask is not None:  # 2D padding mask over keys
            allowed = allowed & mask.bool().unsqueeze(1)
    return (allowed & real.unsqueeze(-1)).sum((1, 2))


@torch.no_grad()
def observe_routing(model: nn.Module, batch: Any) -> ObservedRouting:
    """Run ``model`` once on ``batch`` (model inputs, or an ``input_ids`` tensor;
    ``use_cache=False`` unless it says otherwise: pass ``past_key_values`` and
    ``use_cache=True`` for one decoding step) in its current mode.

    The routed layers report what they ran through a
    :class:`~adadsf_modifier.routing.recorder.RoutingRecorder`, so the counts are
    theirs, not re-derived; a hook on every decoder layer reads the real tokens and the
    dense reference's pairs off its inputs.
    """
    spec, layers = decoder_layers(model)
    shape = layer_shape(model.config)
    dense: dict[int, dict[str, Any]] = {}
    modules = [layer for _, layer in layers]
    signatures = [inspect.signature(original_class(type(m)).forward) for m in modules]

    def read_inputs(call: LayerCall) -> None:
        index = call.index
        if index in dense:
            raise RuntimeError(
                f"decoder layer {index} ran more than once in one forward; "
                "observe_routing measures a single forward pass"
            )
        bound = signatures[index].bind_partial(call.module, *call.args, **call.kwargs)
        arguments = bound.arguments
        arguments.update(arguments.pop("kwargs", None) or {})
        x = arguments["hidden_states"]
        mask = arguments.get("attention_mask")
        cache = arguments.get(spec.cache_kwarg)
        past = int(cache.get_seq_length(index)) if cache is not None else 0
        real = real_token_mask(mask, x.shape[0], x.shape[1], x.device)
        window = shape.sliding_windows[index]
        dense[index] = {
            "seq_lens": real.sum(1).tolist(),
            "keys": _dense_pairs(mask, real, past, window).tolist(),
            "dtype_bytes": x.element_size(),
        }

    inputs = {"input_ids": batch} if isinstance(batch, torch.Tensor) else dict(batch)
    device = model_device(model)
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }
    inputs.setdefault("use_cache", False)
    routed = [layer for layer in modules if isinstance(layer, RoutedLayer)]
    recorder = RoutingRecorder()
    with capture_layers(modules, read_inputs, at="input"), recorder.attached(routed):
        model(**inputs)
    return _assemble(layers, dense, recorder)


def _assemble(layers, dense, recorder: RoutingRecorder) -> ObservedRouting:
    missing = [i for i in range(len(layers)) if i not in dense]
    if missing:
        raise RuntimeError(
            f"decoder layers {missing} did not run during the forward pass"
        )
    seq_lens = dense[0]["seq_lens"]
    kept, keys, routed, gathers, widths = [], [], set(), set(), {}
    zeros = [0] * len(seq_lens)
    skips, kv_only, ranks, per_token = [], [], {}, {}
    for i, (_, layer) in enumerate(layers):
        if dense[i]["seq_lens"] != seq_lens:
            raise RuntimeError(
                f"layer {i} saw real lengths {dense[i]['seq_lens']}, layer 0 saw "
                f"{seq_lens}"
            )
        record = None
        if isinstance(layer, RoutedLayer):
            widths[i] = int(layer.router.router_hidden_size)
            per_token[i] = int(layer.router.flops(1))
            skip_map = skip_path_of(layer)
            if skip_map is not None:
                ranks[i] = skip_map.rank
            records = recorder.records.get(layer.layer_index, [])
            if len(records) != 1:
                raise RuntimeError(
                    f"routed layer {i} reported {len(records)} calls in one forward"
                )
            record = records[0]
            if record.router_ran:
                routed.add(i)
            if record.path == "gather":
                gathers.add(i)
        if record is None or record.kept is None:  # the dense layer's own computation
            kept.append(list(seq_lens))
            keys.append(list(dense[i]["keys"]))
        else:
            kept.append(record.kept.tolist())
            keys.append(record.attended.tolist())
        for table, counts in (
            (skips, None if record is None else record.skip_path),
            (kv_only, None if record is None else record.kv_only),
        ):
            table.append(zeros if counts is None else counts.tolist())
    return ObservedRouting(
        kept=kept,
        seq_lens=list(seq_lens),
        attended_keys=keys,
        dense_keys=[list(dense[i]["keys"]) for i in range(len(layers))],
        routed_layers=frozenset(routed),
        gather_layers=frozenset(gathers),
        router_hidden_sizes=widths,
        dtype_bytes=int(dense[0]["dtype_bytes"]),
        skip_path_tokens=skips,
        skip_path_ranks=ranks,
        kv_only_tokens=kv_only,
        router_flops_per_token=per_token,
    )


def stream_flops(
    model: nn.Module, input_ids: torch.Tensor, seq_len: int, batch_size: int = 4
) -> FlopsReport:
    """:func:`normalized_flops` over a 1-D token stream in rows of ``seq_len`` (the
    last one shorter), ``batch_size`` rows per forward, combined into one report.

    Causal routing's kept share follows the text, so a few rows' FLOPs can miss the
    text's by points: measure on the tokens the quality metric uses.
    """
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(
            f"stream_flops takes a non-empty 1-D token stream, got shape "
            f"{tuple(input_ids.shape)}"
        )
    if seq_len < 1 or batch_size < 1:
        raise ValueError(
            f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}"
        )
    rows = list(torch.split(input_ids, seq_len))
    full = [r for r in rows if r.numel() == seq_len]
    batches = [
        torch.stack(full[i : i + batch_size]) for i in range(0, len(full), batch_size)
    ]
    if len(full) < len(rows):
        batches.append(rows[-1][None])
    bar = tqdm(batches, desc="FLOPs", leave=False, disable=len(batches) < 2)
    return FlopsReport.combine([normalized_flops(model, b) for b in bar])


def observe_kept_tokens(model: nn.Module, batch: Any) -> list[list[int]]:
    """``kept[l][b]``: tokens of sequence ``b`` that ran decoder layer ``l``."""
    return observe_routing(model, batch).kept


def normalized_flops(model: nn.Module, batch: Any) -> FlopsReport:
    """:func:`count_flops` on what :func:`observe_routing` saw ``model`` run on
    ``batch``, against every layer running every real token without routers."""
    obs = asdict(observe_routing(model, batch))  # its fields: count_flops' arguments
    obs["router_hidden_size"] = obs.pop("router_hidden_sizes")
    return count_flops(model.config, **obs)
