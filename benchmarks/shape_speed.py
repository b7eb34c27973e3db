"""Speed of the shipped variant's routed layer at a real model's shape, with the kept
fraction forced, side by side with its dense twin.

    python benchmarks/shape_speed.py                        # SmolLM2-135M's shape
    python benchmarks/shape_speed.py --shape llama-3.2-1b   # Llama-3.2-1B's shape
    python benchmarks/shape_speed.py --retention 0.6 --decode-tokens 0
    python benchmarks/shape_speed.py --decode-batch 1 8      # batch-8 decoding too
    python benchmarks/shape_speed.py --compacted-kv          # the compacted prefill
    python benchmarks/shape_speed.py --rounds 4              # means, 95% intervals

Random weights: a config-built model of the shape, every decoder layer but the first
routed as the shipped recipe routes it (a rank-64 skip path, skipped tokens' keys and
values kept), with random routers. Random routers rank nothing, so calibrated
thresholds would not transfer; instead the thresholds are calibrated (the plug-in's
``calibrate_thresholds``, one bottom-up walk) on four random rows of 512 tokens, the
benchmark's own distribution, so every routed layer keeps ``--retention`` of such
tokens (the kept fraction is forced, as the issue asks of a speed test at a shape whose
routers were never trained; the table's ``kept (target)`` column shows what the timed
tokens really kept). Prefill (one forward of ``--seq-len`` tokens) and greedy decoding
(``--decode-tokens`` steps after a ``--decode-prompt`` prompt) run in causal mode,
timed by the
plug-in's own ``measure_prefill`` / ``measure_decode`` (the twins interleaved, medians,
the measured FLOPs of the same tokens): each speedup and the fraction of the FLOPs ideal
it reaches. The prefill is also set against the work it really runs
(:func:`executed_flops`: the FLOPs model leaves out what a routed layer computes and
drops), so the two ideals' gap is the design's extra work and the speedup's fraction of
the second how efficiently that work runs. Ratios only: absolute times on a shared CPU
mean little. ``--compacted-kv`` times the routed twin with its prefill on the compacted
batch (the kept tokens on their own, the skipped tokens' keys/values merged in) instead
of its attention on every token (``routed_layer.run_kept_mlp``), to compare the two
forms on a device (``benchmarks/gpu/speed.sh``).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig

from adadsf_modifier.evaluation.speed import (
    format_table,
    measure_decode,
    measure_prefill,
)
from adadsf_modifier.fitting.thresholds import calibrate_thresholds
from adadsf_modifier.routing import (
    SkipPath,
    TokenRouter,
    decoder_layers,
    route_layer,
    set_routing_mode,
)

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        rope_theta=100000.0,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0,
    ),
}  # fmt: skip


def build_twins(
    shape: str,
    retention: float,
    dtype: torch.dtype,
    rank: int,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(dense, routed)`` with identical weights, on ``device``; the routed twin's
    thresholds keep ``retention`` of a random sample's tokens at every routed layer
    (fitted there, on the scores the timed runs compute)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=True,
        rms_norm_eps=1e-5, attn_implementation="sdpa",
    )  # fmt: skip
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    routed = copy.deepcopy(dense)
    hidden = config.hidden_size
    for index, (_, layer) in enumerate(decoder_layers(routed)[1]):
        if index == 0:
            continue  # the shipped recipe keeps layer 0 dense
        skip = SkipPath(hidden, rank)
        with torch.no_grad():
            skip.down.normal_(0, 0.02)
            skip.up.normal_(0, 0.02)
        route_layer(layer, TokenRouter(hidden, 64), retention, index,
                    "past_key_values", config, skip_path=skip,
                    skipped_tokens_kv=True)  # fmt: skip
    # every threshold fitted on the inputs the causal model gives its layer (the
    # plug-in's own one-walk calibration), so a forward on this distribution keeps
    # ``retention`` at every routed layer, not only on the sample's top-k inputs
    dense, routed = dense.to(device), routed.to(device)
    sample = torch.randint(0, config.vocab_size, (4, 512))
    calibrate_thresholds(
        routed, [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])}
                 for row in sample]
    )  # fmt: skip
    set_routing_mode(routed, "causal")
    return dense, routed


@torch.inference_mode()
def executed_flops(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """FLOPs one prefill of ``input_ids`` really runs, as ``measure_prefill`` calls it:
    torch's ``FlopCounterMode`` over every matmul, the attention counted over its causal
    pairs (the counter charges the full square). Unlike the FLOPs model it also counts
    the work a routed layer runs and throws away (the skipped tokens' query and output
    projections, their attention rows: ``docs/flops.md``), so the speedup against this
    ideal says how efficiently the work is run, and the gap between the two ideals how
    much work the design adds."""
    n = input_ids.shape[1]
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    total = 0.0
    for op, flops in counter.get_flop_counts()["Global"].items():
        causal = "scaled_dot_product" in str(op)
        total += flops * ((n + 1) / (2 * n) if causal else 1.0)
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--retention", type=float, default=0.81)
    p.add_argument("--rank", type=int, default=64, help="skip path rank")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32, help="0: no decoding")
    p.add_argument(
        "--decode-batch", type=int, nargs="+", default=[1],
        help="rows decoded together (one timed decode per value)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=1,
        help="repeat the whole comparison; more than one prints each ratio's mean and "
        "95%% interval over the rounds (one run's ratio moves by several percent on a "
        "shared CPU)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="CPU intra-op threads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--compacted-kv", action="store_true",
        help="prefill the routed twin on the compacted batch, not its attention on "
        "every token",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.compacted_kv:
        from adadsf_modifier.routing import RoutedLayer

        RoutedLayer.attends_every_token = lambda layer: False
    torch.set_num_threads(args.threads)
    dense, routed = build_twins(
        args.shape, args.retention, getattr(torch, args.dtype), args.rank,
        device=args.device,
    )  # fmt: skip
    set_routing_mode(routed, "causal")
    vocab = dense.config.vocab_size
    where = args.device if args.device != "cpu" else f"cpu, {args.threads} threads"
    print(
        f"{args.shape}, {args.dtype}, {where}, retention {args.retention} forced, "
        "causal routing" + (", compacted kv prefill" if args.compacted_kv else "")
    )
    ids = torch.randint(0, vocab, (1, args.seq_len), device=args.device)
    prompts = [
        torch.randint(0, vocab, (batch, args.decode_prompt))
        for batch in (args.decode_batch if args.decode_tokens else [])
    ]
    executed = executed_flops(routed, ids) / executed_flops(dense, ids)
    rounds = []
    for _ in range(args.rounds):
        results = [measure_prefill(dense, routed, ids, args.repeats)]
        for prompt in prompts:
            results.append(
                measure_decode(dense, routed, prompt, args.decode_tokens, args.repeats)
            )
        print(format_table(results))
        rounds.append(results)
    speedup = statistics.mean(r[0].speedup for r in rounds)
    print(
        f"prefill, executed work (FlopCounterMode: every matmul the forward runs, "
        f"attention over causal pairs): the routed twin runs {executed:.3f} of the "
        f"dense twin's, an ideal of {1 / executed:.3f}x; the measured {speedup:.3f}x "
        f"(the rounds' mean) is {speedup * executed:.2f} of it"
    )
    if args.rounds > 1:
        from adadsf_lab.study.stats import mean_ci  # the lab's t interval

        for column, first in enumerate(rounds[0]):
            speed = mean_ci([r[column].speedup for r in rounds])
            share = mean_ci([r[column].speedup / r[column].flops_ideal for r in rounds])
            print(
                f"{first.kind} b={first.batch_size} over {args.rounds} rounds: "
                f"{speed.mean:.3f}x +- {speed.ci95:.3f}, "
                f"{share.mean:.2f} +- {share.ci95:.2f} of the FLOPs ideal "
                "(mean, 95% interval)"
            )


if __name__ == "__main__":
    main()
