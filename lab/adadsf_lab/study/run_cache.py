"""Finished study runs on disk: one JSON file per run, named by its configuration key.

Each file holds the run's full configuration next to its record, so a cache folder is
self-describing and can be copied between machines or sessions. Writes are atomic
(temporary file in the same folder, ``fsync``, ``os.replace``): an interrupted study
leaves either the finished run or nothing, never half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loguru import logger

from adadsf_lab.study.spec import RunSpec
from adadsf_modifier.atomic import atomic_write_text
from adadsf_modifier.utils import json_text

__all__ = ["OLDER_ALGORITHM", "RunCache"]

#: The key a leniently matched record (``RunCache.get(..., lenient=True)``) carries when
#: older algorithm versions computed it: ``{area: the version that computed it}`` for
#: each area whose version has moved since.
OLDER_ALGORITHM = "computed_by_older_algorithm"


def _agree(a: Any, b: Any) -> bool:
    """Equal, except that keys present in only one of two dicts are ignored."""
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_agree(a[k], b[k]) for k in a.keys() & b.keys())
    return a == b


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the algorithm versions that computed it."""
    versions = {k: v for k, v in config.get("versions", {}).items() if k != "algorithm"}
    return {**config, "versions": versions}


def _read(path: Path, computed: bool = False) -> dict[str, Any] | None:
    """A cache file's run, or None (with a warning naming the file) when it is not
    one: unreadable, not JSON, not an object with a ``config`` and a ``record``; with
    ``computed``, also without the model, device and versions a computed run keeps
    (what :meth:`RunCache.computed_context` reads)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        logger.warning(f"study cache: ignoring unreadable {path}: {err}")
        return None
    config = data.get("config") if isinstance(data, dict) else None
    ok = isinstance(config, dict) and isinstance(data.get("record"), dict)
    if ok and computed:
        ok = (
            isinstance(config.get("model"), dict)
            and isinstance(config.get("versions"), dict)
            and isinstance(config.get("device"), str)
        )
    if not ok:
        logger.warning(
            f"study cache: ignoring {path}: not a cached run (a JSON object with "
            "`config` {model, device, versions} and `record`)"
        )
        return None
    return data


class RunCache:
    """``root/<phase>/<method>/<key>.json`` for every finished run."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def path_for(self, spec: RunSpec) -> Path:
        return self.root / spec.phase / spec.method / f"{spec.key}.json"

    def get(self, spec: RunSpec, lenient: bool = False) -> dict[str, Any] | None:
        """The cached record of ``spec``, or None (a missing, unreadable or mismatching
        file is treated as not run; a mismatch cannot happen short of a SHA-256
        collision or a hand-edited file, and is logged).

        ``lenient`` (rendering only): without an exact match, the one cached run of the
        same phase, method, budget and seed whose configuration agrees with ``spec`` on
        every setting both have, whatever algorithm versions computed it. Settings added
        to the code since (a new modifier field with its default) then do not orphan
        runs computed before, and a version bump leaves the finished study renderable
        (as computed) until its runs are recomputed; any setting they share must still
        be equal. A record computed by older algorithm versions comes back with
        :data:`OLDER_ALGORITHM` set, so the rendered results can say which numbers the
        current code would no longer give."""
        path = self.path_for(spec)
        if not path.is_file():
            return self._lenient(spec) if lenient else None
        data = _read(path)
        if data is None:
            return None
        if data.get("config") != spec.config:
            logger.warning(f"study cache: {path} holds another configuration; ignored")
            return None
        return data["record"]

    def _lenient(self, spec: RunSpec) -> dict[str, Any] | None:
        folder = self.path_for(spec).parent
        found = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            data = _read(path)
            if (
                data is not None
                and data.get("label") == spec.label
                and _agree(_settings(data["config"]), _settings(spec.config))
            ):
                found.append(data)
        if len(found) != 1:
            return None  # none, or ambiguous: not rendered
        logger.info(f"study cache: {spec.label} matched on the settings it shares")
        record = dict(found[0]["record"])
        then = found[0]["config"].get("versions", {}).get("algorithm", {})
        now = spec.config.get("versions", {}).get("algorithm", {})
        older = {area: v for area, v in then.items() if now.get(area) != v}
        if older:  # computed by code whose numbers have changed since: say so
            record[OLDER_ALGORITHM] = older
        return record

    def put(self, spec: RunSpec, record: dict[str, Any]) -> Path:
        """Store a finished run atomically; returns its file."""
        path = self.path_for(spec)
        payload = {
            "key": spec.key,
            "label": spec.label,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": spec.config,
            "notes": spec.notes,
            "record": record,
        }
        atomic_write_text(path, json_text(payload))
        return path

    def computed_context(
        self, name: str, fingerprint: str
    ) -> tuple[str, str, dict[str, str], dict[str, Any] | None] | None:
        """``(fingerprint, device, versions, hardware)`` of the newest cached run of the
        model (its ``fingerprint``, or another conversion called ``name``): what
        ``--render-only`` needs to find runs computed on another machine (their keys
        include fingerprint, device and versions). Runs of this machine's
        ``fingerprint`` come first; only without any, the newest run of another
        conversion of the same model (another CPU converts the embedded GGUF to other
        bytes: ``lab/NOTEBOOK.md`` §14), since rendering computes nothing. None if
        the cache holds no run of the model. ``hardware`` is the computing machine's
        description when the run kept it."""

        def same(entry: dict[str, Any]) -> bool:  # this machine's conversion
            return entry.get("config", {}).get("model", {}).get("fingerprint") == (
                fingerprint
            )

        ours = [
            e
            for e in self
            if same(e) or e.get("config", {}).get("model", {}).get("name") == name
        ]
        if not ours:
            return None
        entry = max(ours, key=lambda e: (same(e), e.get("finished", "")))
        cfg = entry["config"]
        # the libraries' versions; each run's algorithm versions are its method's own
        versions = {k: v for k, v in cfg["versions"].items() if k != "algorithm"}
        return (
            cfg["model"]["fingerprint"],
            cfg["device"],
            versions,
            entry["record"].get("hardware"),
        )

    def other_weights(self, name: str, fingerprint: str) -> list[dict[str, Any]]:
        """Cached runs of the model called ``name`` whose weights are not
        ``fingerprint``'s: runs this study will not reuse (their keys hold the other
        fingerprint). :func:`weights_mismatch_warning` says so before any run."""
        return [
            entry
            for entry in self
            if entry.get("config", {}).get("model", {}).get("name") == name
            and entry["config"]["model"].get("fingerprint") != fingerprint
        ]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every readable cached run (``{"key", "config", "record", ...}``)."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*.json")):
            if (data := _read(path, computed=True)) is not None:
                yield data


def weights_mismatch_warning(
    others: list[dict[str, Any]], fingerprint: str, files: dict[str, str]
) -> str | None:
    """A warning, before any run, when the cache holds runs of this model computed
    from other weights (:meth:`RunCache.other_weights`): they will all be recomputed.
    Names the files whose digests differ where those runs kept them
    (``model_files``)."""
    if not others:
        return None
    prints = sorted({e["config"]["model"].get("fingerprint", "?")[:12] for e in others})
    machines = sorted(
        {
            e["record"].get("hardware", {}).get("summary", "an unrecorded machine")
            for e in others
        }
    )
    differ: set[str] = set()
    kept = [
        e["record"]["model_files"] for e in others if e["record"].get("model_files")
    ]
    for theirs in kept:
        differ |= {n for n in set(theirs) & set(files) if theirs[n] != files[n]}
    which = (
        f"files that differ: {', '.join(sorted(differ))}"
        if kept
        else "those runs kept no per-file digests, so which files differ is unknown"
    )
    return (
        f"{len(others)} cached runs of this model were computed from other weights "
        f"(fingerprint {', '.join(prints)}, on {'; '.join(machines)}) and will not be "
        f"reused: this copy's fingerprint is {fingerprint[:12]} ({which}). The "
        "embedded model's GGUF conversion gave other bytes on another CPU "
        "(lab/NOTEBOOK.md §14)."
    )
