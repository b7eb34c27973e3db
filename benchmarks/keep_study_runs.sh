#!/usr/bin/env bash
# Keep a study's finished runs: every INTERVAL seconds, copy each run JSON of one phase folder
# of the study cache (FROM/<method>/<key>.json; outputs/ is git-ignored) that git does not
# track in TO yet, and commit it alone (on whatever branch is checked out), so that a run
# survives the session that computed it. Why: a session ends where it stands,
# its machine may not come back, and an uncommitted run is lost with it; the study writes a
# run's JSON atomically (study/cache.py), so a file seen here is complete.
# Usage: benchmarks/keep_study_runs.sh [FROM [TO [INTERVAL]]]   (runs until killed; FROM and TO
# relative to the repository root)
# Defaults: the pinned results/quality study's cache, outputs/quality6_bf16/main ->
# docs/study_runs_cpu_829b1cc_quality/main, every 60 s. Start it beside the study:
#   nohup benchmarks/keep_study_runs.sh > outputs/keep_runs.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/.."
FROM=${1:-outputs/quality6_bf16/main}
TO=${2:-docs/study_runs_cpu_829b1cc_quality/main}
INTERVAL=${3:-60}
[ -d "$FROM" ] || { echo "no study cache at $FROM" >&2; exit 2; }
[[ $INTERVAL =~ ^[0-9]+$ ]] && [ "$INTERVAL" -gt 0 ] || { echo "INTERVAL: not a number of seconds: $INTERVAL" >&2; exit 2; }
while true; do
  for f in "$FROM"/*/*.json; do
    [ -e "$f" ] || continue
    d=$TO/${f#"$FROM"/}
    git cat-file -e "HEAD:$d" 2>/dev/null && continue  # committed already
    # a copy under a temporary name, then renamed: docs/ never holds half a run
    mkdir -p "$(dirname "$d")" && cp "$f" "$d.tmp" && mv "$d.tmp" "$d" || continue
    method=$(basename "$(dirname "$d")")
    if git add -- "$d" && git commit -q -m "study runs: $method, a new run (kept as it finished)" -- "$d"; then
      echo "$(date -u +%FT%TZ) committed $d"
    else
      # not committed (e.g. another git command held the index): unstage it and try
      # again next round; say so if even that fails
      git reset -q -- "$d" || echo "$(date -u +%FT%TZ) could not unstage $d" >&2
    fi
  done
  sleep "$INTERVAL"
done
