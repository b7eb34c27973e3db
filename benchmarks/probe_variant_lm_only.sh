#!/usr/bin/env bash
# One-seed probe (issue 13, docs/measurements.md §16.1): the shipped variant aligned on the
# causal-LM loss alone (adadsf_ridge_kv_err_lm_only), at the quality study's settings but
# budget 0.82 and 50 alignment steps, the setting of the pinned variant run of §16; no lm-eval
# tasks, no speed. Pinned to e23865d, the commit it ran at; cached runs in
# docs/study_runs_probe_e23865d_lm_only/main (copy them to outputs/lm_probe/main to resume or
# render). Extra arguments go to `adadsf study`.
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE exec benchmarks/pinned_study.sh e23865d \
  --methods dense,adadsf_ridge_kv_err_lm_only --budgets 0.82 --seeds 1 \
  --set dtype=bfloat16 --set align_steps=50 --set align_routing=quantile \
  --set tune_budget=0.82 --set tune_temperatures=0.05 \
  --set tune_methods=adadsf_ridge_kv_err_lm_only \
  --set 'tune_rates={adadsf_ridge_kv_err_lm_only: [[1e-4, 1e-4]]}' \
  --set flops_reference=adadsf_ridge_kv_err_lm_only --set speed=false --set 'tasks=[]' \
  --cache-dir "$PWD/outputs/lm_probe" --output-dir "$PWD/outputs/lm_probe_out" "$@"
