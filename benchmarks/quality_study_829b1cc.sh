#!/usr/bin/env bash
# The quality study (issue 13), pinned to 829b1cc (benchmarks/gpu/README.md item 4), resumed
# from its cache: first copy docs/study_runs_cpu_829b1cc_quality/main to
# outputs/quality6_bf16/main. Extra arguments go to `adadsf study` (e.g. --max-hours 2.2, so
# that no run starts that cannot finish in the session: an unfinished run is not cached).
# STUDY_PIN=COMMIT runs the same settings with the package as of COMMIT instead (a probe of a
# field 829b1cc lacks; give it its own --cache-dir: its keys differ from the pin's anyway).
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE exec benchmarks/pinned_study.sh "${STUDY_PIN:-829b1cc}" \
  --methods dense,adadsf_ridge_kv_err,uniform,layer_drop_healed --budgets 0.81 \
  --seeds 3 --set dtype=bfloat16 --set align_steps=100 --set align_routing=quantile \
  --set tune_budget=0.81 --set tune_temperatures=0.05 \
  --set tune_methods=adadsf_ridge_kv_err,uniform,layer_drop_healed \
  --set 'tune_rates={adadsf_ridge_kv_err: [[1e-4, 1e-4]], uniform: [[1e-3, 1e-3]], layer_drop_healed: [[1e-3, 1e-3]]}' \
  --set flops_reference=adadsf_ridge_kv_err --set task_limit=100 \
  --cache-dir $PWD/outputs/quality6_bf16 --output-dir $PWD/outputs/quality6_bf16_out "$@"
