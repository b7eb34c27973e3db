"""FTP on AdaDSF's routed layers: key probe, static router, training, KV-cache
decoding."""

import pytest
import torch
from test_causal_routing import incremental_logits, left_padded
from test_routing import positions
from tiny_models import tiny_model

from adadsf_modifier import FTPModifier, routed_layers
from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.ftp import FTPLayerRouter, FTPTrainConfig, train_router
from adadsf_modifier.ftp.features import key_probe, probe_scores
from adadsf_modifier.ftp.static import static_keep_mask
from adadsf_modifier.routing.recorder import RoutingRecorder

FTP_ARCHS = ("llama", "qwen2", "mistral", "gemma2")


def calib_batches(n=3, rows=4, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(4, 128, (rows, length), generator=g)}
        for _ in range(n)
    ]


def ftp_model(arch="llama", schedule=(0.7, 0.5, 1.0, 0.6), steps=3, **kw):
    model = tiny_model(arch, num_layers=len(schedule))
    mod = FTPModifier(
        retention=sum(schedule) / len(schedule),
        schedule=list(schedule),
        train_steps=steps,
        keep_last_tokens=2,
        **kw,
    )
    mod.apply_to(model, calib_batches())
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, mod


def test_key_probe_equals_mean_query_logit_of_real_keys():
    """The folded probe reproduces ``mean_h qbar_h . k_h(x) / sqrt(d)`` computed with
    the layer's own norm and projections (pre-RoPE)."""
    model = tiny_model("qwen2", num_layers=1)  # k_proj has a bias
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32)
    mean_in = torch.randn(32)
    probe, bias = key_probe(layer, mean_in, model.config)
    attn = layer.self_attn
    with torch.no_grad():
        q = attn.q_proj(mean_in).view(4, 8)
        k = attn.k_proj(layer.input_layernorm(x)).view(2, 5, 2, 8)
        k = k[:, :, torch.tensor([0, 0, 1, 1])]  # each query head's kv head
        expected = (k * q).sum(-1).mean(-1) / 8**0.5
    got = probe_scores(x, probe, bias, layer.input_layernorm.variance_epsilon)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_static_router_keeps_first_and_last_tokens():
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, :3] = False  # left padding
    probe = torch.arange(20.0).view(2, 10).flip(1)  # highest score at the front
    keep = static_keep_mask(probe, real, ratio=0.5, keep_last=2)
    assert keep[0].sum() == 5 and keep[1].sum() == 3  # floor(0.5 * real length)
    assert keep[0, 0] and keep[0, -2:].all() and keep[1, 3] and keep[1, -2:].all()
    assert not keep[1, :3].any()  # padding never kept
    # the budget beyond first/last goes to the best-scoring tokens
    assert keep[0, 1:3].all() and not keep[0, 3:8].any()


def test_training_changes_only_the_shared_router_mlp():
    model, _ = ftp_model(steps=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_router(model, calib_batches(1), FTPTrainConfig(steps=3, lr=1e-2))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".router.mlp." in n for n in changed)
    assert all(p.requires_grad for p in model.parameters())  # restored afterwards
    routers = [m.router for m in routed_layers(model)]
    assert all(isinstance(r, FTPLayerRouter) for r in routers)
    assert len({id(r.shared_mlp) for r in routers}) == 1
    assert sum(".mlp.fc1.weight" in n and "router" in n for n in before) == 1


def test_training_report_counts_the_real_tokens_each_step_trained_on():
    model, _ = ftp_model(steps=0)
    batches = calib_batches(2, rows=2, length=8)
    batches[1]["attention_mask"] = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] + [[1] * 8])
    rep = train_router(model, batches, FTPTrainConfig(steps=3, lr=1e-2))
    # steps cycle over the batches: 16 real tokens, then 13 (3 padded), then 16
    assert rep.tokens == 16 + 13 + 16 and len(rep.total) == 3


def test_quantile_training_runs_each_layers_ratio_where_the_threshold_gate_runs_none():
    # a collapsed router: every score far below 0, so the hard gate s > 0 closes
    model, _ = ftp_model(steps=0)
    layers = routed_layers(model)
    with torch.no_grad():
        layers[0].router.shared_mlp.fc2.bias.fill_(-50.0)
    modes = [(m.routing_mode, m.causal_threshold) for m in layers]
    batches = calib_batches(1, rows=4, length=16)
    kept, reps = {}, {}
    for routing in ("threshold", "quantile"):
        with RoutingRecorder().attached(layers) as rec:
            reps[routing] = train_router(
                model, batches, FTPTrainConfig(steps=1, lr=1e-9, routing=routing)
            )
        # per routed layer, tokens that ran it in the student pass (the teacher's
        # pass runs every layer in full and records no counts)
        kept[routing] = [
            sum(
                int(r.kept.sum())
                for r in rec.records[m.layer_index]
                if r.kept is not None
            )
            for m in layers
        ]
    ratios = [m.retention_ratio for m in layers]  # 0.7, 0.5, 1.0, 0.6
    for i, r in enumerate(ratios):
        if r < 1.0:
            assert kept["threshold"][i] == 4  # only each row's first token
            assert abs(kept["quantile"][i] / 64 - r) <= 1 / 16  # the layer's ratio
    # the sparsity loss reads the hard gate either way: kept 0 against the ratios
    # 0.7, 0.5 and 0.6 (the 1.0 layer is left out): (0.49 + 0.25 + 0.36) / 3
    for rep in reps.values():
        assert rep.sparsity[0] == pytest.approx((0.49 + 0.25 + 0.36) / 3, abs=1e-6)
    assert [(m.routing_mode, m.causal_threshold) for m in layers] == modes
    with pytest.raises(ValueError, match="threshold"):
        FTPTrainConfig(routing="topk")


@pytest.mark.parametrize("arch", FTP_ARCHS)
@pytest.mark.parametrize("batch", [1, 2])
def test_ftp_incremental_decoding_equals_full_forward(arch, batch):
    model, mod = ftp_model(arch)
    ids, mask = left_padded(batch, length=12)
    skipped = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        if x.shape[1] == 1:  # a decoding step
            skipped.append(int((output == x).all(-1).sum()))

    handles = [m.register_forward_hook(hook, with_kwargs=True)
               for m in routed_layers(model)]  # fmt: skip
    assert_cache_equals_full(model, ids, mask)
    for h in handles:
        h.remove()
    assert sum(skipped) > 0  # decoding steps really skipped layers
    assert mod.threshold_report is not None


def test_ftp_chunked_continuation_and_generate_agree():
    model, _ = ftp_model("llama")
    ids, mask = left_padded(batch=2, length=13)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask,
                     position_ids=positions(mask), use_cache=False).logits  # fmt: skip
        inc, _ = incremental_logits(model, ids, mask, prefill=4, chunk=3)
        prompt = dict(input_ids=ids[:, :8], attention_mask=mask[:, :8])
        a = model.generate(**prompt, max_new_tokens=6, do_sample=False)
        b = model.generate(**prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
    assert torch.equal(a, b)


def test_ftp_decoding_skips_tokens_below_threshold():
    """Causal FTP routing really skips: some routed layer leaves some token
    untouched, and the kept fractions track the schedule."""
    model, mod = ftp_model("llama")
    report = mod.threshold_report
    for kept, target in zip(report.kept_fraction, report.target_ratios):
        assert abs(kept - target) < 0.1
    seen = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append((module.retention_ratio, (output != x).any(-1).float().mean()))

    handles = [m.register_forward_hook(hook, with_kwargs=True)
               for m in routed_layers(model)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=calib_batches(1, seed=5)[0]["input_ids"], use_cache=False)
    for h in handles:
        h.remove()
    assert any(r < 1.0 and frac < 1.0 for r, frac in seen)
    # AdaDSF's FLOPs model reads FTP routing through the same recorder
    flops = normalized_flops(model, {"input_ids": torch.randint(4, 128, (2, 16))})
    assert 0.0 < flops.normalized < 1.0
    # each routed layer's router is counted at FTP's own cost (32 real tokens)
    routers = {m.layer_index: m.router.flops(32) for m in routed_layers(model)}
    counted = {i: x.router for i, x in enumerate(flops.routed_per_layer) if x.router}
    assert counted == {i: c for i, c in routers.items() if i in counted}
    assert counted and set(counted) <= set(routers)


@pytest.mark.parametrize(
    "arch,match",
    [
        ("gpt_neox", "input_layernorm and self_attn.q_proj"),
        ("phi3", "input_layernorm and self_attn.q_proj"),  # fused qkv_proj
        ("olmo2", "input_layernorm and self_attn.q_proj"),  # post-norm
        ("qwen3", "normalises its keys"),
        ("gemma3_text", "normalises its keys"),
    ],
)
def test_unsupported_architecture_is_refused_before_work(arch, match):
    model = tiny_model(arch, num_layers=2)
    with pytest.raises(ValueError, match=match):
        FTPModifier(schedule="uniform").apply_to(model, calib_batches(1))
    assert not routed_layers(model)


def assert_cache_equals_full(model, ids, mask) -> None:
    """Prefill + one-token decoding with the KV cache gives the full forward's logits
    on every real token, and the cache ends holding every position."""
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask,
                     position_ids=positions(mask), use_cache=False).logits  # fmt: skip
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]


def assert_reload_is_exact(model, again, ids, mask) -> torch.Tensor:
    """A reloaded model's logits equal the original's bit for bit, without and with a
    padding mask; returns the masked ones."""
    with torch.no_grad():
        for kw in (dict(), dict(attention_mask=mask)):
            a = model(input_ids=ids, use_cache=False, **kw).logits
            b = again(input_ids=ids, use_cache=False, **kw).logits
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    return b


def test_save_and_load_ftp_gives_the_same_logits(tmp_path):
    from adadsf_modifier.checkpoint import FTP_SIDECAR_NAME as FTP_SIDECAR
    from adadsf_modifier.ftp import load_ftp

    model, _ = ftp_model("llama")
    model.save_pretrained(tmp_path)
    assert (tmp_path / FTP_SIDECAR).is_file()
    again = load_ftp(tmp_path, dtype=torch.float32)
    assert [m.causal_threshold for m in routed_layers(again)] == [
        m.causal_threshold for m in routed_layers(model)
    ]
    ids, mask = left_padded(batch=2, length=12)
    assert_reload_is_exact(model, again, ids, mask)
    with torch.no_grad():
        inc, _ = incremental_logits(again, ids, mask, prefill=4)
        full = model(input_ids=ids, attention_mask=mask,
                     position_ids=positions(mask), use_cache=False).logits  # fmt: skip
    torch.testing.assert_close(inc[mask.bool()], full[mask.bool()], atol=1e-4, rtol=0)
