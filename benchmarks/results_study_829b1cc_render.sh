#!/usr/bin/env bash
# Render the results study's cached runs (docs/study_runs_cpu_829b1cc_quality/main, where the
# watcher copies each finished run) with main's renderer and the results study's own
# arguments (benchmarks/results_study_829b1cc.sh), computing nothing. Pending runs are listed
# under "Not finished". Usage: benchmarks/results_study_829b1cc_render.sh [OUTPUT_DIR]
cd "$(dirname "$0")/.."
STUDY_WITH_MAIN=1 exec nice benchmarks/results_study_829b1cc.sh --render-only \
  --cache-dir "$PWD/docs/study_runs_cpu_829b1cc_quality" \
  --output-dir "${1:-$PWD/docs/study_runs_cpu_829b1cc_results}"
