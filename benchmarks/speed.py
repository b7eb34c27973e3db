"""Speed of AdaDSF routing vs the dense model, side by side in one process.

    python benchmarks/speed.py                      # embedded SmolLM2-135M, retention 0.8
    python benchmarks/speed.py --seq-lens 256 1024 --batch-sizes 1 --repeats 3   # quicker

Builds the routed model with ``oneshot`` (AdaDSF, no alignment: speed depends on how many tokens
run each layer, not on router quality) from the same weights as the dense model, then prints
prefill latency and decoding time per step for both, the measured speedup and the FLOPs ideal.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local path or hub id (default: embedded SmolLM2)")
    p.add_argument("--retention", type=float, default=0.8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)

    import adadsf_modifier  # noqa: F401
    from compressed_tensors.offload import remove_dispatch
    from llmcompressor import oneshot

    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.evaluation import calibration_dataset, load_text_splits, resolve_model
    from adadsf_modifier.evaluation.speed import format_table, run_speed_benchmark

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    dense = load()
    t0 = time.perf_counter()
    routed = oneshot(
        model=load(),
        dataset=calibration_dataset(tok, args.calibration_samples, 256),
        recipe=[AdaDSFModifier(retention=args.retention)],
    ).eval()
    # oneshot leaves compressed-tensors offload wrappers on every module; the dense twin has none
    remove_dispatch(routed, onload_tensors=True)
    logger.info(f"routed model built in {time.perf_counter() - t0:.1f}s")

    test_text = "\n\n".join(load_text_splits()["test"]["text"])
    stream = torch.tensor(tok(test_text)["input_ids"], dtype=torch.long)
    results = run_speed_benchmark(
        dense, routed, stream, seq_lens=args.seq_lens, batch_sizes=args.batch_sizes,
        decode_prompt=args.decode_prompt, decode_tokens=args.decode_tokens, repeats=args.repeats,
    )
    header = (f"# AdaDSF speed, retention {args.retention}, {device.type} "
              f"({torch.get_num_threads()} threads), {dtype}, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}")
    print(header)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "command": " ".join(sys.argv),
                       "results": [r.as_dict() for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
