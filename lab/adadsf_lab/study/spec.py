"""Identity of one study run: its full configuration and a stable key.

A run is identified by everything that can change its numbers (model identity, method,
budget, seed, every ``AdaDSFModifier`` field, data sizes, evaluation limits, library
versions and the plug-in's explicit ``ALGORITHM_VERSIONS`` of the areas the run
exercises), hashed into a stable key. The cache (:mod:`.run_cache`) stores finished
runs under that key, so an interrupted study resumes and a changed setting recomputes
exactly the runs it affects.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adadsf_modifier.algorithm_versions import ALGORITHM_VERSIONS

__all__ = [
    "FORMAT_VERSION",
    "RunSpec",
    "algorithm_versions",
    "canonical_json",
    "code_versions",
    "model_file_digests",
    "model_fingerprint",
]

FORMAT_VERSION = 1
"""Bump when the meaning of a cached run record changes (forces recomputation)."""


# --------------------------------------------------------------------------------------
# identity of a run


def canonical_json(data: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces, floats as Python repr)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def _file_digest(path: Path, h: "hashlib._Hash", chunk: int = 4 << 20) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(chunk))
        if size > 2 * chunk:
            f.seek(size - chunk)
            h.update(f.read(chunk))
        elif size > chunk:
            h.update(f.read())


_FINGERPRINTED = ("config.json", "tokenizer.json", "tokenizer_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _fingerprinted_files(folder: Path) -> list[Path]:
    """The files :func:`model_fingerprint` reads: config, tokenizer, weights."""
    named = [folder / n for n in _FINGERPRINTED if (folder / n).is_file()]
    weights = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    return named + weights


def model_fingerprint(path: str) -> str:
    """Identity of a local model folder: ``config.json`` plus each weight file's name,
    size, first and last 4 MiB (fast, and changes when the weights do). A hub id is
    identified by its name only."""
    folder = Path(path)
    if not folder.is_dir():
        return "name:" + str(path)
    h = hashlib.sha256()
    for p in _fingerprinted_files(folder):
        if p.suffix in _WEIGHT_SUFFIXES:
            _file_digest(p, h)
        else:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def model_file_digests(path: str) -> dict[str, str]:
    """SHA-256 of each file :func:`model_fingerprint` reads (name -> hex; empty for a
    hub id), whole files.

    Not part of any key (the fingerprint is): kept with each computed run so that,
    when a cache's runs stop matching on another machine, the files that differ can be
    named (the embedded model's conversion gave other bytes on another CPU,
    ``lab/NOTEBOOK.md`` §14)."""
    folder = Path(path)
    if not folder.is_dir():
        return {}
    out = {}
    for p in _fingerprinted_files(folder):
        h = hashlib.sha256()
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        out[p.name] = h.hexdigest()
    return out


def code_versions() -> dict[str, str]:
    """Versions of the libraries that compute a run and of the study's record format.

    The plug-in's own code enters each run's key through :func:`algorithm_versions`
    instead (explicit versions of the areas the run exercises), so that editing the
    lab, the command line or another method's code orphans no cached run."""
    out = {"python": ".".join(platform.python_version_tuple()[:2])}
    for dist in (
        "adadsf-modifier",
        "torch",
        "transformers",
        "llmcompressor",
        "compressed-tensors",
        "lm_eval",
        "datasets",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    out["study_format"] = str(FORMAT_VERSION)
    return out


def algorithm_versions(areas: Iterable[str]) -> dict[str, int]:
    """``ALGORITHM_VERSIONS`` of the plug-in areas a run exercises (part of its key)."""
    return {area: ALGORITHM_VERSIONS[area] for area in sorted(areas)}


@dataclass(frozen=True)
class RunSpec:
    """One run: ``config`` holds everything that determines its result (and nothing
    else), so ``key`` is stable across processes, machines and sessions."""

    phase: str  # "tune" or "main"
    method: str
    budget: float
    seed: int
    config_json: str  # canonical JSON of the configuration (the key's input)
    notes_json: str = "{}"  # facts about the run that do not change it (not keyed)

    @classmethod
    def create(
        cls,
        phase: str,
        method: str,
        budget: float,
        seed: int,
        config: dict,
        notes: dict | None = None,
    ) -> "RunSpec":
        full = {
            "phase": phase,
            "method": method,
            "budget": budget,
            "seed": seed,
            **config,
        }
        return cls(
            phase,
            method,
            budget,
            seed,
            canonical_json(full),
            canonical_json(notes or {}),
        )

    @property
    def notes(self) -> dict[str, Any]:
        return json.loads(self.notes_json)

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.config_json.encode()).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.phase}:{self.method}@{self.budget:g}/seed{self.seed}"
