#!/usr/bin/env bash
# The results study (issues 12 and 15) on the quality study's pin and cache (829b1cc,
# outputs/quality6_bf16): the same settings, so its dense, uniform, healed-layer-removal and
# variant runs are shared (their keys do not depend on which other methods are in the
# study), plus the paper's AdaDSF, reversed, random, layer removal without training, AdaDSF
# without alignment / with the LM loss only, FTP (also with the variant's ridge skip path
# and kept keys/values: ftp_ridge_kv) and AdaDSF + W8A8, all at budget 0.81, 3 seeds. The
# identity-skip-path methods train at uniform's fixed rates (1e-3, chosen on the validation
# split at c64a006; no tuning run). Resume it like the quality study: first copy
# docs/study_runs_cpu_829b1cc_quality/main to outputs/quality6_bf16/main. Extra arguments go
# to `adadsf study` (--max-hours, --max-runs, --plan). Render for docs/ with main's
# renderer: benchmarks/results_study_829b1cc_render.sh (it adds the quality targets).
cd "$(dirname "$0")/.."
RATES='{adadsf_ridge_kv_err: [[1e-4, 1e-4]], uniform: [[1e-3, 1e-3]], layer_drop_healed: [[1e-3, 1e-3]], adadsf: [[1e-3, 1e-3]], reversed: [[1e-3, 1e-3]], random: [[1e-3, 1e-3]], adadsf_lm_only: [[1e-3, 1e-3]], adadsf_w8a8: [[1e-3, 1e-3]]}'
exec benchmarks/quality_study_829b1cc.sh \
  --methods dense,adadsf_ridge_kv_err,uniform,layer_drop_healed,adadsf,reversed,random,layer_drop,adadsf_no_align,adadsf_lm_only,ftp,ftp_ridge_kv,adadsf_w8a8 \
  --set tune_methods=adadsf_ridge_kv_err,uniform,layer_drop_healed,adadsf,reversed,random,adadsf_lm_only,adadsf_w8a8 \
  --set "tune_rates=$RATES" --set w8a8_budgets=0.81 \
  --output-dir "$PWD/outputs/results_829b1cc_out" "$@"
