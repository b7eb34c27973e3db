"""Speed of AdaDSF routing vs the dense model, side by side in one process.

    python benchmarks/speed.py      # embedded SmolLM2-135M, retention 0.8
    python benchmarks/speed.py --seq-lens 256 1024 --batch-sizes 1 --repeats 3  # short
    python benchmarks/speed.py --field skip_path=ridge --field skipped_tokens_kv=true

Builds the routed model with ``oneshot`` (AdaDSF, no alignment: speed depends on how
many tokens run each layer, not on router quality), saves it, and loads dense and routed
twins from that one checkpoint (identical weights, loaded alike: see ``load_pair``),
then prints prefill latency and decoding time per step for both, the measured speedup
and the FLOPs ideal.
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import shutil
import sys
import tempfile
import time

import torch
import yaml
from loguru import logger
from transformers import AutoTokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="local path or hub id (default: embedded SmolLM2)"
    )
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an AdaDSFModifier field of the routed model, VALUE in YAML (repeatable), "
        "e.g. --field skip_path=ridge --field skipped_tokens_kv=true",
    )
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="*",
        default=[256, 1024, 2048],
        help="prefill lengths; none (a bare --seq-lens) skips prefill",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32, help="0 skips decoding")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--decode-repeats", type=int, default=None, help="default max(7, --repeats)"
    )
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument(
        "--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    fields = {}
    for item in args.field:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            p.error(f"--field {item!r}: expected KEY=VALUE")
        fields[key] = yaml.safe_load(raw)

    from _common import build_routed_checkpoint

    from adadsf_modifier.evaluation import load_text_splits, resolve_model
    from adadsf_modifier.evaluation.speed import (
        check_speed_grid,
        format_table,
        load_pair,
        run_speed_benchmark,
    )

    try:  # before minutes of building: a grid with nothing to time is refused now
        check_speed_grid(
            args.seq_lens,
            args.batch_sizes,
            args.decode_prompt,
            args.decode_tokens,
            args.repeats,
            args.decode_repeats,
        )
    except ValueError as err:
        p.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = getattr(
        torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    )
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)

    t0 = time.perf_counter()
    # kept until exit: the reloaded weights are memory-mapped from these files
    checkpoint = tempfile.mkdtemp(prefix="adadsf-speed-")
    atexit.register(shutil.rmtree, checkpoint, ignore_errors=True)
    build_routed_checkpoint(
        path,
        checkpoint,
        args.retention,
        args.calibration_samples,
        dtype=dtype,
        fields=fields,
    )
    # both twins from the saved checkpoint, loaded alike (see load_pair)
    dense, routed = load_pair(checkpoint, dtype=dtype, device=device)
    logger.info(f"routed model built and reloaded in {time.perf_counter() - t0:.1f}s")

    test_text = "\n\n".join(load_text_splits()["test"]["text"])
    stream = torch.tensor(tok(test_text)["input_ids"], dtype=torch.long)
    results = run_speed_benchmark(
        dense,
        routed,
        stream,
        seq_lens=args.seq_lens,
        batch_sizes=args.batch_sizes,
        decode_prompt=args.decode_prompt,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        decode_repeats=args.decode_repeats,
    )
    header = (
        f"# AdaDSF speed, retention {args.retention}"
        f"{''.join(f', {k}={v}' for k, v in fields.items())}, {device.type} "
        f"({torch.get_num_threads()} threads), {dtype}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}"
    )
    print(header)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "command": " ".join(sys.argv),
                    "results": [r.as_dict() for r in results],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
