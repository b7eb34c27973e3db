#!/usr/bin/env bash
# Keep a study's finished runs: every INTERVAL seconds, copy each run JSON of the study cache
# (outputs/, git-ignored) that the committed cache folder (docs/) lacks, and commit it alone,
# so that a run survives the session that computed it. Why: a session ends where it stands,
# its machine may not come back, and an uncommitted run is lost with it; the study writes a
# run's JSON atomically (study/cache.py), so a file seen here is complete.
# Usage: benchmarks/keep_study_runs.sh [FROM [TO [INTERVAL]]]   (runs until killed)
# Defaults: the pinned results/quality study's cache, outputs/quality6_bf16/main ->
# docs/study_runs_cpu_829b1cc_quality/main, every 60 s. Start it beside the study:
#   nohup benchmarks/keep_study_runs.sh > outputs/keep_runs.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/.."
FROM=${1:-outputs/quality6_bf16/main}
TO=${2:-docs/study_runs_cpu_829b1cc_quality/main}
INTERVAL=${3:-60}
[ -d "$FROM" ] || { echo "no study cache at $FROM" >&2; exit 2; }
while true; do
  for f in "$FROM"/*/*.json; do
    [ -e "$f" ] || continue
    d=$TO/${f#"$FROM"/}
    [ -e "$d" ] && continue
    mkdir -p "$(dirname "$d")" && cp "$f" "$d"
    method=$(basename "$(dirname "$d")")
    if git add -- "$d" && git commit -q -m "study runs: $method, a new run (kept as it finished)" -- "$d"; then
      echo "$(date -u +%FT%TZ) committed $d"
    else
      rm -f -- "$d"  # not committed (e.g. the index was locked): try again next round
      git reset -q -- "$d" 2>/dev/null
    fi
  done
  sleep "$INTERVAL"
done
