"""Fast tests for the offline evaluation helpers (no GGUF conversion, no real model).

Perplexity is checked on a tiny random Llama against independent computations; the text
splits and calibration packing are checked with a small byte-level BPE tokenizer trained
here in milliseconds.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from adadsf_modifier.evaluation import (
    PerplexityResult,
    calibration_dataset,
    embedded_model_path,
    load_text_splits,
    perplexity,
    resolve_model,
    sliding_windows,
)
from adadsf_modifier.evaluation import asset_cache as cache_mod
from adadsf_modifier.evaluation import embedded_model as embedded_mod

VOCAB = 320  # requested BPE size; the model uses len(tokenizer)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with ~320 tokens, trained offline on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "To be, or not to be, that is the question.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def _random_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_recipe_nll(
    model, ids: torch.Tensor, max_length: int, stride: int
) -> tuple[float, int]:
    """The Hugging Face docs loop, using the model's own (mean) loss rescaled to a
    sum."""
    nll_sum, n_tokens, prev_end, n = 0.0, 0, 0, ids.numel()
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        trg_len = end - prev_end
        window = ids[begin:end].unsqueeze(0)
        labels = window.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids=window, labels=labels, use_cache=False).loss
        valid = int((labels[:, 1:] != -100).sum())  # the model shifts labels internally
        nll_sum += float(loss) * valid
        n_tokens += valid
        prev_end = end
        if end == n:
            break
    return nll_sum, n_tokens


# ----------------------------------------------------------------------------- sliding
# windows


@pytest.mark.parametrize(
    ("n", "max_length", "stride"),
    [(1000, 512, 256), (1000, 128, 128), (1000, 64, 1), (513, 512, 256),
     (512, 512, 256), (10, 512, 256), (97, 16, 5), (2, 2, 2), (300, 7, 3)],
)  # fmt: skip
def test_windows_score_every_token_but_the_first_exactly_once(n, max_length, stride):
    scored: list[int] = []
    for index, (begin, end, trg_len) in enumerate(
        sliding_windows(n, max_length, stride)
    ):
        assert 0 < end - begin <= max_length
        first = max(end - trg_len, begin + 1)  # a token needs one token of context
        # after the first window, every scored token sees max_length - stride context
        if index > 0:
            assert first - begin >= max(max_length - stride, 1)
        scored.extend(range(first, end))
    assert sorted(scored) == list(range(1, n))


@pytest.mark.parametrize(
    ("max_length", "stride"), [(16, 8), (16, 16), (16, 1), (32, 5), (200, 50), (40, 39)]
)
@pytest.mark.parametrize("n", [97, 16, 17])
def test_perplexity_scores_n_minus_one_tokens(tiny_model, max_length, stride, n):
    ids = _random_ids(n, tiny_model.config.vocab_size)
    result = perplexity(tiny_model, None, None, max_length=max_length, stride=stride,
                        input_ids=ids, show_progress=False)  # fmt: skip
    assert isinstance(result, PerplexityResult)
    assert result.tokens == n - 1
    assert result.ppl == pytest.approx(math.exp(result.nll))


@pytest.mark.parametrize(("max_length", "stride"), [(16, 8), (32, 5), (24, 23)])
def test_perplexity_matches_hf_docs_recipe(tiny_model, max_length, stride):
    ids = _random_ids(150, tiny_model.config.vocab_size, seed=1)
    nll_sum, n_tokens = _hf_recipe_nll(tiny_model, ids, max_length, stride)
    result = perplexity(tiny_model, None, None, max_length=max_length, stride=stride,
                        input_ids=ids, show_progress=False)  # fmt: skip
    assert result.tokens == n_tokens == 149
    assert result.nll == pytest.approx(nll_sum / n_tokens, rel=1e-5)


def test_single_window_equals_full_forward(tiny_model):
    ids = _random_ids(60, tiny_model.config.vocab_size, seed=2)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids[None]).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    expected_nll = -logprobs.gather(1, ids[1:, None]).mean().item()
    with torch.no_grad():
        loss = tiny_model(input_ids=ids[None], labels=ids[None]).loss.item()
    result = perplexity(
        tiny_model,
        None,
        None,
        max_length=64,
        stride=32,
        input_ids=ids,
        show_progress=False,
    )
    assert result.tokens == 59
    assert result.nll == pytest.approx(expected_nll, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_batching_does_not_change_result(tiny_model):
    ids = _random_ids(203, tiny_model.config.vocab_size, seed=3)
    one = perplexity(
        tiny_model,
        None,
        None,
        max_length=32,
        stride=12,
        input_ids=ids,
        show_progress=False,
    )
    many = perplexity(tiny_model, None, None, max_length=32, stride=12, batch_size=5,
                      input_ids=ids, show_progress=False)  # fmt: skip
    assert many.tokens == one.tokens == 202
    assert many.nll == pytest.approx(one.nll, rel=1e-5)


def test_text_pathway_and_max_tokens(tiny_model, tiny_tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog."] * 3 + [
        "To be, or not to be."
    ]
    n = len(tiny_tokenizer("\n\n".join(texts)).input_ids)
    full = perplexity(
        tiny_model, tiny_tokenizer, texts, max_length=16, stride=8, show_progress=False
    )
    assert full.tokens == n - 1
    short = perplexity(
        tiny_model,
        tiny_tokenizer,
        texts,
        max_length=16,
        stride=8,
        max_tokens=20,
        show_progress=False,
    )
    assert short.tokens == 19
    as_str = perplexity(
        tiny_model,
        tiny_tokenizer,
        "\n\n".join(texts),
        max_length=16,
        stride=8,
        show_progress=False,
    )
    assert as_str == full


def test_model_mode_is_restored(tiny_model):
    tiny_model.train()
    try:
        ids = _random_ids(20, tiny_model.config.vocab_size)
        perplexity(
            tiny_model,
            None,
            None,
            max_length=8,
            stride=4,
            input_ids=ids,
            show_progress=False,
        )
        assert tiny_model.training
    finally:
        tiny_model.eval()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_length": 16, "stride": 17}, "stride"),
     ({"max_length": 16, "stride": 0}, "stride"),
     ({"max_length": 16, "stride": -1}, "stride"),
     ({"max_length": 1, "stride": 1}, "max_length"),
     ({"batch_size": 0}, "batch_size")],
)  # fmt: skip
def test_invalid_window_arguments(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ids = _random_ids(20, tiny_model.config.vocab_size)
        perplexity(tiny_model, None, None, input_ids=ids, show_progress=False, **kwargs)


@pytest.mark.parametrize("texts", ["", "   \n", [], ["", ""]])
def test_empty_text_is_rejected(tiny_model, tiny_tokenizer, texts):
    with pytest.raises(ValueError, match="no text"):
        perplexity(tiny_model, tiny_tokenizer, texts, show_progress=False)


# ----------------------------------------------------------------------------- text
# splits


@pytest.fixture(scope="module")
def splits():
    return load_text_splits()


def test_splits_are_disjoint_and_non_empty(splits):
    assert set(splits) == {"calibration", "validation", "test"}
    texts = {name: splits[name]["text"] for name in splits}
    for name, rows in texts.items():
        assert len(rows) > 100, name
        assert len(set(rows)) == len(rows), f"duplicates inside {name}"
        assert all(isinstance(t, str) and t.strip() for t in rows)
    normalized = {
        name: {" ".join(t.split()) for t in rows} for name, rows in texts.items()
    }
    assert not normalized["calibration"] & normalized["test"]
    assert not normalized["calibration"] & normalized["validation"]
    assert not normalized["validation"] & normalized["test"]
    assert len(texts["calibration"]) > 5 * len(texts["test"])
    assert {"boolq", "lambada"} <= set(splits["test"]["source"])


def test_split_membership_is_stable_and_seed_only_reorders(splits):
    other = load_text_splits(seed=1)
    for name in splits:
        assert set(other[name]["text"]) == set(splits[name]["text"])
    assert other["test"]["text"][:20] != splits["test"]["text"][:20]
    assert load_text_splits(seed=0)["test"]["text"] == splits["test"]["text"]


def test_membership_does_not_depend_on_other_sources(splits):
    without = load_text_splits(include_shakespeare=False)
    for name in splits:
        expected = {
            t
            for t, s in zip(splits[name]["text"], splits[name]["source"])
            if s != "shakespeare"
        }
        assert set(without[name]["text"]) == expected


def test_calibration_dataset_shapes(tiny_tokenizer, splits):
    ds = calibration_dataset(tiny_tokenizer, num_samples=5, seq_len=48)
    assert ds.column_names == ["input_ids", "attention_mask"]
    assert len(ds) == 5
    for row in ds:
        assert len(row["input_ids"]) == len(row["attention_mask"]) == 48
        assert set(row["attention_mask"]) == {1}
        assert all(
            isinstance(i, int) and 0 <= i < len(tiny_tokenizer)
            for i in row["input_ids"]
        )
    # Samples are consecutive chunks of the calibration stream, starting at its first
    # document.
    first_doc = tiny_tokenizer(
        splits["calibration"]["text"][0], add_special_tokens=False
    ).input_ids
    assert ds[0]["input_ids"][:20] == first_doc[:20]


@pytest.mark.parametrize(("num_samples", "seq_len"), [(0, 16), (-3, 16), (4, 0)])
def test_calibration_dataset_rejects_bad_sizes(tiny_tokenizer, num_samples, seq_len):
    with pytest.raises(ValueError, match="positive"):
        calibration_dataset(tiny_tokenizer, num_samples=num_samples, seq_len=seq_len)


def test_calibration_dataset_too_short(tiny_tokenizer):
    with pytest.raises(ValueError, match="too short"):
        calibration_dataset(
            tiny_tokenizer, num_samples=10, seq_len=10**7, include_shakespeare=False
        )


# ----------------------------------------------------------------------------- caching
# / paths


def _slow_build(out: Path) -> None:
    """Build function for the concurrency test: slow enough that workers overlap."""
    counter = out.parent / "builds.log"
    with open(counter, "a") as fh:
        fh.write("x")
    time.sleep(0.5)
    (out / "payload.json").write_text(json.dumps({"ok": True}))


def _worker(target: str) -> None:
    cache_mod.materialize_once(Path(target), _slow_build)
    assert json.loads((Path(target) / "payload.json").read_text()) == {"ok": True}


def test_materialize_once_across_processes(tmp_path):
    target = tmp_path / "asset"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(str(target),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (tmp_path / "builds.log").read_text() == "x"  # built exactly once
    assert not list(tmp_path.glob(".asset.*tmp-*"))  # no temp leftovers


def test_materialize_once_failure_leaves_nothing(tmp_path):
    def broken(out: Path) -> None:
        (out / "half.bin").write_bytes(b"0" * 10)
        raise RuntimeError("conversion failed")

    target = tmp_path / "asset"
    with pytest.raises(RuntimeError, match="conversion failed"):
        cache_mod.materialize_once(target, broken)
    assert not target.exists()
    assert not list(tmp_path.glob(".asset.*tmp-*"))
    # A later attempt succeeds, and a recipe version change triggers a rebuild.
    cache_mod.materialize_once(target, _slow_build)
    cache_mod.materialize_once(target, _slow_build, version="2")
    assert (tmp_path / "builds.log").read_text() == "xx"


def _build_then_hang(target: str, ready: str) -> None:
    def build(out: Path) -> None:
        (out / "payload.json").write_text("partial")
        Path(ready).write_text("x")
        time.sleep(600)

    cache_mod.materialize_once(Path(target), build)


def test_killed_build_leaves_no_asset_and_the_next_build_removes_its_folder(tmp_path):
    target, ready = tmp_path / "asset", tmp_path / "ready"
    proc = multiprocessing.get_context("fork").Process(
        target=_build_then_hang, args=(str(target), str(ready))
    )
    proc.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert not target.exists() and len(list(tmp_path.glob(".asset.*tmp-*"))) == 1
    cache_mod.materialize_once(target, _slow_build)
    assert json.loads((target / "payload.json").read_text()) == {"ok": True}
    assert not list(tmp_path.glob(".asset.*tmp-*"))


@pytest.fixture
def fake_conversion(monkeypatch) -> list[Path]:
    """Replace the one-minute GGUF conversion by a tiny config-built model."""
    from tiny_models import save_tiny_model

    builds: list[Path] = []

    def convert(out: Path) -> None:
        builds.append(out)
        save_tiny_model("llama", str(out), num_layers=1)

    monkeypatch.setattr(embedded_mod, "_convert_gguf_to_hf", convert)
    monkeypatch.setattr(embedded_mod, "_verify_hf_folder", lambda path: None)
    return builds


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage",
    [lambda p: _truncate(p / "model.safetensors"),
     lambda p: (p / "model.safetensors").unlink(),
     lambda p: (p / "model.safetensors").write_bytes(b""),
     lambda p: (p / "tokenizer.json").unlink(),
     lambda p: (p / "config.json").write_text("{")],
    ids=["truncated", "deleted", "emptied", "no_tokenizer", "bad_config"],
)  # fmt: skip
def test_damaged_embedded_model_cache_is_rebuilt(tmp_path, fake_conversion, damage):
    from safetensors import safe_open

    path = Path(embedded_model_path(tmp_path))
    assert embedded_model_path(tmp_path) == str(path)  # cached: no second build
    assert len(fake_conversion) == 1
    damage(path)
    assert embedded_model_path(tmp_path) == str(path)
    assert len(fake_conversion) == 2  # rebuilt, not handed out damaged
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert list(f.keys())
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert (path / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".smol")) == [
        ".smollm2-135m-instruct.lock"
    ]


def test_resolve_model_paths(tmp_path, monkeypatch):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert (
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    for missing in [
        str(tmp_path / "nope"),
        "./does/not/exist",
        "~/definitely-not-here-adadsf",
        "../nope",
    ]:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model(missing)
    afile = tmp_path / "model.gguf"
    afile.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model(str(afile))
    calls: list[str] = []
    monkeypatch.setattr(
        embedded_mod,
        "embedded_model_path",
        lambda cache_dir=None: calls.append("x") or "/cached",
    )
    assert (
        resolve_model(None)
        == resolve_model("smollm2")
        == resolve_model("Embedded")
        == "/cached"
    )
    assert len(calls) == 3


def test_default_cache_root_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ADADSF_CACHE", str(tmp_path))
    assert cache_mod.default_cache_root() == tmp_path.resolve()
    assert cache_mod.default_cache_root(tmp_path / "x") == (tmp_path / "x").resolve()
    monkeypatch.delenv("ADADSF_CACHE")
    assert (
        cache_mod.default_cache_root()
        == (Path.home() / ".cache/adadsf_modifier").resolve()
    )
