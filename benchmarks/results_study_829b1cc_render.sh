#!/usr/bin/env bash
# Render the results study's cached runs (docs/study_runs_cpu_829b1cc_quality/main, where
# benchmarks/keep_study_runs.sh commits each finished run) with main's renderer and the
# results study's own arguments (benchmarks/results_study_829b1cc.sh), computing nothing:
# docs/RESULTS.md, docs/results.json and the plots. Pending runs are listed under "Not
# finished". Rendering into docs/ (the default) also renders the README's quality table from
# docs/results.json (benchmarks/readme_quality_table.py).
# Usage: benchmarks/results_study_829b1cc_render.sh [OUTPUT_DIR (default docs)]
set -e
cd "$(dirname "$0")/.."
STUDY_WITH_MAIN=1 nice benchmarks/results_study_829b1cc.sh --render-only \
  --cache-dir "$PWD/docs/study_runs_cpu_829b1cc_quality" \
  --output-dir "${1:-$PWD/docs}"
if [ -z "$1" ]; then
  .venv/bin/python benchmarks/readme_quality_table.py --results docs/results.json
fi
