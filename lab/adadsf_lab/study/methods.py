"""The study's methods: every arm it can compare, and how each one turns the dense
model into the compared model (allocation, alignment, extra modifier fields)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["METHODS", "Method", "by_method_and_budget"]


@dataclass(frozen=True)
class Method:
    """One arm of the study: how the dense model is turned into the compared model."""

    name: str
    label: str
    allocation: str | None  # None: the dense model (fine-tuned when ``align``)
    align: bool = True
    lm_loss_only: bool = False
    quantize: bool = False
    # the arm this one is derived from; it trains at that arm's learning rates unless
    # it is given its own. A quantized arm adds GPTQ to it (the same modifier fields);
    # a dense control (allocation None, align) fine-tunes the dense model with its
    # alignment. Either way the pair differs in one thing only.
    base: str | None = None
    match_flops: bool = False  # layer removal: keep as many layers as AdaDSF's FLOPs
    description: str = ""
    # further modifier fields of this arm (e.g. a fitted skip path)
    fields: dict[str, Any] = field(default_factory=dict)
    modifier: Literal["adadsf", "ftp"] = "adadsf"  # which modifier builds the arm

    @property
    def dense_control(self) -> bool:
        """The dense model fine-tuned as ``base`` aligns (no routing, no modifier)."""
        return self.allocation is None and self.align

    @property
    def algorithm_areas(self) -> tuple[str, ...]:
        """The plug-in areas (``ALGORITHM_VERSIONS`` keys) this arm's runs exercise:
        their versions enter the runs' keys, so bumping one recomputes exactly the
        runs that use that code."""
        areas = ["evaluation"]
        if self.allocation is not None:  # a routed or layer-removed model
            areas += ["routing", self.modifier]
        if self.align:
            areas.append("alignment")
        return tuple(sorted(areas))

    @property
    def short_label(self) -> str:
        """The name in prose: "AdaDSF", not "AdaDSF (similarity)"."""
        return self.label.split(" (")[0]


_RIDGE_KV: dict[str, Any] = {
    "skip_path": "ridge",
    "skip_path_rank": 64,
    "skipped_tokens_kv": True,
}
# the variant the recipes ship (recipes/adadsf.yaml, recipes/adadsf_w8a8.yaml)
_RIDGE_KV_ERR: dict[str, Any] = {**_RIDGE_KV, "router_init": "skip_error"}

_ARMS: tuple[Method, ...] = (
    Method("dense", "dense", None, align=False, description="the dense model"),
    Method(
        "adadsf",
        "AdaDSF (similarity)",
        "similarity",
        description="similarity allocation + feature alignment (the paper)",
    ),
    Method("uniform", "uniform (MoD)", "uniform", description="same ratio per layer"),
    Method(
        "reversed",
        "reversed",
        "reversed",
        description="similarity ranking inverted",
    ),
    Method(
        "random",
        "random",
        "random",
        description="similarity ratios, seeded random layer order",
    ),
    Method(
        "layer_drop",
        "layer removal (ShortGPT)",
        "layer_drop",
        align=False,
        match_flops=True,
        description="lowest Block-Influence layers removed, no training",
    ),
    Method(
        "layer_drop_healed",
        "layer removal + healing",
        "layer_drop",
        match_flops=True,
        description="layer removal, then the same alignment as AdaDSF",
    ),
    Method(
        "adadsf_no_align",
        "AdaDSF, no alignment",
        "similarity",
        align=False,
        description="similarity allocation, warm-started routers, no training",
    ),
    Method(
        "adadsf_lm_only",
        "AdaDSF, LM loss only",
        "similarity",
        lm_loss_only=True,
        description="alignment with the causal-LM loss instead of KL + hidden",
    ),
    Method(
        "adadsf_ridge_kv",
        "AdaDSF + ridge skip path + K/V",
        "similarity",
        fields=_RIDGE_KV,
        description="skipped tokens get a fitted rank-64 ridge map and still "
        "give keys/values; maps refitted after alignment",
    ),
    Method(
        "adadsf_ridge_kv_err",
        "AdaDSF + ridge + K/V, skip-error routers",
        "similarity",
        fields=_RIDGE_KV_ERR,
        description="the ridge/K-V variant with each router refit, before "
        "alignment, to the relative error of its layer's fitted map "
        "(router_init: skip_error)",
    ),
    Method(
        "adadsf_ridge_kv_err_lm_only",
        "AdaDSF + ridge + K/V, skip-error routers, LM loss only",
        "similarity",
        lm_loss_only=True,
        fields=_RIDGE_KV_ERR,
        description="the shipped variant aligned on the causal-LM loss instead of "
        "KL + hidden (on the paper's AdaDSF the LM loss won at 0.81: RESULTS.md)",
    ),
    Method(
        "adadsf_ridge_kv_no_align",
        "AdaDSF + ridge + K/V, no alignment",
        "similarity",
        align=False,
        fields=_RIDGE_KV,
        description="the ridge/K-V variant with no training at all",
    ),
    Method(
        "layer_drop_ridge",
        "layer removal + ridge maps",
        "layer_drop",
        align=False,
        match_flops=True,
        fields={"skip_path": "ridge"},
        description="layer removal, each removed layer replaced by its fitted "
        "full-rank ridge map, no training",
    ),
    Method(
        "layer_drop_ridge_healed",
        "layer removal + ridge maps + healing",
        "layer_drop",
        match_flops=True,
        fields={"skip_path": "ridge"},
        description="layer removal with ridge maps in place of the removed "
        "layers, then the same alignment as AdaDSF (maps refitted after it)",
    ),
    Method(
        "ftp",
        "FTP (shared 4-feature router)",
        "genetic",
        align=False,
        modifier="ftp",
        description="FTPModifier: genetic per-layer schedule, router-only training "
        "(as many steps as AdaDSF's alignment), causal thresholds",
    ),
    Method(
        "ftp_quantile",
        "FTP, trained on inference's rule",
        "genetic",
        align=False,
        modifier="ftp",
        fields={"train_routing": "quantile"},
        description="FTP with its router trained on each layer's ratio of the "
        "batch (train_routing: quantile) instead of the hard gate s > 0",
    ),
    Method(
        "ftp_ridge_kv",
        "FTP + ridge skip path + K/V",
        "genetic",
        align=False,
        modifier="ftp",
        fields=_RIDGE_KV,
        description="FTP with AdaDSF's rank-64 ridge skip path and skipped tokens' "
        "keys/values",
    ),
    Method(
        "ftp_ridge_kv_quantile",
        "FTP + ridge + K/V, trained on inference's rule",
        "genetic",
        align=False,
        modifier="ftp",
        fields={**_RIDGE_KV, "train_routing": "quantile"},
        description="FTP with the ridge skip path, skipped tokens' keys/values and "
        "its router trained on each layer's ratio of the batch",
    ),
)


def _w8a8(base: str, description: str) -> Method:
    """``base``'s arm followed by GPTQ W8A8 (the GPTQ stage of
    ``recipes/adadsf_w8a8.yaml``): everything else is ``base``'s, by construction."""
    arm = next(m for m in _ARMS if m.name == base)
    return replace(
        arm,
        name=f"{base}_w8a8",
        label=f"{arm.short_label} + GPTQ W8A8",
        quantize=True,
        base=base,
        description=description,
    )


def _dense_control(name: str, base: str) -> Method:
    """The dense model fine-tuned with ``base``'s alignment (loss, rows, steps, rates,
    seed), every decoder layer outside the study's ``ignore`` training: the control an
    LM-loss arm needs. That loss also adapts a model to the calibration text's corpus,
    which the test text shares, so the arm's perplexity under dense's can be the
    corpus, not depth sparsity (lab/NOTEBOOK.md section 16.1)."""
    arm = next(m for m in _ARMS if m.name == base)
    if not arm.lm_loss_only:  # the dense model is the teacher a KL loss would need
        raise ValueError(f"a dense control needs an LM-loss arm, not {base!r}")
    return Method(
        name,
        f"dense, fine-tuned as {arm.short_label}",
        None,
        lm_loss_only=True,
        base=base,
        description=f"the dense model fine-tuned with the alignment of {base} (its "
        "control: the same loss, rows, steps and rates, no routing)",
    )


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        *_ARMS,
        _dense_control("dense_lm", "adadsf_lm_only"),
        _dense_control("dense_lm_ridge_kv_err", "adadsf_ridge_kv_err_lm_only"),
        _w8a8(
            "adadsf",
            "the paper's AdaDSF, then GPTQ W8A8 (the GPTQ stage of "
            "recipes/adadsf_w8a8.yaml)",
        ),
        _w8a8(
            "adadsf_ridge_kv_err",
            "the variant the recipes ship, then GPTQ W8A8: recipes/adadsf_w8a8.yaml "
            "as a user runs it",
        ),
    )
}


def by_method_and_budget(
    runs: list[dict[str, Any]],
) -> list[tuple[tuple[str, float], list[dict[str, Any]]]]:
    """Run records grouped by ``(method, budget)``, in :data:`METHODS` order and from
    the highest budget down: the order every table of the study lists them in."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["method"], r["budget"])].append(r)
    order = list(METHODS)
    return sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), -kv[0][1]))
