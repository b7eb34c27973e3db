"""``evaluate_model``: FLOPs counted on the perplexity's own test tokens, bad token
counts refused before any work."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model, tiny_tokenizer

from adadsf_modifier.evaluation.evaluate import evaluate_model


@pytest.mark.parametrize("tokens", [0, 1, -5])
def test_a_token_count_below_two_is_refused_before_any_work(tokens, monkeypatch):
    import adadsf_modifier.evaluation.evaluate as ev

    def no_text(*a, **k):
        raise AssertionError("the text was loaded before the check")

    monkeypatch.setattr(ev, "load_text_splits", no_text)
    with pytest.raises(ValueError, match="at least 2"):
        evaluate_model(
            tiny_model("llama"), tiny_tokenizer(), "x", ppl_max_tokens=tokens
        )


def test_flops_are_counted_on_the_tokens_the_perplexity_scores():
    record = evaluate_model(tiny_model("llama"), tiny_tokenizer(), "dense",
                            ppl_max_tokens=300, flops_seq_len=128)  # fmt: skip
    assert record.ppl_tokens == 299  # scored: every token but the first
    assert record.flops_tokens == 300 and record.normalized_flops == pytest.approx(1.0)


def test_a_routed_model_is_evaluated_in_the_routing_mode_asked_for():
    """``adadsf eval --routing-mode topk``: the record says which mode measured it, and
    its kept share is the one that mode ran (top-k and causal part on this text)."""
    from test_causal_routing import causal_model

    records = {}
    for mode in ("causal", "topk"):
        model, _ = causal_model()
        records[mode] = evaluate_model(model, tiny_tokenizer(), mode,
                                       ppl_max_tokens=300, flops_seq_len=128,
                                       routing_mode=mode)  # fmt: skip
        assert records[mode].routing_mode == mode
        assert records[mode].retention_target == pytest.approx(0.725)  # the mean
    assert records["topk"].kept_fraction != records["causal"].kept_fraction


def test_eval_on_the_users_text_scores_what_the_perplexity_function_scores(
    tmp_path, capsys
):
    """``adadsf eval --text FILE``: the perplexity and FLOPs of those tokens, the
    project's own sliding-window protocol; a missing file is refused in one line
    before any model loads."""
    import json

    import torch
    from tiny_models import save_tiny_model

    from adadsf_modifier.cli import main
    from adadsf_modifier.evaluation.perplexity import perplexity, token_stream

    path = save_tiny_model("llama", str(tmp_path / "m"), 2)
    g = torch.Generator().manual_seed(3)
    text = " ".join(f"w{int(i)}" for i in torch.randint(4, 60, (400,), generator=g))
    file = tmp_path / "mine.txt"
    file.write_text(text)
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", path, "--text", str(file), "--ppl-tokens", "300",
            "--dtype", "float32",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = token_stream(tiny_tokenizer(), [text], None)[:300]
    expected = perplexity(model, None, None, 512, 256, input_ids=ids)
    assert record["text"] == str(file) and record["flops_tokens"] == 300
    assert record["ppl_tokens"] == expected.tokens == 299
    assert record["ppl"] == pytest.approx(float(expected.ppl), rel=1e-6)
    # another text gives another perplexity: the file was read, not the test split
    default = evaluate_model(model, tiny_tokenizer(), "dense", ppl_max_tokens=300)
    assert default.text == "test split" and default.ppl != pytest.approx(record["ppl"])
    argv = ["eval", "--model", path, "--text", str(tmp_path / "absent.txt")]
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err


def test_eval_on_the_users_dataset_scores_its_documents_as_a_text_file(tmp_path):
    """``adadsf eval --dataset FILE.jsonl``: the documents joined as the test split's
    are, scored exactly as ``--text`` scores the same text in a file."""
    import json

    import torch
    from tiny_models import save_tiny_model

    from adadsf_modifier.cli import main

    path = save_tiny_model("llama", str(tmp_path / "m"), 2)
    g = torch.Generator().manual_seed(5)
    docs = [
        " ".join(f"w{int(i)}" for i in torch.randint(4, 60, (90,), generator=g))
        for _ in range(4)
    ]
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(json.dumps({"body": d}) for d in docs)
    )
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    records = {}
    for kind, source in (("--dataset", "docs.jsonl"), ("--text", "docs.txt")):
        out = tmp_path / f"{source}.json"
        argv = ["eval", "--model", path, kind, str(tmp_path / source),
                "--ppl-tokens", "300", "--output", str(out)]  # fmt: skip
        if kind == "--dataset":
            argv += ["--text-column", "body"]
        assert main(argv) == 0
        records[kind] = json.loads(out.read_text())
    assert records["--dataset"]["text"] == str(tmp_path / "docs.jsonl")
    assert records["--dataset"]["ppl"] == records["--text"]["ppl"]
    assert records["--dataset"]["ppl_tokens"] == 299
    both = ["eval", "--model", path, "--text", str(tmp_path / "docs.txt"),
            "--dataset", str(tmp_path / "docs.jsonl")]  # fmt: skip
    assert main(both) == 2  # one source of text, not two
