#!/usr/bin/env bash
# Issue 13, item 4 (retention annealing, DLO arXiv 2407.11030), never measured on the shipped
# variant: benchmarks/variant_50_steps_829b1cc.sh's runs (the variant at budget 0.81, 50
# alignment steps, the pinned 829b1cc quality study's settings and cache) with each routed
# layer's retention falling linearly from 1.0 to its allocation over the first 25 steps
# (align_anneal_steps, in the pin's AdaDSFModifier). Seed 0 first: its validation PPL against
# the unannealed 50-step seed 0 decides whether the 3 seeds are worth their ~2 hours
# (validation to choose, test to report). Extra arguments go to `adadsf study` (e.g.
# --seeds 3 --max-hours H); render like the 50-step runs, with --render-only and the same
# arguments. Keep the runs as they finish:
#   nohup benchmarks/keep_study_runs.sh > outputs/keep_runs.log 2>&1 &
cd "$(dirname "$0")/.."
exec benchmarks/variant_50_steps_829b1cc.sh --seeds 1 --set align_anneal_steps=25 \
  --output-dir "$PWD/outputs/variant_anneal_out" "$@"
