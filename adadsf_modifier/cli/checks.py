"""The CLI's argument types, input checks and output helpers: whatever can be wrong
fails here, in one line, before any heavy work."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from loguru import logger

from adadsf_modifier.atomic import atomic_write_text
from adadsf_modifier.destinations import check_destination
from adadsf_modifier.utils import json_text

EVAL_EXTRA = "pip install 'adadsf-modifier[eval]'"


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class UsageError(CLIError):
    """An argument that does not parse; the message already names the command."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ------------------------------------------------------------------ argument types
def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            want = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    return parse


non_negative_int = _int_at_least(0)
positive_int = _int_at_least(1)
token_count = _int_at_least(2)  # perplexity scores n - 1 tokens: at least one


def model_name(text: str) -> str:
    """A model folder, ``embedded``/``smollm2``, or a hub id in the local Hugging Face
    cache; anything path-like must exist."""
    if os.path.exists(os.path.expanduser(text)):
        return text
    path_like = text.startswith((".", "~")) or "/" in text or os.sep in text
    if path_like and not _in_hub_cache(text):
        raise argparse.ArgumentTypeError(f"model path does not exist: {text}")
    return text


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


# ------------------------------------------------------------------ input checks
def default_recipe() -> str:
    candidate = Path(__file__).resolve().parents[2] / "recipes" / "adadsf_w8a8.yaml"
    if not candidate.is_file():
        raise CLIError("no default recipe found next to the package; pass --recipe")
    return str(candidate)


def check_recipe(path: str) -> str:
    from llmcompressor.recipe import Recipe

    import adadsf_modifier  # noqa: F401  (registers AdaDSFModifier for the recipe parser)

    if not os.path.isfile(path):
        raise CLIError(f"recipe file not found: {path}")
    try:
        recipe = Recipe.create_instance(path)
    except Exception as e:  # yaml errors, unknown modifiers, pydantic validation errors
        lines = [line.strip() for line in str(e).splitlines()[:4] if line.strip()]
        raise CLIError(f"recipe {path} does not parse: {' '.join(lines)}") from e
    if not recipe.modifiers:
        raise CLIError(
            f"recipe {path} defines no modifiers (groups must end in _stage / "
            "_modifiers)"
        )
    return path


def check_tasks(tasks: str | None) -> list[str]:
    if not tasks or not tasks.strip():
        return []
    from adadsf_modifier.evaluation.lm_eval_tasks import check_tasks

    try:
        names = check_tasks(tasks)
    except ValueError as e:
        raise CLIError(str(e)) from e
    require("lm_eval", "--tasks")
    return names


def require(module: str, what: str, install: str = EVAL_EXTRA) -> None:
    if importlib.util.find_spec(module) is None:
        raise CLIError(f"{what} needs {module}, which is not installed: {install}")


# A model folder needs one of them for its tokenizer (every command reads text).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_model(name: str | None) -> str:
    """The model the command loads; a local folder must hold a config and a tokenizer
    (else transformers fails with a traceback, after minutes)."""
    from adadsf_modifier.evaluation import resolve_model

    try:
        path = resolve_model(name)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e
    if os.path.isfile(path):
        raise CLIError(f"model path {path} is a file, not a model folder")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CLIError(
                f"model folder {path} has no config.json: not a Hugging Face model "
                "folder (save one with model.save_pretrained)"
            )
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise CLIError(
                f"model folder {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                "save it beside the model: tokenizer.save_pretrained(path)"
            )
    return path


def check_parent(out: Path) -> None:
    """The nearest existing path above ``out`` must be a folder."""
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise CLIError(f"cannot create {out}: {parent} is not a directory")
            return


def check_output_dir(path: str, overwrite: bool, keep: Sequence[str] = ()) -> Path:
    """``keep``: the only names that count as an earlier output in a folder that may
    hold other files (all names when empty)."""
    out = Path(path)
    check_parent(out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"output path exists and is not a directory: {out}")
    check_destination(out, "folder", "--output-dir")
    if overwrite or not out.is_dir():
        return out
    taken = [out / n for n in keep if (out / n).exists()]
    if taken:
        raise CLIError(f"{taken[0]} exists (use --overwrite)")
    if not keep and any(out.iterdir()):
        raise CLIError(
            f"output directory {out} exists and is not empty (use --overwrite)"
        )
    return out


def check_output_file(path: str | None, overwrite: bool) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    check_parent(out)
    if out.is_dir():
        raise CLIError(f"output path is a directory, not a file: {out}")
    if out.exists() and not overwrite:
        raise CLIError(f"output file {out} exists (use --overwrite)")
    check_destination(out, "file", "--output")
    return out


def check_routed(path: str, required: bool = True) -> None:
    """``path`` is a routed checkpoint (AdaDSF's or FTP's) or, unless ``required``, a
    plain model folder."""
    from adadsf_modifier.checkpoint import (
        FTP_SIDECAR_NAME,
        SIDECAR_NAME,
        AdaDSFCheckpointError,
        checkpoint_sidecar,
    )

    try:
        kind = checkpoint_sidecar(path)
    except AdaDSFCheckpointError as e:  # both sidecars
        raise CLIError(str(e)) from e
    if kind is None and required:
        raise CLIError(
            f"{path} is not an AdaDSF checkpoint (no {SIDECAR_NAME}) nor an FTP one "
            f"(no {FTP_SIDECAR_NAME}); --routed takes the output of `adadsf compress` "
            "or of oneshot with FTPModifier"
        )


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        print(json.dumps(data, indent=2))
        return
    atomic_write_text(path, json_text(data, indent=2, sort_keys=False))
    logger.info(f"wrote {path}")
