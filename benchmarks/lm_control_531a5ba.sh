#!/usr/bin/env bash
# The control the pinned results study's LM-loss verdict needs (docs/measurements.md §16.2):
# the dense model fine-tuned as `adadsf_lm_only` aligns (the study's `dense_lm` arm: the same
# 800 alignment rows per seed, 100 steps of 8 x 512, rates 1e-3 / 1e-3, bfloat16 weights with
# float32 masters, gradient clipping 1.0; layer 0 frozen), 3 seeds, at the settings of
# benchmarks/results_study_829b1cc.sh. The pin (829b1cc) has no such arm, so this runs at
# 531a5ba, the commit that added it; its dense run must reproduce the pin's (test 33.3137...)
# for the two to be paired by seed. tune=false with the rates set: the pin's adadsf_lm_only
# trained at those fixed rates (tune_rates), and a control is never tuned. Cached runs are
# committed to docs/study_runs_lm_control_531a5ba/main by
#   nohup benchmarks/keep_study_runs.sh outputs/lm_control/main \
#     docs/study_runs_lm_control_531a5ba/main > outputs/keep_control.log 2>&1 &
# Extra arguments go to `adadsf study` (--max-hours, --max-runs, --plan, --render-only).
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE exec benchmarks/pinned_study.sh 531a5ba \
  --methods dense,dense_lm --budgets 0.81 --seeds 3 \
  --set dtype=bfloat16 --set align_steps=100 --set align_routing=quantile \
  --set tune=false --set align_lr=1e-3 --set align_layer_lr=1e-3 \
  --set tune_budget=0.81 --set temperature=0.05 --set task_limit=100 \
  --cache-dir "$PWD/outputs/lm_control" --output-dir "$PWD/outputs/lm_control_out" "$@"
