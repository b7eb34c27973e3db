"""`adadsf compress` end to end on a tiny model: the precision it loads the model in
(``--dtype``) is the checkpoint's, and the recipe's alignment trains on rows of its own
(``--align-samples``; by default one pass of its steps) instead of cycling the few
calibration rows."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from tiny_models import save_tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import adadsf_modifier
from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.cli import main
from adadsf_modifier.cli.alignment_rows import alignment_rows
from adadsf_modifier.evaluation import calibration_dataset


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("m") / "llama"), 2)


@pytest.fixture(scope="module")
def tok():
    """One token per byte (the tiny models' word-level tokenizer maps this text to
    unknown tokens only, so rows of different text would compare equal)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def aligned(**kw) -> AdaDSFModifier:
    return AdaDSFModifier(retention=0.8, align_seq_len=16, **kw)


def test_alignment_gets_one_pass_of_its_steps_of_its_own_rows(tok):
    trains = aligned(align_steps=3, align_batch_size=2)
    frozen = aligned()  # align_steps 0: nothing to train, no rows
    assert alignment_rows([trains, frozen], tok, None, seed=0) == 6
    rows = trains.align_dataset["input_ids"]
    assert len(rows) == 6 and {len(r) for r in rows} == {16}
    assert frozen.align_dataset is None
    # the calibration text, cut alike: the first rows are the calibration rows
    calib = calibration_dataset(tok, 2, 16, seed=0)["input_ids"]
    assert rows[:2] == calib
    assert rows != calibration_dataset(tok, 6, 16, seed=1)["input_ids"]


def test_align_samples_sets_the_rows_and_zero_keeps_the_calibration_rows(tok):
    trains = aligned(align_steps=3, align_batch_size=2)
    assert alignment_rows([trains], tok, 5, seed=0) == 5
    assert len(trains.align_dataset) == 5
    cycles = aligned(align_steps=3, align_batch_size=2)
    assert alignment_rows([cycles], tok, 0, seed=0) is None
    assert cycles.align_dataset is None


def test_a_dataset_given_in_the_recipe_is_kept(tok):
    own = calibration_dataset(tok, 4, 8, seed=3)
    mod = aligned(align_steps=3, align_dataset=own)
    assert alignment_rows([mod], tok, None, seed=0) is None
    assert mod.align_dataset is own


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compress_writes_the_checkpoint_in_the_asked_precision(
    tmp_path, dense_dir, dtype, monkeypatch
):
    recipe = tmp_path / "recipe.yaml"
    block = {"retention": 0.8, "align_steps": 2, "align_batch_size": 2}
    block |= {"align_seq_len": 16, "router_init_steps": 5}
    recipe.write_text(
        yaml.safe_dump(
            {"sparsity_stage": {"sparsity_modifiers": {"AdaDSFModifier": block}}}
        )
    )
    seen = {}
    real = AdaDSFModifier.on_initialize

    def spy(self, state, **kwargs):  # what the modifier is given to train on
        seen["rows"] = None if self.align_dataset is None else len(self.align_dataset)
        seen["dtype"] = next(state.model.parameters()).dtype
        return real(self, state, **kwargs)

    monkeypatch.setattr(AdaDSFModifier, "on_initialize", spy)
    out = tmp_path / "out"
    argv = ["compress", "--model", dense_dir, "--recipe", recipe, "--output-dir", out]
    argv += ["--calibration-samples", "4", "--seq-len", "16", "--dtype", dtype]
    assert main([str(a) for a in argv]) == 0
    assert seen == {"rows": 4, "dtype": getattr(torch, dtype)}  # 2 steps x 2 rows
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == dtype
    model = adadsf_modifier.from_pretrained(out)
    assert model.get_input_embeddings().weight.dtype == getattr(torch, dtype)


def test_a_recipe_quantizing_the_routers_ends_in_one_line_not_a_traceback(
    tmp_path, dense_dir, capsys
):
    recipe = tmp_path / "recipe.yaml"
    gptq = {"targets": ["Linear"], "scheme": "W8A8", "ignore": ["lm_head"]}
    recipe.write_text(
        yaml.safe_dump(
            {
                "sparsity_stage": {
                    "sparsity_modifiers": {"AdaDSFModifier": {"retention": 0.8}}
                },
                "quantization_stage": {
                    "quantization_modifiers": {"GPTQModifier": gptq}
                },
            },
            sort_keys=False,
        )
    )
    argv = ["compress", "--model", dense_dir, "--recipe", recipe, "--output-dir"]
    argv += [tmp_path / "out", "--calibration-samples", "4", "--seq-len", "16"]
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "would quantize the AdaDSF router" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _words(n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(4, 60, (n,), generator=g))


@pytest.fixture
def spied_oneshot(monkeypatch):
    """``oneshot``'s calibration rows, recorded instead of compressing."""
    import llmcompressor

    seen: dict = {}

    def spy(**kwargs):
        seen["rows"] = kwargs["dataset"]["input_ids"]

    monkeypatch.setattr(llmcompressor, "oneshot", spy)
    return seen


@pytest.mark.parametrize("kind", ["jsonl", "save_to_disk", "txt"])
def test_compress_calibrates_on_the_users_dataset(
    tmp_path, dense_dir, spied_oneshot, kind
):
    """``--dataset``: the calibration rows are the user's text, packed as the embedded
    text is, whatever form it comes in."""
    import datasets
    from transformers import AutoTokenizer

    from adadsf_modifier.evaluation.text_splits import packed_rows

    texts = [_words(40, seed) for seed in range(6)]
    column = "text"
    if kind == "jsonl":
        source = tmp_path / "code.jsonl"
        source.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    elif kind == "save_to_disk":
        source, column = tmp_path / "folder", "content"
        split = datasets.Dataset.from_dict({column: texts})
        datasets.DatasetDict({"train": split}).save_to_disk(str(source))
    else:
        source = tmp_path / "mine.txt"
        source.write_text("\n\n".join(texts))
        texts = ["\n\n".join(texts)]
    argv = ["compress", "--model", dense_dir, "--output-dir", tmp_path / "out",
            "--calibration-samples", "4", "--seq-len", "16", "--dataset", source,
            "--text-column", column, "--align-samples", "0"]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    tok = AutoTokenizer.from_pretrained(dense_dir)
    expected = packed_rows(tok, texts, 4, 16, "x")["input_ids"]
    assert spied_oneshot["rows"] == expected
    embedded = calibration_dataset(tok, 4, 16, seed=0)["input_ids"]
    assert expected != embedded


@pytest.mark.parametrize(
    "case, message",
    [("column", "no column 'text'"), ("empty", "holds no text"),
     ("name", "cannot be read"), ("short", "text too short"),
     ("missing", "no such file")],
)  # fmt: skip
def test_a_dataset_that_cannot_calibrate_is_refused_before_the_model_loads(
    tmp_path, dense_dir, monkeypatch, capsys, case, message
):
    from transformers import AutoModelForCausalLM

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the dataset was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    source = {
        "column": tmp_path / "a.jsonl",
        "empty": tmp_path / "b.txt",
        "name": "no-such-user/no-such-dataset",
        "short": tmp_path / "c.txt",
        "missing": tmp_path / "absent.jsonl",
    }[case]
    if case == "column":
        source.write_text(json.dumps({"content": _words(50, 0)}))
    elif case == "empty":
        source.write_text("  \n")
    elif case == "short":
        source.write_text(_words(20, 0))
    argv = ["compress", "--model", dense_dir, "--output-dir", tmp_path / "out",
            "--calibration-samples", "4", "--seq-len", "16",
            "--dataset", source]  # fmt: skip
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_alignment_rows_come_from_the_users_text_too(tok):
    from adadsf_modifier.evaluation.text_splits import packed_rows

    texts = [_words(80, seed) for seed in range(4)]
    trains = aligned(align_steps=3, align_batch_size=2)
    assert alignment_rows([trains], tok, None, 0, texts, "mine.jsonl") == 6
    assert (
        trains.align_dataset["input_ids"]
        == packed_rows(tok, texts, 6, 16, "x")["input_ids"]
    )
    with pytest.raises(ValueError, match="--dataset mine.jsonl has only"):
        alignment_rows([aligned(align_steps=500)], tok, None, 0, texts, "mine.jsonl")


def test_a_chat_column_is_rendered_through_the_models_chat_template(
    tmp_path, spied_oneshot
):
    """A ``messages`` column (read when there is no ``text`` column) calibrates on the
    conversations as the model's chat template writes them; a tokenizer without a
    template is refused before the model loads."""
    from transformers import AutoTokenizer

    from adadsf_modifier.evaluation.text_splits import packed_rows

    plain = save_tiny_model("llama", str(tmp_path / "plain"), 2)
    chat = save_tiny_model("llama", str(tmp_path / "chat"), 2)
    tok = AutoTokenizer.from_pretrained(chat)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} w5 {{ m['content'] }} w6 {% endfor %}"
    )
    tok.save_pretrained(chat)
    conversations = [
        [{"role": "user", "content": _words(20, s)},
         {"role": "assistant", "content": _words(30, s + 100)}]
        for s in range(5)
    ]  # fmt: skip
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps({"messages": c}) for c in conversations))
    argv = ["compress", "--output-dir", tmp_path / "out", "--calibration-samples", "4",
            "--seq-len", "16", "--dataset", source, "--align-samples", "0"]  # fmt: skip
    assert main([str(a) for a in ["compress", "--model", chat, *argv[1:]]]) == 0
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in conversations]
    assert "w5" in rendered[0] and conversations[0][1]["content"] in rendered[0]
    expected = packed_rows(tok, rendered, 4, 16, "x")["input_ids"]
    assert spied_oneshot["rows"] == expected
    contents = [m["content"] for c in conversations for m in c]
    assert expected != packed_rows(tok, contents, 4, 16, "x")["input_ids"]
    spied_oneshot.clear()
    assert main([str(a) for a in ["compress", "--model", plain, *argv[1:]]]) == 2
    assert not spied_oneshot  # refused before oneshot, with the reason


def test_the_compress_record_names_the_dataset_it_calibrated_on(
    tmp_path, dense_dir, spied_oneshot
):
    from adadsf_modifier.cli.commands import compress

    source = tmp_path / "mine.txt"
    source.write_text(_words(200, 1))
    from adadsf_modifier.cli.checks import default_recipe

    record = compress(dense_dir, default_recipe(), tmp_path / "out", 4, 16, 0,
                      align_samples=0, texts=[source.read_text()],
                      source=str(source))  # fmt: skip
    assert record["dataset"] == str(source)
    record = compress(dense_dir, default_recipe(), tmp_path / "out2", 4, 16, 0,
                      align_samples=0)  # fmt: skip
    assert record["dataset"] == "embedded"
