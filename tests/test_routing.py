"""Routed decoder layers against independent references (dense model, hand-picked
top-K)."""

import copy

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_model

from adadsf_modifier.routing import (
    RoutedLayer,
    TokenRouter,
    UnsupportedArchitectureError,
    decoder_layers,
    route_layer,
    routed_layers,
)


def route_all(model, ratios, router_hidden=8, seed=0):
    spec, layers = decoder_layers(model)
    torch.manual_seed(seed)
    for i, (_, layer) in enumerate(layers):
        r = ratios[i] if isinstance(ratios, (list, tuple)) else ratios
        route_layer(
            layer,
            TokenRouter(model.config.hidden_size, router_hidden),
            r,
            i,
            spec.cache_kwarg,
            model.config,
        )
    return model


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def batch_with_padding(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (3, 9), generator=g)
    mask = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 1, 1, 1],  # left padded
            [1, 1, 1, 1, 1, 1, 1, 0, 0],  # right padded
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    return ids, mask


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_retention_one_equals_dense_exactly(arch, attn):
    dense = tiny_model(arch, attn=attn)
    routed = route_all(copy.deepcopy(dense), 1.0)
    ids, mask = batch_with_padding()
    with torch.no_grad():
        for kw in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
            a = routed(**kw).logits
            b = dense(**kw).logits
            real = kw.get("attention_mask", torch.ones_like(ids)).bool()
            torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_routed_layer_keeps_class_names_and_parameters(arch):
    model = tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(layer) for _, layer in decoder_layers(model)[1]]
    route_all(model, 0.5)
    for (name, layer), cls in zip(decoder_layers(model)[1], classes):
        assert isinstance(layer, cls) and isinstance(layer, RoutedLayer)
    after = model.state_dict()
    assert set(before) <= set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (
        {k for k in after if k not in before}
        == {k for k in after if ".router." in k}
        != set()
    )


def _record_layers(model):
    records = []

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        y = output[0] if isinstance(output, tuple) else output
        records.append((module, x.detach().clone(), y.detach().clone()))

    handles = [
        li.register_forward_hook(hook, with_kwargs=True) for li in routed_layers(model)
    ]
    return records, handles


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("ratio", [0.8, 0.5, 0.3])
def test_exactly_k_top_scored_real_tokens_change(arch, ratio):
    model = route_all(tiny_model(arch), ratio)
    ids, mask = batch_with_padding()
    records, handles = _record_layers(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    assert len(records) == model.config.num_hidden_layers
    real = mask.bool()
    for layer, x, y in records:
        changed = (x != y).any(-1)
        scores = layer.router(x)
        for b in range(ids.shape[0]):
            n = int(real[b].sum())
            k = max(1, int(ratio * n + 1e-6))
            assert int(changed[b].sum()) == k
            assert not changed[b][~real[b]].any(), "padding was selected"
            s = scores[b].masked_fill(~real[b], float("-inf"))
            s[real[b].nonzero()[0, 0]] = float(
                "inf"
            )  # the attention-sink token always runs
            expected = set(s.topk(k).indices.tolist())
            assert set(changed[b].nonzero().flatten().tolist()) == expected
            # unselected tokens are bit-identical to the layer input
            assert torch.equal(y[b][~changed[b]], x[b][~changed[b]])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_padded_batch_equals_each_sequence_alone(arch):
    model = route_all(tiny_model(arch), [1.0, 0.6, 0.4, 0.7])
    ids, mask = batch_with_padding()
    with torch.no_grad():
        batched = model(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask)
        ).logits
        for b in range(ids.shape[0]):
            keep = mask[b].bool()
            alone = model(input_ids=ids[b, keep][None]).logits[0]
            torch.testing.assert_close(batched[b, keep], alone, atol=1e-5, rtol=1e-5)


def test_padding_content_does_not_change_real_outputs():
    model = route_all(tiny_model("llama"), 0.5)
    ids, mask = batch_with_padding()
    other = ids.clone()
    other[~mask.bool()] = 5  # different padding token ids
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = model(input_ids=other, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-6, rtol=0)


def test_length_one_sequences_and_batch_with_length_one_row():
    model = route_all(tiny_model("llama"), 0.3)
    dense = tiny_model("llama")
    ids = torch.randint(4, 128, (2, 1))
    with torch.no_grad():
        # K = max(1, floor(0.3 * 1)) = 1: the only token runs every layer, like the
        # dense model
        torch.testing.assert_close(
            model(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5, rtol=0
        )
        ids2 = torch.randint(4, 128, (2, 6))
        mask2 = torch.tensor([[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]])
        out = model(
            input_ids=ids2, attention_mask=mask2, position_ids=positions(mask2)
        ).logits
        alone = dense(input_ids=ids2[:1, -1:]).logits
        torch.testing.assert_close(out[0, -1], alone[0, 0], atol=1e-5, rtol=0)


def test_router_receives_gradient_through_layer_output():
    model = route_all(tiny_model("llama"), [1.0, 0.5, 0.5, 0.8])
    ids, mask = batch_with_padding()
    out = model(input_ids=ids, attention_mask=mask).logits
    out[mask.bool()].logsumexp(-1).mean().backward()
    for layer in routed_layers(model):
        g = layer.router.fc1.weight.grad
        assert g is not None and g.abs().sum() > 0, (
            f"no router gradient at layer {layer.layer_index}"
        )


def test_topk_routing_refuses_incremental_decoding_with_cache():
    model = route_all(tiny_model("llama"), 0.5)
    ids = torch.randint(4, 128, (1, 6))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        with pytest.raises(RuntimeError, match="cannot continue from a KV cache"):
            model(
                input_ids=ids[:, :1],
                past_key_values=out.past_key_values,
                use_cache=True,
            )


def test_unsupported_architecture_names_what_is_missing():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'gpt2'"):
        decoder_layers(model)
    model = tiny_model("gemma3_text", 2)  # EmbeddingGemma: not a causal decoder
    model.config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedArchitectureError, match="attends bidirectionally"):
        decoder_layers(model)


def test_causal_padding_mask_detection():
    from adadsf_modifier.routing.kept_attention import is_causal_padding_mask

    n = 6
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    padded = (causal & real[:, None, :]).unsqueeze(1)
    assert is_causal_padding_mask(None)
    assert is_causal_padding_mask(padded)
    additive = torch.where(padded, 0.0, torch.finfo(torch.float32).min)
    assert is_causal_padding_mask(additive)
    window = padded & ~torch.ones(n, n, dtype=torch.bool).tril(-3)
    assert not is_causal_padding_mask(window)
    packed = padded.clone()
    packed[:, :, 4:, :4] = False  # two packed documents in each row
    assert not is_causal_padding_mask(packed)
    with_past = torch.ones(2, 1, n, n + 2, dtype=torch.bool)
    assert not is_causal_padding_mask(with_past)


@pytest.mark.parametrize("ratio", [0.6, 0.4])
def test_sliding_window_is_kept_among_selected_tokens(ratio):
    """SDPA (which may take the causal-kernel shortcut) must agree with eager (always an
    explicit mask read off the layer's own mask) when a sliding window narrows
    attention."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    outs = []
    for attn in ("sdpa", "eager"):
        cfg = tiny_config("mistral", attn=attn)
        cfg.sliding_window = 3
        torch.manual_seed(0)
        model = route_all(AutoModelForCausalLM.from_config(cfg).eval(), ratio)
        ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs.append(model(input_ids=ids, use_cache=False).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_routing_survives_compressed_tensors_offload_wrappers():
    """A model already dispatched by compressed-tensors (as after an earlier oneshot
    stage), or left with a bound forward by remove_dispatch, must still route and
    unroute."""
    from compressed_tensors.offload import remove_dispatch, set_onload_device

    ids, mask = batch_with_padding()
    reference = route_all(tiny_model("llama"), 0.5)
    dense = tiny_model("llama")
    model = set_onload_device(tiny_model("llama"), "cpu")
    route_all(model, 0.5)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).logits, expected
        )
        remove_dispatch(model, onload_tensors=True)
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).logits, expected
        )
        _, layers = decoder_layers(model)
        for _, layer in layers:
            from adadsf_modifier.routing import unroute_layer

            unroute_layer(layer)
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).logits,
            dense(input_ids=ids, attention_mask=mask).logits,
        )
