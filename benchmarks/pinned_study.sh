#!/usr/bin/env bash
# Run `adadsf study` with the package as of COMMIT, from a git worktree beside this
# checkout, so that a study spread over several sessions keeps its run keys (they
# include a digest of the package source) while main moves on.
# Usage: benchmarks/pinned_study.sh COMMIT [adadsf study arguments; absolute paths]
# STUDY_WITH_MAIN=1 runs this checkout's package instead: to render a pinned study's cached
# runs with main's renderer (--render-only takes the versions in the keys from the runs).
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=$(git rev-parse "$1^{commit}"); shift
WT=${PINNED_DIR:-$(cd .. && pwd)/study_pinned_${COMMIT:0:10}}
PY=${PY:-$PWD/.venv/bin/python}
[ "${STUDY_WITH_MAIN:-0}" = 1 ] && exec "$PY" -m adadsf_modifier.study "$@"
[ -d "$WT" ] || git worktree add --detach "$WT" "$COMMIT"
[ "$(git -C "$WT" rev-parse HEAD)" = "$COMMIT" ] || { echo "$WT is not at $COMMIT" >&2; exit 2; }
cd "$WT"  # python -m puts the working directory first on sys.path: the pinned package
exec "$PY" -m adadsf_modifier.study "$@"
