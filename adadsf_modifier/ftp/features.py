"""FTP's four router features per token: position, the attention score the token
receives, that score's rank, and the layer's required sparsity.

The score is a *key probe* folded into ``<rms_norm(x), probe> + bias``, not read off
attention maps (they need eager attention and are not causal: later queries attend to
the token). The rank is taken against the layer's calibration scores, so the features
need no per-sequence state in a KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adadsf_modifier.fitting.layer_capture import LayerCall, capture_layers
from adadsf_modifier.utils import run_calibration_batches

NUM_FEATURES = 4
NUM_QUANTILES = 33  # entries of a layer's rank table (its calibration CDF)


@dataclass
class LayerFeatureStats:
    """One layer's folded key probe and its scores' calibration distribution."""

    probe: torch.Tensor  # [hidden], float32
    bias: float
    eps: float
    mean: float
    std: float
    quantiles: torch.Tensor  # [NUM_QUANTILES], float32, ascending


def check_probe_supported(layer: nn.Module, name: str) -> None:
    """Refuse a layer the key probe cannot fold: it needs an input norm and separate
    query/key projections, and no key norm (a nonlinear map of each head's keys)."""
    attn = getattr(layer, "self_attn", None)
    parts = (attn, getattr(attn, "q_proj", None), getattr(attn, "k_proj", None))
    if any(p is None for p in parts) or getattr(layer, "input_layernorm", None) is None:
        raise ValueError(
            f"FTPModifier needs decoder layers with input_layernorm and "
            f"self_attn.q_proj/k_proj (Llama, Qwen2, Mistral, Gemma 2); `{name}` is a "
            f"{type(layer).__name__}"
        )
    if getattr(attn, "k_norm", None) is not None:
        raise ValueError(
            f"FTPModifier's key probe is linear in the layer input; `{name}` "
            f"({type(layer).__name__}) normalises its keys (self_attn.k_norm), which "
            "no linear probe folds: use AdaDSFModifier for this architecture"
        )


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm's epsilon (Llama's ``variance_epsilon``, or ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return float(eps if eps is not None else 1e-6)


@torch.no_grad()
def key_probe(
    layer: nn.Module, mean_input: torch.Tensor, config
) -> tuple[torch.Tensor, float]:
    """``(probe, bias)`` with ``<rms_norm(x), probe> + bias == mean_h qbar_h . k_h(x) /
    sqrt(d)``, ``qbar = q_proj(mean_input)``. The norm's scale is folded in, measured
    on a ones vector so that ``1 + w`` style norms fold too."""
    attn, norm = layer.self_attn, layer.input_layernorm
    w_q, w_k = attn.q_proj.weight, attn.k_proj.weight
    hidden = w_k.shape[1]
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    d = w_q.shape[0] // n_heads
    z = mean_input.to(w_q.dtype)
    qbar = attn.q_proj(z).float().view(n_heads, d)
    wk = w_k.float().view(n_kv, d, hidden)
    bk = attn.k_proj.bias
    bk = bk.float().view(n_kv, d) if bk is not None else torch.zeros(n_kv, d)
    kv_of = torch.arange(n_heads) // (n_heads // n_kv)
    scale = n_heads * math.sqrt(d)
    u = torch.einsum("nd,ndh->h", qbar, wk[kv_of.to(wk.device)]) / scale
    bias = float((qbar * bk.to(qbar.device)[kv_of.to(qbar.device)]).sum() / scale)
    eps = norm_eps(norm)
    ones = torch.ones(1, hidden, dtype=w_k.dtype, device=w_k.device)
    gamma = norm(ones).float()[0] / F.rms_norm(ones.float(), (hidden,), eps=eps)[0]
    return (gamma * u).float().cpu(), bias


def probe_scores(
    x: torch.Tensor, probe: torch.Tensor, bias: float, eps: float
) -> torch.Tensor:
    """``[batch, seq, hidden] -> [batch, seq]`` float32 key-probe scores."""
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return h @ probe.float().to(h.device) + bias


def token_features(
    scores: torch.Tensor,
    positions: torch.Tensor,
    stats_mean: float,
    stats_std: float,
    quantiles: torch.Tensor,
    sparsity: float,
    position_scale: float,
) -> torch.Tensor:
    """``[batch, seq, 4]``: log-position, standardised probe score, its rank (the
    calibration CDF) and the layer's required sparsity."""
    pos = positions.float().clamp(min=0).expand_as(scores)
    f_pos = torch.log1p(pos) / math.log1p(max(position_scale, 1.0))
    f_abs = (scores - stats_mean) / max(stats_std, 1e-6)
    q = quantiles.float().to(scores.device)
    f_rank = torch.searchsorted(q, scores.contiguous()).float() / q.numel()
    f_sparse = torch.full_like(scores, float(sparsity))
    return torch.stack([f_pos, f_abs, f_rank, f_sparse], dim=-1)


def calibrate_features(
    model: nn.Module, layers: list[nn.Module], batches: list, seed: int = 0
) -> tuple[list[LayerFeatureStats], int]:
    """Two dense passes over ``batches``: key probes, then their score distribution.
    Returns each layer's stats and the longest real row (the position scale)."""
    sums: list[torch.Tensor | None] = [None] * len(layers)
    counts = [0] * len(layers)
    scores: list[list[torch.Tensor]] = [[] for _ in layers]
    probes: list[tuple[torch.Tensor, float, float]] | None = None
    max_len = 1

    def record(call: LayerCall) -> None:
        nonlocal max_len
        i, x, real = call.index, call.hidden_states, call.real_tokens()
        max_len = max(max_len, int(real.sum(1).max()))
        if probes is None:  # pass 1: sum input_layernorm(x) over real tokens
            z = call.module.input_layernorm(x)[real].double().sum(0)
            sums[i] = z if sums[i] is None else sums[i] + z
            counts[i] += int(real.sum())
        else:  # pass 2: the probe scores, for the rank table
            probe, bias, eps = probes[i]
            scores[i].append(probe_scores(x, probe, bias, eps)[real].cpu())

    base = getattr(model, "base_model", model)
    with capture_layers(layers, record, at="input"):
        run_calibration_batches(base, batches, desc="FTP features (probes)")
        probes = []
        for i, m in enumerate(layers):
            mean = (sums[i] / max(counts[i], 1)).float()
            probe, bias = key_probe(m, mean, model.config)
            probes.append((probe, bias, norm_eps(m.input_layernorm)))
        run_calibration_batches(base, batches, desc="FTP features (scores)")
    out, sample = [], 65536
    gen = torch.Generator().manual_seed(seed)
    grid = torch.linspace(0, 1, NUM_QUANTILES)
    for i, (probe, bias, eps) in enumerate(probes):
        s = torch.cat(scores[i]).float()
        if s.numel() > sample:
            s = s[torch.randperm(s.numel(), generator=gen)[:sample]]
        std = float(s.std()) if s.numel() > 1 else 1.0
        q = torch.quantile(s, grid)
        out.append(LayerFeatureStats(probe, bias, eps, float(s.mean()), std, q))
    return out, max_len
