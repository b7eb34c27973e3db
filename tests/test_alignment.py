"""Alignment fine-tune stage: loss terms, the training loop, and its wiring into
AdaDSFModifier."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from llmcompressor import oneshot
from llmcompressor.recipe import Recipe
from pydantic import ValidationError
from tiny_models import save_tiny_model, tiny_model, token_dataset
from transformers import AutoModelForCausalLM

import adadsf_modifier  # noqa: F401  (registers the modifier)
from adadsf_modifier import AdaDSFModifier, TokenRouter, routed_layers
from adadsf_modifier.alignment import (
    AlignmentConfig,
    AlignmentDivergedError,
    AlignmentLossWeights,
    RowBatcher,
    align_model,
    alignment_loss,
    causal_lm_loss,
    hidden_alignment_loss,
    kl_divergence_loss,
    make_teacher,
    select_trainable,
    training_rows,
)
from adadsf_modifier.routing import decoder_layers, route_layer

RATIOS = [0.5, 0.75, 0.5, 0.75]


# ------------------------------------------------------------------------------------
# helpers


def routed_pair(arch: str = "llama", seed: int = 0):
    """(routed student, dense teacher) from the same tiny random model."""
    model = tiny_model(arch, num_layers=len(RATIOS), seed=seed)
    teacher = make_teacher(model)
    spec, layers = decoder_layers(model)
    torch.manual_seed(seed + 1)
    for i, ((_, layer), r) in enumerate(zip(layers, RATIOS)):
        route_layer(
            layer,
            TokenRouter(model.config.hidden_size, 16),
            r,
            i,
            spec.cache_kwarg,
            model.config,
        )
    return model, teacher


def config(**kw) -> AlignmentConfig:
    """Small defaults; ``steps=3`` stands for ``align_steps=3``."""
    kw = {"steps": 3, "lr": 1e-2, "batch_size": 4, "seq_len": 16, **kw}
    return AlignmentConfig(**{f"align_{k}": v for k, v in kw.items()})


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def router_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".router." in k}


# ------------------------------------------------------------------------------------
# losses


def test_kl_is_zero_for_identical_logits_and_positive_otherwise():
    t = torch.randn(2, 5, 11)
    assert kl_divergence_loss(t, t).item() == pytest.approx(0.0, abs=1e-6)
    s = torch.randn(2, 5, 11)
    expected = (
        (F.softmax(t, -1) * (F.log_softmax(t, -1) - F.log_softmax(s, -1)))
        .sum(-1)
        .mean()
    )
    assert kl_divergence_loss(t, s).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_kl_equals_the_elementwise_formula_and_its_gradient(dtype, monkeypatch):
    import adadsf_modifier.alignment.losses as chunked_kl

    monkeypatch.setattr(chunked_kl, "CHUNK_BYTES", 3 * 4 * 11)  # 3 rows a chunk
    g = torch.Generator().manual_seed(0)
    t = (2 * torch.randn(2, 7, 11, generator=g)).to(dtype)  # 14 rows: 4 full + 2
    s = (2 * torch.randn(2, 7, 11, generator=g)).to(dtype).requires_grad_(True)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    out = kl_divergence_loss(t, s, mask)
    out.backward()
    ref_s = s.detach().clone().requires_grad_(True)
    per_token = F.kl_div(F.log_softmax(ref_s.float(), -1), F.log_softmax(t.float(), -1),
                         reduction="none", log_target=True).sum(-1)  # fmt: skip
    ref = (per_token * mask).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert s.grad.dtype == dtype and s.grad[1, 5:].abs().max() == 0
    tol = {"rtol": 1e-2, "atol": 1e-4} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(s.grad.float(), ref_s.grad.float(), **tol)


def test_chunked_kl_of_no_real_token_is_zero_with_a_gradient():
    s = torch.randn(1, 3, 5, requires_grad=True)
    out = kl_divergence_loss(torch.randn(1, 3, 5), s, torch.zeros(1, 3))
    out.backward()
    assert out.item() == 0.0 and s.grad.abs().max() == 0


def test_losses_ignore_padding():
    t, s = torch.randn(2, 6, 9), torch.randn(2, 6, 9)
    ids = torch.randint(0, 9, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    hs, ht = (
        [torch.randn(2, 6, 7) for _ in range(3)],
        [torch.randn(2, 6, 7) for _ in range(3)],
    )
    base = (
        kl_divergence_loss(t, s, mask),
        hidden_alignment_loss(hs, ht, mask),
        causal_lm_loss(s, ids, mask),
    )
    # garbage at padded positions changes nothing
    s2, ids2 = s.clone(), ids.clone()
    s2[1, 4:] = 1e4
    ids2[1, 4:] = 0
    hs2 = [h.clone() for h in hs]
    for h in hs2:
        h[1, 4:] = -1e4
    again = (
        kl_divergence_loss(t, s2, mask),
        hidden_alignment_loss(hs2, ht, mask),
        causal_lm_loss(s2, ids2, mask),
    )
    for a, b in zip(base, again):
        assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_hidden_alignment_is_mean_over_layers_of_token_mean_l2():
    hs, ht = (
        [torch.randn(1, 4, 8) for _ in range(2)],
        [torch.randn(1, 4, 8) for _ in range(2)],
    )
    per_layer = [
        torch.linalg.vector_norm(F.softmax(a, -1) - F.softmax(b, -1), dim=-1).mean()
        for a, b in zip(hs, ht)
    ]
    assert hidden_alignment_loss(hs, ht).item() == pytest.approx(
        sum(per_layer).item() / 2, rel=1e-6
    )
    assert hidden_alignment_loss(ht, ht).item() == 0.0


def test_causal_lm_loss_matches_cross_entropy():
    logits, ids = torch.randn(2, 7, 13), torch.randint(0, 13, (2, 7))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 13), ids[:, 1:].reshape(-1))
    assert causal_lm_loss(logits, ids).item() == pytest.approx(
        expected.item(), rel=1e-6
    )


def test_weighted_total_and_skipped_terms():
    t, s = torch.randn(1, 4, 9), torch.randn(1, 4, 9)
    ids = torch.randint(0, 9, (1, 4))
    h = [torch.randn(1, 4, 5)]
    w = AlignmentLossWeights(kl=2.0, hidden=0.0, lm=0.5)
    terms = alignment_loss(w, ids, None, s, h, t, h)
    assert terms.hidden is None
    assert terms.total.item() == pytest.approx(
        2 * terms.kl.item() + 0.5 * terms.lm.item(), rel=1e-6
    )
    lm_only = alignment_loss(AlignmentLossWeights(kl=0, hidden=0, lm=1), ids, None, s)
    assert lm_only.kl is None and lm_only.total.item() == pytest.approx(
        lm_only.lm.item()
    )


def test_an_unknown_loss_or_all_zero_weights_are_refused():
    with pytest.raises(ValueError, match="align_loss must be one of"):
        config(loss="kl")
    ids, s = torch.randint(0, 9, (1, 4)), torch.randn(1, 4, 9)
    with pytest.raises(ValueError, match="every loss weight is 0"):
        alignment_loss(AlignmentLossWeights(kl=0, hidden=0, lm=0), ids, None, s)


# ------------------------------------------------------------------------------------
# data


def test_training_rows_strip_padding_truncate_and_rebatch():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
        "labels": torch.zeros(2, 4),
    }
    rows = training_rows([batch, {"input_ids": [11, 12, 13]}], seq_len=3)
    assert [r.tolist() for r in rows] == [[5, 6, 7], [9, 10], [11, 12, 13]]
    batcher = RowBatcher(rows, batch_size=2, seed=0, pad_token_id=0)
    seen = []
    for _ in range(3):  # 6 rows drawn = two full epochs
        b = batcher.next_batch()
        assert (
            b["input_ids"].shape == b["attention_mask"].shape
            and b["input_ids"].shape[0] == 2
        )
        for ids, m in zip(b["input_ids"], b["attention_mask"]):
            seen.append(ids[m.bool()].tolist())
            assert m.tolist() == sorted(m.tolist(), reverse=True)  # right padding
    assert sorted(map(tuple, seen)) == sorted(
        map(tuple, [r.tolist() for r in rows] * 2)
    )
    again = RowBatcher(rows, batch_size=2, seed=0)
    first = again.next_batch()
    assert torch.equal(
        first["input_ids"], RowBatcher(rows, 2, seed=0).next_batch()["input_ids"]
    )


def test_training_rows_reject_empty_data():
    with pytest.raises(ValueError, match="no real tokens"):
        training_rows([{"input_ids": [[1, 2]], "attention_mask": [[0, 0]]}], seq_len=4)
    with pytest.raises(ValueError, match="input_ids"):
        training_rows([{"text": "hi"}], seq_len=4)


# ------------------------------------------------------------------------------------
# loop


def test_loss_decreases_and_routers_learn_on_a_fixed_batch():
    student, teacher = routed_pair()
    before = snapshot(student)
    teacher_before = snapshot(teacher)
    data = token_dataset(4, 16)  # 4 rows = batch size: every step sees the same batch
    report = align_model(student, teacher, data, config(steps=8, lr=2e-2))
    assert len(report.losses) == 8 and report.steps == 8
    assert report.losses[-1] < report.losses[0]
    after = snapshot(student)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".router." in k for k in changed)
    assert any("fc1" in k for k in changed)  # the first router layer gets gradient too
    assert_same_state(teacher_before, snapshot(teacher))
    assert all(torch.isfinite(v).all() for v in after.values())
    # modes / flags restored
    assert not student.training and not student.model.layers[0].self_attn.training
    assert all(p.requires_grad for p in student.parameters())
    assert all(p.grad is None for p in student.parameters())


def test_routers_and_layers_trains_layer_weights_only_and_keeps_teacher_separate():
    student, teacher = routed_pair()
    before, teacher_before = snapshot(student), snapshot(teacher)
    align_model(
        student,
        teacher,
        token_dataset(4, 16),
        config(steps=2, lr=1e-3, trainable="routers_and_layers"),
    )
    after = snapshot(student)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".router." in k for k in changed)
    assert any("self_attn" in k for k in changed) and any("mlp" in k for k in changed)
    assert not any(
        k.startswith(("model.embed_tokens", "lm_head", "model.norm")) for k in changed
    )
    assert_same_state(teacher_before, snapshot(teacher))
    assert not any(p.requires_grad for p in teacher.parameters())


def test_same_seed_gives_identical_weights_and_other_seed_differs():
    runs = []
    for seed in (3, 3, 4):
        student, teacher = routed_pair()
        align_model(
            student,
            teacher,
            token_dataset(8, 16),
            config(steps=3, batch_size=2),
            seed=seed,
        )
        runs.append(router_state(student))
    assert_same_state(runs[0], runs[1])
    assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_row_order_of_the_data_does_not_matter():
    data = token_dataset(6, 16)
    runs = []
    for rows in (list(data), list(data)[::-1]):
        student, teacher = routed_pair()
        align_model(student, teacher, rows, config(steps=2, batch_size=2))
        runs.append(router_state(student))
    assert_same_state(runs[0], runs[1])


def test_zero_steps_is_a_no_op():
    student, teacher = routed_pair()
    before = snapshot(student)
    report = align_model(student, teacher, token_dataset(4, 16), config(steps=0))
    assert report.steps == 0 and report.losses == []
    assert_same_state(before, snapshot(student))


def test_lm_loss_only_needs_no_teacher_and_kl_needs_one():
    student, _ = routed_pair()
    report = align_model(
        student, None, token_dataset(4, 16), config(steps=2, loss="lm")
    )
    assert set(report.terms) == {"lm"}
    with pytest.raises(ValueError, match="need the dense teacher"):
        align_model(student, None, token_dataset(4, 16), config(steps=1))


def test_padded_rows_of_different_lengths_train():
    student, teacher = routed_pair("gpt_neox")
    rows = [{"input_ids": list(range(4, 4 + n))} for n in (16, 9, 5, 12)]
    report = align_model(student, teacher, rows, config(steps=2, lr=1e-3))
    assert all(math.isfinite(x) for x in report.losses)


def test_gradient_checkpointing_matches_plain_training():
    results = []
    for gc in (False, True):
        student, teacher = routed_pair()
        modes = [m.training for m in student.modules()]
        report = align_model(
            student,
            teacher,
            token_dataset(4, 16),
            config(steps=2, gradient_checkpointing=gc),
        )
        assert not student.is_gradient_checkpointing
        assert not hasattr(student, "_require_grads_hook")
        assert [m.training for m in student.modules()] == modes
        results.append((report.losses, router_state(student)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for k in results[0][1]:
        torch.testing.assert_close(
            results[0][1][k], results[1][1][k], atol=1e-6, rtol=1e-5
        )


def test_bf16_autocast_runs():
    student, teacher = routed_pair()
    report = align_model(
        student, teacher, token_dataset(4, 16), config(steps=1, bf16=True)
    )
    assert math.isfinite(report.losses[0])
    assert all(p.dtype == torch.float32 for p in student.parameters())


def test_nan_loss_stops_with_clear_error_and_keeps_weights():
    student, teacher = routed_pair()
    before = snapshot(student)
    with torch.no_grad():
        teacher.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(
        AlignmentDivergedError, match="non-finite loss at step 1/3"
    ) as err:
        align_model(student, teacher, token_dataset(4, 16), config(steps=3))
    assert isinstance(err.value, FloatingPointError) and err.value.step == 1
    assert_same_state(before, snapshot(student))
    assert all(p.requires_grad for p in student.parameters())


def test_nan_mid_run_restores_last_good_step():
    reference, teacher = routed_pair()
    align_model(reference, teacher, token_dataset(8, 16), config(steps=2, batch_size=2))
    good = router_state(reference)

    student, teacher = routed_pair()
    calls = {"n": 0}

    def poison(module, args, output):  # the student's 3rd forward returns NaN logits
        calls["n"] += 1
        return output * float("nan") if calls["n"] == 3 else output

    handle = student.lm_head.register_forward_hook(poison)
    with pytest.raises(
        FloatingPointError, match="step 3/5.*restored to the values after step 2"
    ):
        align_model(
            student, teacher, token_dataset(8, 16), config(steps=5, batch_size=2)
        )
    handle.remove()
    assert_same_state(good, router_state(student))


def test_nan_gradient_is_caught_before_the_update():
    student, teacher = routed_pair()
    before = router_state(student)
    layer = routed_layers(student)[1]
    layer.router.fc2.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(AlignmentDivergedError, match="non-finite gradient at step 1"):
        align_model(student, teacher, token_dataset(4, 16), config(steps=2))
    assert_same_state(before, router_state(student))


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(steps=-1), "steps\n  Value error, must be an integer >= 0 \\(0 skips"),
        (dict(lr=0.0), "lr\n  Value error, must be a finite learning rate > 0"),
        (dict(lr=-1e-3), "must be a finite learning rate > 0"),
        (dict(batch_size=0), "batch_size\n  Value error, must be a positive integer"),
        (dict(trainable="everything"), "trainable must be one of"),
    ],
)
def test_bad_config(kwargs, text):
    with pytest.raises(ValueError, match=text):
        config(**kwargs)


def test_select_trainable_needs_routed_layers():
    with pytest.raises(ValueError, match="no routed layers"):
        select_trainable(tiny_model("llama"), "routers")


def test_given_params_fine_tune_a_dense_model_like_a_hand_written_adamw_step():
    """The study's dense control: ``align_model`` trains the parameters it is given
    on a model with no routed layer. One step over one batch of all rows (so the row
    order cannot matter) equals AdamW on the mean causal-LM loss, computed here by
    hand; every other parameter stays as it was."""
    model = tiny_model("llama", num_layers=3)
    ref = tiny_model("llama", num_layers=3)  # the same seed: the same weights
    rows = token_dataset(4, 16)
    _, layers = decoder_layers(model)
    params = [p for _, layer in layers[1:] for p in layer.parameters()]
    before = snapshot(model)
    cfg = config(steps=1, lr=1e-3, batch_size=4, loss="lm")
    report = align_model(model, None, rows, cfg, params=params)
    assert report.steps == 1 and report.num_trainable == sum(p.numel() for p in params)

    _, ref_layers = decoder_layers(ref)
    trained = [p for _, layer in ref_layers[1:] for p in layer.parameters()]
    ref.requires_grad_(False).eval()
    for p in trained:
        p.requires_grad_(True)
    ids = torch.tensor(rows["input_ids"])
    logits = ref(input_ids=ids).logits.float()
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)  # the alignment's gradient clip
    torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.0).step()
    assert report.losses[0] == pytest.approx(loss.item(), rel=1e-5)

    after, expected = snapshot(model), snapshot(ref)
    trained_names = {n for n, _ in model.named_parameters() if ".layers.0." not in n}
    trained_names = {n for n in trained_names if ".layers." in n}
    for name in after:
        if name in trained_names:
            assert not torch.equal(after[name], before[name]), name
            # AdamW's first step moves each weight by ~lr (1e-3): 1e-5 resolves it
            torch.testing.assert_close(after[name], expected[name], rtol=0, atol=1e-5)
        else:  # embeddings, layer 0, final norm, LM head: untouched
            assert torch.equal(after[name], before[name]), name
    with pytest.raises(ValueError, match="params is empty"):
        align_model(model, None, rows, cfg, params=[])


def test_make_teacher_is_independent_and_frozen():
    model = tiny_model("llama")
    teacher = make_teacher(model)
    ptrs = {p.data_ptr() for p in (*model.parameters(), *model.buffers())}
    assert not any(
        t.data_ptr() in ptrs for t in (*teacher.parameters(), *teacher.buffers())
    )
    assert not teacher.training and not any(
        p.requires_grad for p in teacher.parameters()
    )


# ------------------------------------------------------------------------------------
# modifier


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(
        "llama", str(tmp_path_factory.mktemp("tiny") / "llama"), num_layers=4
    )


def run_oneshot(path, modifier, dataset=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    oneshot(
        model=model,
        recipe=[modifier],
        dataset=dataset or token_dataset(8, 16),
        num_calibration_samples=8,
        max_seq_length=16,
    )
    return model


def test_modifier_steps_zero_equals_unaligned_routed_model(llama_dir, monkeypatch):
    plain = run_oneshot(llama_dir, AdaDSFModifier(retention=0.6))
    import adadsf_modifier.modifier as modifier_module

    def no_teacher(model):
        raise AssertionError("no teacher must be built when align_steps=0")

    monkeypatch.setattr(modifier_module, "make_teacher", no_teacher)
    mod = AdaDSFModifier(
        retention=0.6, align_steps=0, align_lr=0.5, align_trainable="routers_and_layers"
    )
    skipped = run_oneshot(llama_dir, mod)
    assert mod.alignment_report is None
    assert_same_state(snapshot(plain), snapshot(skipped))


def test_modifier_aligns_after_routing_and_releases_teacher(llama_dir):
    plain = run_oneshot(llama_dir, AdaDSFModifier(retention=0.6))
    mod = AdaDSFModifier(
        retention=0.6,
        align_steps=3,
        align_lr=1e-2,
        align_batch_size=4,
        align_seq_len=12,
    )
    aligned = run_oneshot(llama_dir, mod)
    report = mod.alignment_report
    assert report.steps == 3 and len(report.losses) == 3 and report.num_rows == 8
    assert mod._teacher is None
    a, b = router_state(plain), router_state(aligned)
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    # only routers changed
    pa, pb = snapshot(plain), snapshot(aligned)
    assert all(torch.equal(pa[k], pb[k]) for k in pa if ".router." not in k)


def test_modifier_trains_on_align_dataset_when_given(llama_dir):
    mod = AdaDSFModifier(
        retention=0.6,
        align_steps=1,
        align_dataset=token_dataset(3, 10, seed=7),
        align_loss="lm",
    )
    run_oneshot(llama_dir, mod)
    assert mod.alignment_report.num_rows == 3
    assert set(mod.alignment_report.terms) == {"lm"}


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        (dict(align_steps=-1), "align_steps", ">= 0"),
        (dict(align_lr=0.0), "align_lr", "> 0"),
        (dict(align_lr=-1.0), "align_lr", "> 0"),
        (dict(align_loss="kl"), "align_loss", "one of"),
        (dict(align_batch_size=0), "align_batch_size", "a positive integer"),
        (dict(align_seq_len=-5), "align_seq_len", "a positive integer"),
        (dict(align_trainable="all"), "align_trainable", "routers"),
        (dict(align_dataset="wikitext"), "align_dataset", "iterable of rows"),
    ],
)
def test_bad_align_fields_fail_at_construction(kwargs, field, text):
    with pytest.raises(ValidationError, match=text) as err:
        AdaDSFModifier(**kwargs)
    assert field in str(err.value)


def test_align_fields_round_trip_through_yaml_recipe():
    mod = AdaDSFModifier(
        align_steps=7,
        align_lr=3e-3,
        align_trainable="routers_and_layers",
        align_loss="lm",
        align_dataset=token_dataset(2, 4),
    )
    text = Recipe.from_modifiers([mod]).yaml()
    assert "align_dataset" not in text
    (again,) = Recipe.create_instance(text).modifiers
    keys = {"align_steps", "align_lr", "align_trainable", "align_loss"}
    assert again.model_dump(include=keys) == mod.model_dump(include=keys)
    assert again.align_dataset is None


@pytest.mark.parametrize(
    "rows, message",
    [({"input_ids": [], "attention_mask": []}, "is empty"),
     ({"input_ids": [[5, 6, 7]] * 2, "attention_mask": [[0, 0, 0]] * 2},
      "no real token")],
)  # fmt: skip
def test_an_empty_or_padding_only_align_dataset_is_refused_at_construction(
    rows, message
):
    from datasets import Dataset

    with pytest.raises(ValidationError, match=message):
        AdaDSFModifier(
            retention=0.5, align_steps=2, align_dataset=Dataset.from_dict(rows)
        )
