"""The ``adadsf_config.json`` sidecar: which decoder layers are routed and how
(:class:`AdaDSFSidecar`, one :class:`LayerEntry` per layer), and the reader of both
kinds' sidecars (FTP's schema builds on :class:`SidecarSchema`).

A sidecar, not fields in ``config.json``: llm-compressor's ``resave_config`` rewrites
that file from the original model's. Readers refuse a ``format_version`` they do not
know and ignore unknown keys; fields that change the model if ignored (skip paths, kept
K/V) need version 2; version 3 marked a retired option (``route_target``), refused by
name. A layer saved in the retired rank routing loads in causal routing, on the
thresholds every checkpoint holds. The whole file is validated before any weight is
read (a NaN threshold would otherwise keep no token but the first).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from loguru import logger
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from torch import nn

from adadsf_modifier.atomic import write_text_durably
from adadsf_modifier.constraints import InputError
from adadsf_modifier.routing import ROUTING_MODES, RoutedLayer, decoder_layers
from adadsf_modifier.routing.skip_path import SKIP_PATHS, skip_path_of

SIDECAR_NAME = "adadsf_config.json"
FORMAT_NAME = "adadsf"
FORMAT_VERSION = 1  # written for a model that needs nothing newer
SKIP_PATH_FORMAT_VERSION = 2  # written when a layer has a skip path or keeps K/V
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)  # 3: only to refuse a retired option by name
METADATA_ATTR = "adadsf_metadata"  # on the model: similarities, modifier settings


def _threshold_in(value: Any) -> Any:
    """Infinities are written as text (JSON has none). NaN is refused: every score
    compares False with it, so the layer would silently run only the first token."""
    if isinstance(value, str):
        if value in ("inf", "-inf"):
            return float(value)
        if value.strip().lower().lstrip("+-") != "nan":
            raise ValueError("must be a number, 'inf', '-inf' or null")
        value = math.nan
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("must not be NaN (use null for no threshold)")
    return value


def _threshold_out(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


Threshold = Annotated[
    float | None,
    BeforeValidator(_threshold_in),
    PlainSerializer(_threshold_out, when_used="json"),
]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0)]
RoutingMode = Literal[ROUTING_MODES]  # type: ignore[valid-type]
SkipPathKind = Literal[SKIP_PATHS]  # type: ignore[valid-type]


class AdaDSFCheckpointError(InputError):
    """A checkpoint (or a model about to be saved) is not a valid AdaDSF checkpoint."""


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("adadsf-modifier")
    except Exception:  # not installed as a distribution (a source checkout)
        return "unknown"


class SidecarSchema(BaseModel):
    # strict: no "0.5" -> 0.5 or true -> 1 coercion; ignore: additive keys of a later
    # writer keep the format version readable.
    model_config = ConfigDict(strict=True, extra="ignore")


SchemaT = TypeVar("SchemaT", bound=SidecarSchema)


class LayerEntry(SidecarSchema):
    index: Annotated[int, Field(ge=0)]
    name: Annotated[str, Field(min_length=1)]
    routed: bool
    retention_ratio: Ratio
    similarity: FiniteFloat | None = None
    router_hidden_size: PositiveInt | None
    router_eps: PositiveFloat | None = None
    causal_threshold: Threshold = None
    routing_mode: RoutingMode | None = None
    skip_path: SkipPathKind = "identity"
    skip_path_rank: PositiveInt | None = None
    skipped_tokens_kv: bool = False
    route_target: str = "layer"

    @field_validator("routing_mode", mode="before")
    @classmethod
    def _rank_is_retired(cls, mode: Any) -> Any:
        if mode != "rank":
            return mode
        logger.warning(
            "this checkpoint was saved in rank routing, which adadsf_modifier no "
            "longer runs: it routes by the causal thresholds it also holds, whose kept "
            "share holds on calibration-like text (`adadsf calibrate` refits them on "
            "yours)"
        )
        return "causal"

    @model_validator(mode="after")
    def _routed_needs_a_router(self) -> LayerEntry:
        if self.route_target != "layer":
            raise ValueError(
                f"route_target {self.route_target!r} (routing one sub-block) is no "
                "longer supported: this adadsf_modifier routes whole layers; compress "
                "the model again"
            )
        if self.routed and self.router_hidden_size is None:
            raise ValueError("a routed layer needs router_hidden_size")
        if not self.routed and self.needs_v2:
            raise ValueError("only a routed layer has a skip path or keeps keys/values")
        if self.skip_path == "identity" and self.skip_path_rank is not None:
            raise ValueError("skip_path_rank needs skip_path 'ridge'")
        return self

    @property
    def needs_v2(self) -> bool:
        return self.skip_path != "identity" or self.skipped_tokens_kv


class ModifierRecord(SidecarSchema):
    class_name: str = Field(alias="class")
    settings: dict[str, Any] = Field(default_factory=dict)


class AdaDSFSidecar(SidecarSchema):
    format: Literal[FORMAT_NAME]  # type: ignore[valid-type]
    format_version: Literal[SUPPORTED_FORMAT_VERSIONS]  # type: ignore[valid-type]
    adadsf_modifier_version: str = "unknown"
    model_type: Annotated[str, Field(min_length=1)]
    num_hidden_layers: PositiveInt
    hidden_size: PositiveInt
    layers_path: str | None = None
    router_dtype: str | None = None
    layers: list[LayerEntry]
    modifier: ModifierRecord | None = None

    @model_validator(mode="after")
    def _layers_match(self) -> AdaDSFSidecar:
        if len(self.layers) != self.num_hidden_layers:
            raise ValueError(
                f"`layers` must list all {self.num_hidden_layers} decoder layers, "
                f"found {len(self.layers)}"
            )
        for i, entry in enumerate(self.layers):
            if entry.index != i:
                raise ValueError(f"layers[{i}] has index {entry.index}, expected {i}")
        if not any(entry.routed for entry in self.layers):
            raise ValueError("it lists no routed layer")
        if self.format_version < SKIP_PATH_FORMAT_VERSION and any(
            e.needs_v2 for e in self.layers
        ):
            raise ValueError(
                "skip_path / skipped_tokens_kv need format_version 2 (an older reader "
                "would ignore them and load a different model)"
            )
        return self

    @property
    def routed_layers(self) -> list[LayerEntry]:
        return [entry for entry in self.layers if entry.routed]

    def to_json_dict(self) -> dict[str, Any]:
        """The file's content as JSON data (infinities as ``"inf"`` / ``"-inf"``)."""
        return self.model_dump(mode="json", by_alias=True)


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def describe_validation_error(error: ValidationError) -> str:
    """One line naming every offending field, its problem and (scalars) its value."""
    parts = []
    for e in error.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:
            parts.append(msg)
            continue
        scalar = not isinstance(e["input"], (dict, list))
        got = f" (got {repr(e['input'])[:60]})" if scalar else ""
        parts.append(f"field `{_field(e['loc'])}`: {msg}{got}")
    return "; ".join(parts)


def _float_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _layer_entry(index: int, name: str, layer: nn.Module, similarity: Any) -> dict:
    entry: dict[str, Any] = {
        "index": index,
        "name": name,
        "routed": False,
        "retention_ratio": 1.0,
        "similarity": _float_or_none(similarity),
        "router_hidden_size": None,
    }
    if isinstance(layer, RoutedLayer):
        threshold = getattr(layer, "causal_threshold", None)
        entry.update(
            routed=True,
            retention_ratio=float(layer.retention_ratio),
            router_hidden_size=int(layer.router.router_hidden_size),
            router_eps=float(layer.router.eps),
            causal_threshold=None if threshold is None else float(threshold),
            routing_mode=getattr(layer, "routing_mode", None),
            skipped_tokens_kv=bool(getattr(layer, "skipped_tokens_kv", False)),
        )
        skip = skip_path_of(layer)
        if skip is not None:
            entry.update(skip_path="ridge", skip_path_rank=skip.rank)
    return entry


def sidecar_for_model(model: nn.Module) -> AdaDSFSidecar:
    """The sidecar for ``model``, validated (:func:`validated_for_save`)."""
    spec, layers = decoder_layers(model)
    routed = [layer for _, layer in layers if isinstance(layer, RoutedLayer)]
    if not routed:
        raise AdaDSFCheckpointError(
            f"{type(model).__name__} has no routed decoder layers: nothing "
            "AdaDSF-specific to save"
        )
    meta = getattr(model, METADATA_ATTR, None) or {}
    sims = meta.get("similarities") or []
    if len(sims) != len(layers):
        sims = [None] * len(layers)
    entries = [
        _layer_entry(i, name, layer, sims[i]) for i, (name, layer) in enumerate(layers)
    ]
    version = FORMAT_VERSION
    if any(
        e.get("skip_path") == "ridge" or e.get("skipped_tokens_kv") for e in entries
    ):
        version = SKIP_PATH_FORMAT_VERSION
    data = {
        "format": FORMAT_NAME,
        "format_version": version,
        "adadsf_modifier_version": package_version(),
        "model_type": spec.model_type,
        "num_hidden_layers": len(layers),
        "hidden_size": int(model.config.hidden_size),
        "layers_path": spec.layers_path,
        "router_dtype": str(next(routed[0].router.parameters()).dtype).removeprefix(
            "torch."
        ),
        "layers": entries,
        "modifier": meta.get("modifier"),
    }
    return validated_for_save(AdaDSFSidecar, data, model, "AdaDSF")


def validated_for_save(
    schema: type[SchemaT], data: dict, model: nn.Module, label: str
) -> SchemaT:
    """``data`` validated like a file being read: a model that no reload would accept
    (a NaN threshold) is refused before anything is written."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise AdaDSFCheckpointError(
            f"cannot save {type(model).__name__} as an {label} checkpoint: "
            f"{describe_validation_error(e)}"
        ) from None


def write_sidecar(folder: Path, sidecar: AdaDSFSidecar) -> None:
    """Write ``folder/adadsf_config.json`` (fsynced: it marks a complete checkpoint)."""
    text = json.dumps(sidecar.to_json_dict(), indent=2, allow_nan=False) + "\n"
    write_text_durably(folder / SIDECAR_NAME, text)


# A checkpoint's JSON files nest 2 to 5 levels; deeper ones would exhaust the recursion
# limit of pydantic or a later json.dumps.
MAX_NESTING = 32


def _nesting(data: Any) -> int:
    """How deep ``data`` nests, without recursion; stops past :data:`MAX_NESTING`."""
    deepest, stack = 0, [(data, 1)]
    while stack and deepest <= MAX_NESTING:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
    return deepest


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """``file``'s content, one JSON object (``what`` it should be, for messages)."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AdaDSFCheckpointError(f"{file} cannot be read as text: {e}") from None
    if not text.strip():
        raise AdaDSFCheckpointError(f"{file} is empty: it should be {what}")
    try:
        data = json.loads(text)
        too_deep = _nesting(data) > MAX_NESTING
    except RecursionError:  # deeper than the JSON reader itself can follow
        too_deep = True
    except ValueError as e:
        raise AdaDSFCheckpointError(f"{file} is not valid JSON: {e}") from None
    if too_deep:
        raise AdaDSFCheckpointError(
            f"{file} is nested more than {MAX_NESTING} levels deep: it is not {what}"
        )
    if not isinstance(data, dict):
        raise AdaDSFCheckpointError(f"{file} is not a JSON object: it should be {what}")
    return data


def read_sidecar_file(
    file: Path,
    schema: type[SchemaT],
    label: str,
    check_format: Callable[[Path, dict[str, Any]], None],
) -> SchemaT:
    """The reader of both kinds' sidecars: a JSON object, then ``check_format`` (first,
    so that a newer file says "upgrade" instead of listing the fields it changed), then
    ``schema``; each failure one error naming the file."""
    data = read_json_object(file, f"an {label} sidecar")
    check_format(file, data)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise AdaDSFCheckpointError(
            f"{file}: invalid {label} sidecar: {describe_validation_error(e)}"
        ) from None


def _check_adadsf_format(file: Path, data: dict[str, Any]) -> None:
    if data.get("format") != FORMAT_NAME:
        raise AdaDSFCheckpointError(
            f"{file} is not an AdaDSF sidecar (missing format: 'adadsf')"
        )
    version = data.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
        raise AdaDSFCheckpointError(
            f"unknown AdaDSF format_version {version!r} in {file}; this "
            f"adadsf_modifier ({package_version()}) reads format_version "
            f"{list(SUPPORTED_FORMAT_VERSIONS)}: upgrade adadsf_modifier"
        )


def read_sidecar(path: str | os.PathLike[str]) -> AdaDSFSidecar:
    """Read and validate ``PATH/adadsf_config.json``, without touching any weight."""
    path = Path(path)
    if not path.is_dir():
        raise AdaDSFCheckpointError(
            f"no AdaDSF data in {path}: it is not a local checkpoint folder"
        )
    file = path / SIDECAR_NAME
    if not file.is_file():
        raise AdaDSFCheckpointError(
            f"no AdaDSF data in {path} ({SIDECAR_NAME} not found): save the routed "
            "model with oneshot(..., output_dir=...) or model.save_pretrained(...) "
            "after AdaDSFModifier ran"
        )
    return read_sidecar_file(file, AdaDSFSidecar, "AdaDSF", _check_adadsf_format)
