#!/usr/bin/env bash
# Issue 13 item 4's training levers on the shipped variant, one seed at a time:
# benchmarks/variant_50_steps_829b1cc.sh's runs (the variant at budget 0.81, 50 alignment
# steps, the pinned 829b1cc quality study's settings and cache) with one setting changed:
#   anneal   each routed layer's retention falls linearly from 1.0 to its allocation over the
#            first 25 steps (align_anneal_steps; DLO, arXiv 2407.11030); measured:
#            docs/measurements.md §16.5
#   seq1024  rows of 1024 tokens, 4 a step instead of 8 x 512: the same tokens per step, each
#            with twice the context (the routers and layers train on longer-range attention;
#            the study's perplexity windows stay 512 tokens, its prefill timing 1024)
#   routers_first  the first 25 steps train the routers and skip paths alone, the layers'
#            weights join after (align_routers_first_steps; SkipGPT, arXiv 2506.04179). The
#            pin lacks the field, so this runs the package as of ROUTERS_FIRST_PIN (the commit
#            that added it) in its own cache, outputs/routers_first_cache, twice: unchanged
#            (the baseline on that code: 829b1cc's 35.21 if nothing else changed), then with
#            the field (keep those runs with: benchmarks/keep_study_runs.sh
#            outputs/routers_first_cache/main docs/study_runs_cpu_2b9efac_probe/main; a
#            --max-hours applies to each of the two invocations)
# Seed 0 first: its validation PPL against the unchanged 50-step seed 0 (§16.3: 35.21) decides
# whether the 3 seeds are worth their ~2 hours (validation to choose, test to report). Extra
# arguments go to `adadsf study` (e.g. --seeds 3 --max-hours H); render like the 50-step
# runs, with --render-only and the same arguments. Keep the runs as they finish:
#   nohup benchmarks/keep_study_runs.sh > outputs/keep_runs.log 2>&1 &
# Usage: benchmarks/variant_probe_829b1cc.sh anneal|seq1024|routers_first [adadsf study arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PROBE=${1:?usage: $0 anneal|seq1024|routers_first [adadsf study arguments]}; shift
case $PROBE in
  anneal) SET=(--set align_anneal_steps=25) ;;
  seq1024) SET=(--set align_seq_len=1024 --set align_batch_size=4) ;;
  routers_first)
    export STUDY_PIN=${ROUTERS_FIRST_PIN:-2b9efac}
    CACHE=(--cache-dir "$PWD/outputs/routers_first_cache")
    benchmarks/variant_50_steps_829b1cc.sh --seeds 1 "${CACHE[@]}" \
      --output-dir "$PWD/outputs/variant_routers_first_base_out" "$@"
    SET=(--set align_routers_first_steps=25 "${CACHE[@]}") ;;
  *) echo "unknown probe $PROBE: anneal, seq1024 or routers_first" >&2; exit 2 ;;
esac
exec benchmarks/variant_50_steps_829b1cc.sh --seeds 1 "${SET[@]}" \
  --output-dir "$PWD/outputs/variant_${PROBE}_out" "$@"
