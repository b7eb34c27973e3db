#!/usr/bin/env bash
# Issue 13's time target at the pinned quality study's settings (docs/measurements.md §16):
# the shipped variant (adadsf_ridge_kv_err) at budget 0.81 with 50 alignment steps instead of
# 100, 3 seeds, in the pinned study's own cache (outputs/quality6_bf16; dense's key does not
# depend on the steps, so the pin's dense run is reused). One seed at budget 0.82 with 50
# steps took 21.5 minutes of alignment for 1.106x dense at 0.851 FLOPs; 100 steps at 0.81 took
# 49-59 minutes for 1.115 +- 0.028x at 0.837. These runs say whether half the steps keep the
# quality inside the 30 minutes. The results study's renderer leaves them out (its plan has
# 100 steps); render them on their own with --render-only and the same arguments. ~40 min a
# run on a 2-core CPU; commit them as they finish:
#   nohup benchmarks/keep_study_runs.sh > outputs/keep_runs.log 2>&1 &
# Extra arguments go to `adadsf study` (--max-hours, --max-runs, --plan, --render-only).
cd "$(dirname "$0")/.."
exec benchmarks/quality_study_829b1cc.sh --methods dense,adadsf_ridge_kv_err \
  --set tune_methods=adadsf_ridge_kv_err --set 'tune_rates={adadsf_ridge_kv_err: [[1e-4, 1e-4]]}' \
  --set align_steps=50 --output-dir "$PWD/outputs/variant_50_out" "$@"
