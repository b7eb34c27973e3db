"""How each study method's modifier is configured: every field of ``AdaDSFModifier``
(or ``FTPModifier``) for one arm, and the GPTQ stage of the W8A8 arm. The full field
dump goes into the run's key, so a changed default recomputes exactly the runs it
affects."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.settings import StudySettings

__all__ = [
    "Tuned",
    "finetune_fields",
    "modifier_fields",
    "quantization_fields",
    "without_retired",
]

# The GPTQ stage of recipes/adadsf_w8a8.yaml, used when the recipe file is not next to
# the package (an installed wheel); read from the file whenever it is there.
_W8A8_FALLBACK = {
    "targets": ["Linear"],
    "scheme": "W8A8",
    "ignore": ["lm_head", "re:.*router.*"],
    "dampening_frac": 0.01,
}
_W8A8_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "adadsf_w8a8.yaml"
#: Fields the plug-in retired (experiments no shipped recipe or published arm used),
#: at the one value every run of the study had: they stay in a run's configuration, so
#: the keys of runs computed before their retirement still match, and are dropped
#: before the modifier is built (:func:`without_retired`). ``threshold_passes`` never
#: entered a key.
_RETIRED = {
    "adadsf": {
        "importance": "similarity",
        "importance_tokens": 2048,
        "importance_fit_tokens": 16384,
        "route_target": "layer",
        "skip_path_tokens": "skipped",
        "align_lr_schedule": "constant",
        "align_warmup_steps": 0,
        "align_anneal_steps": 0,
        "align_routers_first_steps": 0,
        "align_grad_clip": 1.0,
        "align_weight_decay": 0.0,
        "routing_mode": "causal",
    },
    "ftp": {"route_target": "layer", "skip_path_tokens": "skipped"},
    "finetune": {"lr_schedule": "constant", "warmup_steps": 0},
}


#: the alignment loss as the run keys spell it: three weights (``align_loss`` since)
_LOSS_KEYS = ("align_w_kl", "align_w_hidden", "align_w_lm")


def _keyed_loss(fields: dict[str, Any], seed: int) -> dict[str, Any]:
    """A modifier's fields as the run keys spell them: ``align_loss`` as its three
    weights, and the alignment's seed (the modifier's ``seed`` since) as
    ``align_seed``, so the runs computed before those fields changed are found."""
    from adadsf_modifier.alignment import LOSS_WEIGHTS

    out = dict(fields)
    w = LOSS_WEIGHTS[out.pop("align_loss")]
    return {**out, **dict(zip(_LOSS_KEYS, (w.kl, w.hidden, w.lm))), "align_seed": seed}


def without_retired(fields: dict[str, Any], kind: str) -> dict[str, Any]:
    """``fields`` (a run's ``modifier`` or ``finetune`` configuration) as the
    plug-in takes them: without the retired fields of ``kind`` (``adadsf``, ``ftp``,
    ``finetune``), and for AdaDSF with the loss named (:func:`_keyed_loss` undone)."""
    from adadsf_modifier.alignment import LOSS_WEIGHTS

    out = {k: v for k, v in fields.items() if k not in _RETIRED[kind]}
    if kind == "adadsf":
        given = tuple(out.pop(k) for k in _LOSS_KEYS)
        (out["align_loss"],) = (
            name for name, w in LOSS_WEIGHTS.items() if (w.kl, w.hidden, w.lm) == given
        )
        del out["align_seed"]  # always the run's seed
    return out


_LIFECYCLE_FIELDS = {
    "index",
    "group",
    "start",
    "end",
    "update",
    "initialized_",
    "finalized_",
    "started_",
    "ended_",
    "requires_calibration_data",
}


@dataclass(frozen=True)
class Tuned:
    """Hyper-parameters the main runs use, and where they came from.

    ``align_lr``/``align_layer_lr`` are the rates of every aligned method except those
    in ``per_method`` (``{method: {"align_lr", "align_layer_lr"[, "source"]}}``: the
    methods of ``tune_methods`` after the first, each tuned for itself, or with a
    ``source`` saying where its fixed rates came from)."""

    align_lr: float
    temperature: float
    beta: float
    # "validation split", "settings (tuning off)" or "the only candidate (no tuning
    # run)"
    source: str
    align_layer_lr: float | None = None  # None: align_lr for the layers too
    per_method: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: StudySettings, source: str) -> Tuned:
        """The rates and AdaDSF fields as set, untuned."""
        return cls(s.align_lr, s.temperature, s.beta, source, s.align_layer_lr)

    def for_method(self, method: str) -> Tuned:
        """The hyper-parameters ``method`` trains with."""
        rates = self.per_method.get(method)
        return self if rates is None else replace(self, per_method={}, **rates)


def quantization_fields() -> dict[str, Any]:
    """``GPTQModifier`` arguments of the W8A8 stage of ``recipes/adadsf_w8a8.yaml``."""
    if _W8A8_RECIPE.is_file():
        recipe = yaml.safe_load(_W8A8_RECIPE.read_text())
        for stage in recipe.values():
            for group in stage.values():
                if isinstance(group, dict) and "GPTQModifier" in group:
                    return dict(group["GPTQModifier"])
    return dict(_W8A8_FALLBACK)


def modifier_fields(
    s: StudySettings,
    method: str,
    retention: float,
    seed: int,
    tuned: Tuned,
) -> dict[str, Any]:
    """Every ``AdaDSFModifier`` field of ``method`` at ``retention`` (defaults
    included, so a changed default changes the run's key); ``FTPModifier``'s for FTP."""
    from adadsf_modifier import AdaDSFModifier

    m = METHODS[method]
    if m.modifier == "ftp":
        return _ftp_fields(s, retention, seed, m.fields)
    tuned = tuned.for_method(method)
    kwargs: dict[str, Any] = dict(
        retention=retention,
        temperature=tuned.temperature,
        beta=tuned.beta,
        allocation=m.allocation,
        ignore=list(s.ignore),
        router_hidden_size=s.router_hidden_size,
        seed=seed,
        router_init="similarity",
        router_init_steps=s.router_init_steps,
        router_init_tokens=s.router_init_tokens,
        align_steps=s.align_steps if m.align else 0,
        align_lr=tuned.align_lr,
        align_batch_size=s.align_batch_size,
        align_seq_len=s.align_seq_len,
        align_trainable=s.align_trainable,
        align_layer_lr=tuned.align_layer_lr,
        align_routing=s.align_routing,
        align_bf16=s.align_bf16,
        align_loss="lm" if m.lm_loss_only else "kl_hidden",
    )
    kwargs.update(m.fields)
    dump = AdaDSFModifier(**kwargs).model_dump()
    fields = {k: v for k, v in dump.items() if k not in _LIFECYCLE_FIELDS}
    return {**_keyed_loss(fields, seed), **_RETIRED["adadsf"]}


def finetune_fields(
    s: StudySettings, method: str, seed: int, tuned: Tuned
) -> dict[str, Any]:
    """A dense control's fine-tune: the alignment settings of the arm it controls (its
    ``base``, at this seed and at the control's rates, which are the base's unless
    tuning gave it others), as the ``AlignmentConfig`` fields ``align_model`` takes,
    plus its ``seed`` and ``ignore``: the decoder layers that stay frozen, as they
    stay dense in the routed arms. Read from the base arm's modifier, so the two
    cannot drift apart."""
    m = METHODS[method]
    if not m.dense_control:
        raise ValueError(f"{method!r} is not a dense control")
    from adadsf_modifier.alignment import AlignmentConfig

    base = modifier_fields(s, m.base, s.tune_budget, seed, tuned.for_method(method))
    plain = without_retired(base, "adadsf")
    config = AlignmentConfig(**{k: plain[k] for k in AlignmentConfig.model_fields})
    # a dense model has no routed layer: the training routing rule does not apply
    # (nor does a key that depends on it)
    fields = config.model_dump(exclude={"align_routing"})
    return {**fields, **_RETIRED["finetune"], "seed": seed, "ignore": list(s.ignore)}


def _ftp_fields(
    s: StudySettings, retention: float, seed: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """FTP with the study's shared settings: layers ignored, seed, threshold passes,
    and as many router-training steps as AdaDSF's alignment has (FTP trains its router
    on the calibration rows; its genetic schedule scores candidates on the last
    calibration batch, held out from that training)."""
    from adadsf_modifier import FTPModifier

    kwargs: dict[str, Any] = dict(
        retention=retention,
        ignore=list(s.ignore),
        seed=seed,
        train_steps=s.align_steps,
        **extra,
    )
    dump = FTPModifier(**kwargs).model_dump()
    fields = {k: v for k, v in dump.items() if k not in _LIFECYCLE_FIELDS}
    return {**fields, **_RETIRED["ftp"]}
