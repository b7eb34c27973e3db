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
    """``adadsf eval --routing-mode rank``: the record says which mode measured it, and
    its kept share is the one that mode ran (rank and causal part on this text)."""
    from test_causal_routing import causal_model

    records = {}
    for mode in ("causal", "rank"):
        model, _ = causal_model()
        records[mode] = evaluate_model(model, tiny_tokenizer(), mode,
                                       ppl_max_tokens=300, flops_seq_len=128,
                                       routing_mode=mode)  # fmt: skip
        assert records[mode].routing_mode == mode
        assert records[mode].retention_target == pytest.approx(0.725)  # the mean
    assert records["rank"].kept_fraction != records["causal"].kept_fraction
