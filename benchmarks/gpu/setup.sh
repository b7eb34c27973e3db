#!/usr/bin/env bash
# Call 1 on the GPU machine (see README.md here): install the carried wheels and data
# outside the repository (they survive while the machine stays warm), then smoke-test
# the whole study pipeline on a tiny config-built model on the GPU.
set -uo pipefail
PY=${PY:-python3}
STAGE=${STAGE:-/tmp/adadsf_gpu}
OUT=${OUT:-/tmp/adadsf_out}
mkdir -p "$STAGE/site" "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  $PY -m pip install -q --no-deps --no-index --target "$STAGE/site" .gpu/wheels/*.whl 2>&1 | tail -3
fi
tar -C "$STAGE" -xJf .gpu/stage.tar.xz
cp .gpu/gguf_a/part "$STAGE/gguf_a"
export PYTHONPATH=$PWD:$PWD/lab:$STAGE/pkgs:$STAGE/site ADADSF_CACHE=$STAGE/cache
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv 2>&1 | tail -2
$PY - <<'PY'
import importlib.metadata as md, torch
for d in ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm_eval",
          "datasets", "pydantic", "pyarrow", "fsspec", "accelerate", "numpy"):
    try:
        print(d, md.version(d))
    except Exception as e:
        print(d, "MISSING", e)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import adadsf_modifier, lm_eval.evaluator  # noqa: F401
print("imports ok:", adadsf_modifier.__file__)
PY
# the whole study pipeline on a tiny model, every method family, on this device
$PY - <<'PY' 2>&1 | tail -25
import sys, json, time
sys.path.insert(0, "tests")
import tiny_models as tm
from transformers import AutoModelForCausalLM
from adadsf_lab.study.command import main
t = time.time()
cfg = tm.tiny_config("llama", 8)
cfg.hidden_size, cfg.intermediate_size = 128, 256  # room for the rank-64 skip path
d = "/tmp/adadsf_tiny"
AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
tm.tiny_tokenizer().save_pretrained(d)
tiny = ["--set", "calib_samples=4", "--set", "calib_seq_len=32", "--set", "router_hidden_size=4",
        "--set", "router_init_steps=5", "--set", "router_init_tokens=64", "--set", "align_steps=2",
        "--set", "align_seq_len=32", "--set", "tune_lrs=1e-3", "--set", "tune_temperatures=0.05,0.1",
        "--set", "ppl_tokens=128", "--set", "ppl_val_tokens=96", "--set", "ppl_max_length=64",
        "--set", "ppl_stride=32", "--set", "tasks=piqa,hellaswag", "--set", "task_limit=4",
        "--set", "flops_seq_len=32", "--set", "speed_seq_len=32", "--set", "speed_batch_sizes=1,2",
        "--set", "decode_prompt=8", "--set", "decode_tokens=2", "--set", "ablation_seeds=1",
        "--set", "calib_batch_size=2", "--set", "ppl_batch_size=4"]
code = main(["--quick", "--model", d, "--cache-dir", "/tmp/adadsf_smoke_cache", "--output-dir",
             "/tmp/adadsf_smoke", "--overwrite", "--methods",
             "dense,adadsf,adadsf_ridge_kv,layer_drop,layer_drop_ridge,layer_drop_healed,ftp,adadsf_w8a8",
             "--budgets", "0.8", "--seeds", "2", *tiny])
res = json.load(open("/tmp/adadsf_smoke/results.json"))
print("SMOKE exit", code, "failed:", res["failed"], "computed:", res["runtime"]["runs_computed"],
      "device:", res["hardware"].get("device"), f"{time.time() - t:.0f}s")
for r in res["runs"]:
    print(" ", r["method"], r["seed"], "ppl", round(r.get("ppl_test") or -1, 2), "flops",
          round(r.get("normalized_flops") or -1, 3), "prefill", r.get("prefill_speedup"))
PY
cp /tmp/adadsf_smoke/results.json "$OUT/smoke_results.json" 2>/dev/null || true
