"""The user's own text for ``adadsf compress`` / ``calibrate`` / ``eval``
(``--dataset``, ``--split``, ``--text-column``, oneshot's words), read before any model
loads: a ``.txt`` / ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file, a
``save_to_disk`` folder, or a name ``datasets.load_dataset`` resolves. A column of chat
conversations (``messages`` when there is no ``text``) is rendered through the model's
chat template. What cannot be read is refused in one line saying what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adadsf_modifier.cli.checks import CLIError

__all__ = ["DATA_FILE_KINDS", "load_texts", "read_text_file"]

#: file suffixes read through ``datasets``' builders of the same name
DATA_FILE_KINDS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


def load_texts(
    dataset: str,
    split: str = "train",
    text_column: str = "text",
    tokenizer_path: str | None = None,
) -> list[str]:
    """The documents of ``dataset`` (see the module docstring), non-empty ones only;
    ``tokenizer_path``: the model whose chat template renders a chat column."""
    path = Path(dataset)
    if path.suffix == ".txt":
        texts = [read_text_file(dataset, "--dataset")]
    else:
        rows = _rows(dataset, path, split)
        texts = _column(rows, dataset, text_column, tokenizer_path)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CLIError(f"--dataset {dataset}: holds no text")
    return texts


def _rows(dataset: str, path: Path, split: str) -> Any:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # reading a split is quick: errors stay one line
    try:
        if path.is_dir():
            rows = datasets.load_from_disk(str(path))
        elif path.suffix in DATA_FILE_KINDS:
            if not path.is_file():
                raise CLIError(f"--dataset {dataset}: no such file")
            kind = DATA_FILE_KINDS[path.suffix]
            rows = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            rows = datasets.load_dataset(dataset, split=split)
    except CLIError:
        raise
    except Exception as e:  # an offline hub, a missing builder, a malformed file
        raise CLIError(
            f"--dataset {dataset}: cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); offline, pass a local "
            "file (.txt, .jsonl, .json, .csv, .parquet) or a save_to_disk folder"
        ) from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if isinstance(rows, datasets.DatasetDict):
        if split not in rows:
            raise CLIError(
                f"--dataset {dataset}: no split {split!r} (it has {sorted(rows)}); "
                "pass --split"
            )
        rows = rows[split]
    return rows


def _column(
    rows: Any, dataset: str, text_column: str, tokenizer_path: str | None
) -> list[str]:
    columns = list(getattr(rows, "column_names", []) or [])
    if text_column == "text" and "text" not in columns and "messages" in columns:
        text_column = "messages"  # the usual name of a chat dataset's column
    if text_column not in columns:
        raise CLIError(
            f"--dataset {dataset}: no column {text_column!r} (it has {columns}); "
            "pass --text-column"
        )
    values = list(rows[text_column])
    if all(isinstance(v, str) for v in values):
        return values
    if all(_is_conversation(v) for v in values):
        return _render_chats(values, f"--dataset {dataset}", tokenizer_path)
    raise CLIError(
        f"--dataset {dataset}: column {text_column!r} is neither text nor chat "
        "messages (lists of {'role', 'content'})"
    )


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value
    )


def _render_chats(
    conversations: list[list[dict]], where: str, tokenizer_path: str | None
) -> list[str]:
    """Each conversation as the model's chat template writes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    if tok is None or not getattr(tok, "chat_template", None):
        raise CLIError(
            f"{where}: holds chat messages, but {tokenizer_path or 'the model'}'s "
            "tokenizer has no chat template to render them; pass --text-column with "
            "a column of text"
        )
    return [tok.apply_chat_template(c, tokenize=False) for c in conversations]


def read_text_file(path: str, option: str = "--text") -> str:
    """A text file's content, or a one-line refusal (naming ``option``) before any
    model loads."""
    file = Path(path)
    if not file.is_file():
        raise CLIError(f"{option} {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"{option} {path}: not UTF-8 text ({e.reason})") from e
    except OSError as e:
        raise CLIError(f"{option} {path}: cannot be read ({e.strerror})") from e
    if not text.strip():
        raise CLIError(f"{option} {path}: the file holds no text")
    return text
