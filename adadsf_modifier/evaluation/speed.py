"""Wall-clock speed of a routed model against its dense twin, side by side.

Dense and routed runs alternate and medians are reported, so machine noise hits both
alike. Beside each speedup: the FLOPs ideal ``1 / normalized FLOPs``, counted on the
tokens the routed model kept on the same inputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.constraints import NonNegativeFloat, PositiveFloat
from adadsf_modifier.evaluation.budget import KeptShare
from adadsf_modifier.flops import FlopsReport, normalized_flops
from adadsf_modifier.utils import model_device

__all__ = [
    "SpeedResult",
    "measure_prefill",
    "measure_decode",
    "decode_kept_share",
    "run_speed_benchmark",
    "check_speed_grid",
    "format_table",
    "is_dispatched",
    "load_pair",
]


@dataclass
class SpeedResult:
    kind: str  # "prefill" or "decode"
    batch_size: int
    seq_len: int  # prompt length (prefill) or prompt length before decoding
    new_tokens: int  # decode steps timed (0 for prefill)
    # the annotations check a result read back from disk
    dense_s: PositiveFloat  # median seconds per prefill, or per decode step
    routed_s: PositiveFloat
    speedup: PositiveFloat  # dense_s / routed_s
    flops_ideal: PositiveFloat  # 1 / normalized FLOPs (decoder layers + routers)
    flops_ideal_with_lm_head: PositiveFloat
    normalized_flops: PositiveFloat
    # the routed layers' kept share and its target (evaluation.budget): a decoding
    # that runs more tokens than planned is slower for that, not for the routing
    kept_fraction: NonNegativeFloat | None = None
    retention_target: NonNegativeFloat | None = None
    dense_runs: list[float] = field(default_factory=list)
    routed_runs: list[float] = field(default_factory=list)

    @property
    def fraction_of_ideal(self) -> float:
        return self.speedup / self.flops_ideal

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fraction_of_ideal"] = self.fraction_of_ideal
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(
    fn_dense: Callable[[], float],
    fn_routed: Callable[[], float],
    repeats: int,
    warmup: int,
    desc: str,
) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        fn_dense()
        fn_routed()
    dense, routed = [], []
    for i in tqdm(range(repeats), desc=desc, leave=False):
        # alternate which model goes first so drift and cache effects do not favour one
        if i % 2 == 0:
            dense.append(fn_dense())
            routed.append(fn_routed())
        else:
            routed.append(fn_routed())
            dense.append(fn_dense())
    return dense, routed


@torch.inference_mode()
def measure_prefill(
    dense: nn.Module,
    routed: nn.Module,
    input_ids: torch.Tensor,
    repeats: int = 5,
    warmup: int = 1,
) -> SpeedResult:
    """Median seconds of one forward over ``input_ids`` ``[batch, seq]``, cache on."""
    device = model_device(dense)
    input_ids = input_ids.to(device)

    def run(model: nn.Module) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        return time.perf_counter() - t0

    b, n = input_ids.shape
    d, r = _interleaved(
        lambda: run(dense), lambda: run(routed), repeats, warmup, f"prefill b={b} n={n}"
    )
    report = normalized_flops(routed, {"input_ids": input_ids})
    share = KeptShare(routed)
    share.add(report)
    return _result("prefill", b, n, 0, d, r, report, share)


@torch.inference_mode()
def _decode_loop(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int
) -> tuple[float, list[torch.Tensor]]:
    """Prefill (untimed), then ``new_tokens`` greedy steps: seconds per step, tokens
    fed."""
    device = model_device(model)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    fed = []
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        fed.append(token)
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return (time.perf_counter() - t0) / max(new_tokens, 1), fed


@torch.inference_mode()
def _decode_flops(
    model: nn.Module, prompt: torch.Tensor, fed: list[torch.Tensor]
) -> tuple[FlopsReport | None, KeptShare]:
    """Replay the timed decoding (same tokens, so the same routing): its FLOPs
    (``None`` for no step) and kept share, step by step."""
    cache = model(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
    share, reports = KeptShare(model), []
    for token in fed:
        rep = normalized_flops(
            model, {"input_ids": token, "past_key_values": cache, "use_cache": True}
        )
        share.add(rep)
        reports.append(rep)
    return (FlopsReport.combine(reports) if reports else None), share


def decode_kept_share(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int
) -> KeptShare:
    """The routed layers' kept share over ``new_tokens`` greedy decoding steps after
    ``prompt`` ``[batch, len]`` (its prefill not counted), as :func:`measure_decode`
    counts it, untimed."""
    prompt = prompt.to(model_device(model))
    _, fed = _decode_loop(model, prompt, new_tokens)
    return _decode_flops(model, prompt, fed)[1]


def measure_decode(
    dense: nn.Module,
    routed: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int = 32,
    repeats: int = 3,
    warmup: int = 1,
) -> SpeedResult:
    """Median seconds per greedy decoding step after a prompt (prefill not timed)."""
    prompt = prompt.to(model_device(dense))
    fed: list[torch.Tensor] = []

    def routed_run() -> float:
        seconds, tokens = _decode_loop(routed, prompt, new_tokens)
        fed[:] = tokens
        return seconds

    d, r = _interleaved(
        lambda: _decode_loop(dense, prompt, new_tokens)[0],
        routed_run,
        repeats,
        warmup,
        f"decode b={prompt.shape[0]}",
    )
    b, n = prompt.shape
    return _result(
        "decode", b, n, new_tokens, d, r, *_decode_flops(routed, prompt, fed)
    )


def _result(kind, b, n, new, d, r, report, share: KeptShare) -> SpeedResult:
    dm, rm = statistics.median(d), statistics.median(r)
    share.warn(f"{kind} at batch {b}")
    return SpeedResult(
        kind=kind,
        batch_size=b,
        seq_len=n,
        new_tokens=new,
        dense_s=dm,
        routed_s=rm,
        speedup=dm / rm,
        flops_ideal=1.0 / report.normalized,
        flops_ideal_with_lm_head=1.0 / report.normalized_with_lm_head,
        normalized_flops=report.normalized,
        kept_fraction=share.fraction,
        retention_target=share.target,
        dense_runs=d,
        routed_runs=r,
    )


def load_pair(
    checkpoint: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, nn.Module]:
    """``(dense, routed)`` twins from one AdaDSF or FTP checkpoint, the dense one
    un-routed. Both are loaded the same way: on a CPU, weights mapped from safetensors
    can run measurably faster than the same weights in fresh memory.
    """
    from adadsf_modifier.checkpoint import from_pretrained
    from adadsf_modifier.routing import routed_layers, unroute_layer

    routed = from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    dense = from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    for layer in routed_layers(dense):
        unroute_layer(layer)
    return dense, routed


def is_dispatched(model: nn.Module) -> bool:
    """Whether compressed-tensors' offload wrappers (left by ``oneshot``, absent from
    a reloaded model) are on ``model``: timing one of each measures the wrappers."""
    from compressed_tensors.offload.cache import OffloadCache

    return any(isinstance(m._parameters, OffloadCache) for m in model.modules())


def run_speed_benchmark(
    dense: nn.Module,
    routed: nn.Module,
    token_stream: torch.Tensor,
    seq_lens=(256, 1024, 2048),
    batch_sizes=(1, 8),
    decode_prompt: int = 128,
    decode_tokens: int = 32,
    repeats: int = 5,
    decode_repeats: int | None = None,
) -> list[SpeedResult]:
    """Prefill at each (seq_len, batch) and decoding at each batch size, on
    consecutive chunks of the 1-D ``token_stream`` (real text routes like real text).

    ``seq_lens=()`` skips prefill, ``decode_tokens=0`` decoding. Decoding runs are
    short and noisy: ``decode_repeats`` defaults to ``max(7, repeats)``.
    """
    check_speed_grid(
        seq_lens, batch_sizes, decode_prompt, decode_tokens, repeats, decode_repeats
    )
    if is_dispatched(dense) != is_dispatched(routed):
        which = "routed" if is_dispatched(routed) else "dense"
        raise ValueError(
            f"the {which} model carries compressed-tensors offload wrappers (left by "
            "oneshot) and the other does not, so their speeds are not comparable: call "
            "compressed_tensors.offload.remove_dispatch(model, onload_tensors=True) "
            "first"
        )
    dense.eval()
    routed.eval()
    results = []

    def chunk(b: int, n: int) -> torch.Tensor:  # the stream repeated if too short
        reps = -(-b * n // token_stream.numel())
        stream = token_stream.repeat(reps) if reps > 1 else token_stream
        return stream[: b * n].view(b, n)

    for n in seq_lens:
        for b in batch_sizes:
            res = measure_prefill(dense, routed, chunk(b, n), repeats=repeats)
            logger.info(_row(res))
            results.append(res)
    for b in batch_sizes if decode_tokens else ():
        res = measure_decode(
            dense,
            routed,
            chunk(b, decode_prompt),
            new_tokens=decode_tokens,
            repeats=decode_repeats or max(7, repeats),
        )
        logger.info(_row(res))
        results.append(res)
    return results


def check_speed_grid(
    seq_lens,
    batch_sizes,
    decode_prompt: int,
    decode_tokens: int,
    repeats: int,
    decode_repeats: int | None = None,
) -> None:
    """Refuse a grid with nothing to time (a 0-token decode would divide by zero
    FLOPs after minutes of work)."""
    bad = [f"seq_len {n}" for n in seq_lens if n < 1]
    bad += [f"batch size {b}" for b in batch_sizes if b < 1]
    if not batch_sizes:
        bad.append("no batch sizes")
    if repeats < 1:
        bad.append(f"repeats {repeats}")
    if decode_repeats is not None and decode_repeats < 1:
        bad.append(f"decode_repeats {decode_repeats}")
    if decode_tokens < 0:
        bad.append(f"decode_tokens {decode_tokens} (0 skips decoding)")
    if decode_tokens and decode_prompt < 1:
        bad.append(f"decode_prompt {decode_prompt}")
    if bad:
        raise ValueError(f"speed benchmark: nothing to measure for {', '.join(bad)}")


def _row(r: SpeedResult) -> str:
    what = f"{r.kind:7s} b={r.batch_size:<2d} n={r.seq_len:<5d}"
    unit = "ms/step" if r.kind == "decode" else "ms"
    return (
        f"{what} dense {r.dense_s * 1e3:9.2f} {unit:7s} routed "
        f"{r.routed_s * 1e3:9.2f} speedup {r.speedup:5.3f}x  FLOPs ideal "
        f"{r.flops_ideal:5.3f}x (with lm_head {r.flops_ideal_with_lm_head:5.3f}x)  "
        f"achieved {r.fraction_of_ideal:5.2f} of ideal  kept {_kept(r)}"
    )


def _kept(r: SpeedResult) -> str:
    """``"0.842 (target 0.810)"``: the routed layers' kept share and its target."""
    if r.kept_fraction is None or r.retention_target is None:
        return "-"
    return f"{r.kept_fraction:.3f} (target {r.retention_target:.3f})"


def format_table(results: list[SpeedResult]) -> str:
    head = (
        "| kind | batch | seq | dense | routed | speedup | FLOPs ideal "
        "| ideal w/ lm_head | speedup / ideal | kept (target) |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in results:
        unit = "ms/step" if r.kind == "decode" else "ms"
        rows.append(
            f"| {r.kind} | {r.batch_size} | {r.seq_len} | {r.dense_s * 1e3:.2f} {unit} "
            f"| {r.routed_s * 1e3:.2f} {unit} | {r.speedup:.3f}x "
            f"| {r.flops_ideal:.3f}x | {r.flops_ideal_with_lm_head:.3f}x "
            f"| {r.fraction_of_ideal:.2f} | {_kept(r)} |"
        )
    return "\n".join([head, *rows])
