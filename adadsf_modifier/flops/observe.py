"""What a (routed) model ran on one batch, read off the routed layers' own records."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
    """What a model did on one batch, layer by layer (``[layer][sequence]`` tables).

    ``kept``: tokens that ran the layer; ``seq_lens``: real tokens per sequence;
    ``attended_keys``: (query, key) pairs the layer's attention computed among real/kept
    tokens; ``dense_keys``: the pairs the dense layer would compute on the same batch;
    ``routed_layers``: routed layers that were not removed (their router's cost is
    charged, also at ratio 1 where inference skips it); ``gather_layers``: layers that
    gathered/scattered a compacted batch; ``router_hidden_sizes``: ``{layer: r}``;
    ``dtype_bytes``: element size of the hidden states; ``skip_path_tokens``: skipped
    tokens that went through the layer's fitted skip path, of rank
    ``skip_path_ranks[layer]`` (``None``: full rank); ``kv_only_tokens``: skipped
    tokens whose keys/values the layer computed (``skipped_tokens_kv``).
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
    #: each routed layer's router cost per token, asked of the router itself (AdaDSF's
    #: ``TokenRouter`` and FTP's shared router alike)
    router_flops_per_token: dict[int, int] | None = None


def _dense_pairs(
    mask: torch.Tensor | None, real: torch.Tensor, past: int, window: int | None
) -> torch.Tensor:
    """``[batch]`` (query, key) pairs the dense layer computes for the real queries.

    Read off the layer's own 4D mask (causality, padding, sliding window, cached
    length); without one (SDPA's causal fast path, or a 2D padding mask) the causal
    rule after ``past`` cached keys, narrowed to ``window``.
    """
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
    """Run ``model`` once on ``batch`` and record, per decoder layer and sequence, what
    ran.

    ``batch`` is a mapping of model inputs (``input_ids``, ``attention_mask``, ...) or
    an ``input_ids`` tensor; the model is called with ``use_cache=False`` unless the
    batch says otherwise (pass ``past_key_values`` and ``use_cache=True`` to measure one
    decoding step). The model runs in its current train/eval state and routing mode.

    The routed layers report what they ran (kept tokens, attended pairs, gather or
    in-place) through a :class:`~adadsf_modifier.routing.recorder.RoutingRecorder`, so
    the counts are the layers' own, not re-derived. A forward pre-hook on every decoder
    layer reads the real tokens and the dense reference's (query, key) pairs off the
    layer's inputs. Hooks and recorder are removed afterwards, also on error.
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
    """:func:`normalized_flops` over a whole 1-D token stream: consecutive rows of
    ``seq_len`` tokens (the last one shorter if the stream does not divide),
    ``batch_size`` rows per forward, combined into one report
    (:meth:`FlopsReport.combine`).

    Why a stream and not one batch: causal routing keeps a different share of tokens on
    different text (a threshold, not a count, decides), so the FLOPs of a few rows can
    miss those of the text a perplexity is measured on by points. Measure on the same
    tokens as the metric the FLOPs are plotted against.
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
    return FlopsReport.combine([normalized_flops(model, b) for b in batches])


def observe_kept_tokens(model: nn.Module, batch: Any) -> list[list[int]]:
    """``kept[l][b]``: how many tokens of sequence ``b`` ran decoder layer ``l`` on
    ``batch``.

    Dense (unrouted) layers and routed layers at ratio 1 run every real token; a routed
    layer at ratio 0 runs none. See :func:`observe_routing`.
    """
    return observe_routing(model, batch).kept


def normalized_flops(model: nn.Module, batch: Any) -> FlopsReport:
    """:func:`count_flops` of ``model`` on ``batch`` from the counts
    :func:`observe_routing` saw.

    The dense reference is the same model with every layer running every real token and
    no routers. Attention pairs are the observed ones (exact also under sliding windows
    and padding).
    """
    obs = observe_routing(model, batch)
    return count_flops(
        model.config,
        obs.kept,
        obs.seq_lens,
        routed_layers=obs.routed_layers,
        router_hidden_size=obs.router_hidden_sizes,
        attended_keys=obs.attended_keys,
        dense_keys=obs.dense_keys,
        gather_layers=obs.gather_layers,
        dtype_bytes=obs.dtype_bytes,
        skip_path_tokens=obs.skip_path_tokens,
        skip_path_ranks=obs.skip_path_ranks,
        kv_only_tokens=obs.kv_only_tokens,
        router_flops_per_token=obs.router_flops_per_token,
    )
