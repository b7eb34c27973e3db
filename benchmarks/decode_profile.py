"""Where decoding time goes: routed vs dense, with the routing switched off piece by
piece.

    OMP_NUM_THREADS=1 python benchmarks/decode_profile.py                  # embedded
    SmolLM2, r=0.8 OMP_NUM_THREADS=1 python benchmarks/decode_profile.py --routed PATH
    # an AdaDSF checkpoint

For each batch size it times greedy decoding steps (after an untimed prompt) of the
dense model and of the routed model in three settings, interleaved, median of
``--repeats``:

* ``routed``       - as calibrated (tokens skip layers)
* ``all-run``      - thresholds at -inf: every token runs every layer, so the ratio to
  dense is the pure cost of routing (router, bookkeeping, the routed cache)
* ``all-run, no router`` - as ``all-run`` with the router replaced by a free stub: what
  is left is the routed layer's own bookkeeping

and prints the operator table of ``torch.profiler`` for the dense and routed decoding
steps (``--profile``). Ratios, not absolute times, are the result on a shared CPU.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager

import torch


@contextmanager
def _stub_routers(model, enabled):
    from adadsf_modifier.routing import routed_layers

    layers = routed_layers(model)
    if enabled:
        for layer in layers:
            layer.router.forward = lambda h: h[
                ..., 0
            ]  # instance attribute shadows the method
    try:
        yield
    finally:
        for layer in layers:
            layer.router.__dict__.pop("forward", None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--routed", default=None, help="AdaDSF checkpoint (default: build one, r=0.8)"
    )
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--profile", action="store_true", help="print torch.profiler operator tables"
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import atexit
    import shutil
    import tempfile

    from _common import build_routed_checkpoint, thresholds_at
    from transformers import AutoTokenizer

    from adadsf_modifier.evaluation import load_text_splits, resolve_model
    from adadsf_modifier.evaluation.speed import _decode_loop, load_pair

    torch.set_num_threads(args.threads)
    path = args.routed
    if path is None:
        path = tempfile.mkdtemp(prefix="adadsf-profile-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        build_routed_checkpoint(resolve_model(None), path, args.retention)
    dense, routed = load_pair(path)
    tok = AutoTokenizer.from_pretrained(path)
    text = "\n\n".join(load_text_splits()["test"]["text"])
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)

    settings = [
        ("routed", None, False),
        ("all-run", float("-inf"), False),
        ("all-run, no router", float("-inf"), True),
    ]
    for b in args.batch_sizes:
        prompt = ids[: b * args.prompt].view(b, args.prompt)
        times: dict[str, list[float]] = {"dense": []} | {
            name: [] for name, _, _ in settings
        }
        _decode_loop(dense, prompt, 2)
        _decode_loop(routed, prompt, 2)
        for _ in range(args.repeats):
            times["dense"].append(_decode_loop(dense, prompt, args.tokens)[0])
            for name, thr, stub in settings:
                with thresholds_at(routed, thr), _stub_routers(routed, stub):
                    times[name].append(_decode_loop(routed, prompt, args.tokens)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"\n## decode, batch {b}, prompt {args.prompt}, {args.tokens} steps, "
            f"{torch.get_num_threads()} thread(s)"
        )
        print("| model | ms/step | dense / this |\n|---|---|---|")
        for k, v in med.items():
            print(f"| {k} | {v * 1e3:.2f} | {med['dense'] / v:.3f}x |")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, model in (("dense", dense), ("routed", routed)):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    _decode_loop(model, prompt, args.tokens)
                print(f"\n### {name} (prompt prefill included)")
                print(
                    prof.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=12
                    )
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
