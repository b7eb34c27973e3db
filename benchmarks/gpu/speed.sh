#!/usr/bin/env bash
# The speed grid on a lent GPU machine, in one call after setup.sh (call 1, see README.md
# here; it only needs the wheels: no model weights, the shapes are config-built): the
# shipped variant's routed layer against its dense twin at SmolLM2-135M's and
# Llama-3.2-1B's shapes, the kept fraction forced, prefill and decode at batch 1 and 8,
# bfloat16; then each shape's decoding bounds (benchmarks/decode_bounds.py).
# Usage: bash benchmarks/gpu/speed.sh   (writes $OUT/speed_grid.txt, speed_compacted.txt,
# decode_bounds.txt)
set -uo pipefail
PY=${PY:-python3}
STAGE=${STAGE:-/tmp/adadsf_gpu}
OUT=${OUT:-/tmp/adadsf_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/lab:$STAGE/pkgs:$STAGE/site
for shape in smollm2-135m llama-3.2-1b; do
  for retention in 0.81 0.6; do
    for seq in 1024 4096; do
      $PY benchmarks/shape_speed.py --shape "$shape" --retention "$retention" \
        --seq-len "$seq" --decode-tokens $([ "$seq" = 1024 ] && echo 64 || echo 0) \
        --decode-batch 1 8 --repeats 7 --device cuda 2>&1 | grep -v WARNING
    done
  done
done | tee "$OUT/speed_grid.txt"
# the compacted prefill of the kv-keeping layers against the default (attention on every
# token, the MLP on the kept ones), same grid point as above (lab/NOTEBOOK.md section 33)
for shape in smollm2-135m llama-3.2-1b; do
  $PY benchmarks/shape_speed.py --shape "$shape" --retention 0.81 --seq-len 1024 \
    --decode-tokens 0 --repeats 7 --compacted-kv --device cuda 2>&1 | grep -v WARNING
done | tee "$OUT/speed_compacted.txt"
# a decoding step's bounds (every token running / skipping) and what a mode sharing
# decisions across a batch's rows could reach (lab/NOTEBOOK.md section 25)
for shape in smollm2-135m llama-3.2-1b; do
  $PY benchmarks/decode_bounds.py --shape "$shape" --batch 1 8 --steps 32 \
    --repeats 7 --device cuda 2>&1 | grep -v WARNING
done | tee "$OUT/decode_bounds.txt"
