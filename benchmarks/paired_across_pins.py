"""Pair an arm of one pinned study with its dense control computed at another commit,
seed by seed, with the study's own statistics (docs/measurements.md §16.2).

The pinned results study (829b1cc) has no dense control arm, and every cached run's key
holds the code's digest, so the control (``dense_lm``, run by
benchmarks/lm_control_531a5ba.sh) cannot join that study's cache. This reads both
caches, checks that they measure alike (the two dense runs give the same perplexities
and share the evaluation settings; the arm and its control trained on the same rows with
the same alignment settings), and reports, per seed and as paired differences with 95%
intervals:

* the arm against its control (what depth sparsity costs under that training);
* the arm's test PPL over its control's against the KL-aligned arm's over dense (what
  the LM loss gains once the corpus it adapts to is taken out).

    python benchmarks/paired_across_pins.py \\
        --pin docs/study_runs_cpu_829b1cc_quality \\
        --control docs/study_runs_lm_control_531a5ba
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from adadsf_modifier.study.cache import RunCache
from adadsf_modifier.study.stats import paired_difference, verdict

_ALIGNMENT = (
    "steps", "lr", "layer_lr", "lr_schedule", "warmup_steps", "batch_size", "seq_len",
    "trainable", "grad_clip", "weight_decay", "seed", "bf16",
)  # fmt: skip


def _runs(
    cache: list[dict[str, Any]], method: str, budget: float, where: Path
) -> dict[int, dict[str, Any]]:
    """``{seed: cache entry}`` of ``method``'s main runs at ``budget``."""
    out = {}
    for entry in cache:
        cfg = entry["config"]
        if (cfg["phase"], cfg["method"], cfg["budget"]) == ("main", method, budget):
            if cfg["seed"] in out:
                raise SystemExit(f"{where}: two {method} runs of seed {cfg['seed']}")
            out[cfg["seed"]] = entry
    if not out:
        raise SystemExit(f"no main run of {method} at {budget} in {where}")
    return out


def _check_alike(d_pin: dict, d_ctl: dict, arm: dict, ctl: dict) -> None:
    """Refuse to pair runs that were not measured (the two dense runs) or trained
    (the arm and its control) alike."""
    for k in ("ppl_test", "ppl_val", "task_mean"):
        if d_pin["record"][k] != d_ctl["record"][k]:
            raise SystemExit(
                f"dense {k} differs between the caches ({d_pin['record'][k]} vs "
                f"{d_ctl['record'][k]}): they do not measure alike"
            )
    for k in ("eval", "dtype", "device", "model"):
        if d_pin["config"][k] != d_ctl["config"][k]:
            raise SystemExit(f"the dense runs' {k!r} settings differ")
    for seed, c in ctl.items():
        a = arm.get(seed)
        if a is None:
            continue
        mod, ft = a["config"]["modifier"], c["config"]["finetune"]
        wrong = [k for k in _ALIGNMENT if mod[f"align_{k}"] != ft[k]]
        w = (mod["align_w_kl"], mod["align_w_hidden"], mod["align_w_lm"])
        if w != tuple(ft["weights"][k] for k in ("kl", "hidden", "lm")):
            wrong.append("loss weights")
        if mod["ignore"] != ft["ignore"]:
            wrong.append("ignore")
        for k in ("align_rows", "align_seq_len", "text_seed"):
            if a["config"]["data"][k] != c["config"]["data"][k]:
                wrong.append(k)
        if wrong:
            raise SystemExit(f"seed {seed}: the arm and its control differ in {wrong}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pin", type=Path, required=True, help="the pinned study's cache")
    p.add_argument("--control", type=Path, required=True, help="the control's cache")
    p.add_argument("--arm", default="adadsf_lm_only")
    p.add_argument("--control-method", default="dense_lm")
    p.add_argument("--kl-arm", default="adadsf", help="the arm's KL-aligned twin")
    p.add_argument("--budget", type=float, default=0.81)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    pin, control = list(RunCache(a.pin)), list(RunCache(a.control))
    arm = _runs(pin, a.arm, a.budget, a.pin)
    kl = _runs(pin, a.kl_arm, a.budget, a.pin)
    ctl = _runs(control, a.control_method, 1.0, a.control)
    [d_pin] = _runs(pin, "dense", 1.0, a.pin).values()
    [d_ctl] = _runs(control, "dense", 1.0, a.control).values()
    _check_alike(d_pin, d_ctl, arm, ctl)
    dense = d_pin["record"]

    def rec(runs: dict, key: str) -> dict[int, float]:
        return {s: e["record"].get(key) for s, e in runs.items()}

    out: dict[str, Any] = {"per_seed": {}, "comparisons": []}
    for seed in sorted(ctl):
        out["per_seed"][seed] = {
            name: {k: runs[seed]["record"].get(k) for k in ("ppl_test", "task_mean")}
            for name, runs in ((a.arm, arm), (a.kl_arm, kl), (a.control_method, ctl))
            if seed in runs
        }
    for metric, lower in (("ppl_test", True), ("task_mean", False)):
        diff = paired_difference(rec(arm, metric), rec(ctl, metric))
        out["comparisons"].append(
            {"a": a.arm, "b": a.control_method, "metric": metric,
             **(diff.as_dict() if diff else {}),
             "verdict": verdict(a.arm, a.control_method, a.budget, metric, diff, lower)}
        )  # fmt: skip
    # the test PPL relative to each arm's own reference model
    own = {s: arm[s]["record"]["ppl_test"] / ctl[s]["record"]["ppl_test"]
           for s in arm if s in ctl}  # fmt: skip
    vs_dense = {s: e["record"]["ppl_test"] / dense["ppl_test"] for s, e in kl.items()}
    diff = paired_difference(own, vs_dense)
    text = (
        f"{a.arm} / its control vs {a.kl_arm} / dense at {a.budget:g}: test PPL ratio"
    )
    if diff is None or diff.ci95 is None:
        text += ": fewer than 2 paired seeds, no verdict"
    else:
        text += f" {diff.mean_diff:+.3f} ± {diff.ci95:.3f} ({diff.n_seeds} seeds)"
        if not diff.significant:
            text += ", not significant"
        else:
            better = a.arm if diff.mean_diff < 0 else a.kl_arm
            text += f", significant: {better} is closer to its reference"
    out["comparisons"].append(
        {"a": f"{a.arm} / {a.control_method}", "b": f"{a.kl_arm} / dense",
         "metric": "ppl_test ratio", **(diff.as_dict() if diff else {}),
         "verdict": text}
    )  # fmt: skip
    out["ratios"] = {"arm_over_control": own, "kl_arm_over_dense": vs_dense}
    print(json.dumps(out, indent=1))
    for c in out["comparisons"]:
        print(c["verdict"])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
