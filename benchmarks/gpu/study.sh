#!/usr/bin/env bash
# Call 2 on the GPU machine (see README.md here): join the GGUF, rebuild the model's
# weights, run the study under a time budget, return its outputs and run cache.
# Usage: benchmarks/gpu/study.sh MAX_HOURS [adadsf study arguments...]
set -uo pipefail
PY=${PY:-python3}
STAGE=${STAGE:-/tmp/adadsf_gpu}
OUT=${OUT:-/tmp/adadsf_out}
MAX_HOURS=$1; shift
export PYTHONPATH=$PWD:$PWD/lab:$STAGE/pkgs:$STAGE/site ADADSF_CACHE=$STAGE/cache
mkdir -p "$OUT" "$STAGE/study_cache"
# the committed runs (docs/results/runs): reused where their keys match
cp -rn docs/results/runs/. "$STAGE/study_cache/"
cat "$STAGE/gguf_a" .gpu/gguf_b/part > "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "$(cat .gpu/gguf_b/sha256)  $STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
$PY benchmarks/gpu/prime_model.py "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" \
  "$STAGE/cache/smollm2-135m-instruct" 2>&1 | tail -2
(timeout "${STUDY_TIMEOUT:-520}" $PY -m adadsf_lab.study \
  --max-hours "$MAX_HOURS" --cache-dir "$STAGE/study_cache" --output-dir "$STAGE/docs" \
  --overwrite "$@") > "$OUT/study_log.txt" 2>&1
echo "study exit $?"
tar -C "$STAGE" -czf "$OUT/study.tgz" docs study_cache
grep -E "adadsf study:|failed|Error" "$OUT/study_log.txt" | tail -20
cp "$STAGE/docs/results.json" "$STAGE/docs/RESULTS.md" "$OUT/" 2>/dev/null
ls -la "$OUT"
