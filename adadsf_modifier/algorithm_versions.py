"""Versions of the code that computes a compressed model's numbers, one per area.

Results computed elsewhere (the lab's study caches finished runs on disk) are keyed by
these numbers, not by a digest of the source, so that editing wording, the command line
or an unrelated method leaves every cached result valid. The price is a rule: **a change
that alters what an area computes bumps that area's number** (a different routed
forward, skip-path fit, threshold, alignment step or perplexity), which makes exactly
the results that exercise the area recompute. The lab's test
``test_a_tiny_run_recomputes_to_its_recorded_numbers`` recomputes one small run and
fails when its numbers move while these stay put.
"""

from __future__ import annotations

__all__ = ["ALGORITHM_VERSIONS"]

ALGORITHM_VERSIONS: dict[str, int] = {
    # the routed layer (prefill, decode, KV cache), token choice, skip paths, routers'
    # forward, FLOPs recording: everything a routed model runs at inference (2: the
    # router's MLP in float32, normalised before fc1; 3: rank routing keeps each row's
    # count of tokens that ran in a band around the ratio)
    "routing": 3,
    # AdaDSF's construction: calibration, allocation (and layer removal),
    # router warm start, skip-path fits, thresholds (2: thresholds fitted in one
    # walk of the decoder stack; 3: fitted in the last skip-path walk, whose maps are
    # then fit on the tokens the thresholds skip)
    "adadsf": 3,
    # FTP's construction: features, shared router, genetic schedule, router training,
    # thresholds (2: as adadsf's 2; 3: as adadsf's 3, fitted in the last skip-path walk)
    "ftp": 3,
    # the alignment fine-tune: losses, schedule, teacher, data rows
    "alignment": 1,
    # measurement: perplexity, lm-eval glue, FLOPs counts, speed benchmark, text splits
    "evaluation": 1,
}
