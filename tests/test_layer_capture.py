"""The shared calibration harness: :func:`capture_layers` sees what a plain forward
computes and always takes its hooks off; :func:`routing_override` always gives the
routed layers their own routing back."""

import pytest
import torch
from test_routing import positions, route_all
from tiny_models import tiny_model

from adadsf_modifier.fitting.calibration import SimilarityAccumulator
from adadsf_modifier.fitting.layer_capture import LayerCall, StopForward, capture_layers
from adadsf_modifier.routing import routed_layers, routing_override
from adadsf_modifier.routing.architectures import decoder_layers


def layers_of(model):
    return [m for _, m in decoder_layers(model)[1]]


def left_padded():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=positions(mask))


def hooks(modules):
    """Every forward (pre-)hook on ``modules`` (transformers adds its own on the
    first ``output_hidden_states`` forward, and keeps it)."""
    return [(list(m._forward_hooks), list(m._forward_pre_hooks)) for m in modules]


def keep_in(calls: dict[int, LayerCall]):
    return lambda call: calls.__setitem__(call.index, call)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_captured_inputs_and_outputs_are_those_of_a_plain_forward(arch):
    model = tiny_model(arch, 3)
    layers = layers_of(model)
    batch = left_padded()
    ins: dict[int, LayerCall] = {}
    outs: dict[int, LayerCall] = {}
    with torch.no_grad():
        plain = model(**batch, output_hidden_states=True).hidden_states
        registered = hooks(layers)
        with (
            capture_layers(layers, keep_in(ins), at="input"),
            capture_layers(layers, keep_in(outs)),
        ):
            model(**batch)
    assert hooks(layers) == registered
    for i in range(len(layers)):
        assert ins[i].module is layers[i] and ins[i].output is None
        torch.testing.assert_close(ins[i].hidden_states, plain[i], rtol=0, atol=0)
        torch.testing.assert_close(outs[i].hidden_states, plain[i], rtol=0, atol=0)
        assert torch.equal(ins[i].real_tokens(), batch["attention_mask"].bool())
        if i + 1 < len(layers):  # the last one's output goes through the final norm
            torch.testing.assert_close(outs[i].output_states, plain[i + 1])
    with pytest.raises(ValueError, match="no output"):
        ins[0].output_states


def test_stop_after_last_runs_no_layer_above_it():
    model = tiny_model("llama", 4)
    layers = layers_of(model)
    upper = []
    with (
        capture_layers(layers[2:], lambda c: upper.append(c.index), at="input"),
        capture_layers(layers[:2], lambda c: None, stop_after_last=True),
    ):
        with pytest.raises(StopForward), torch.no_grad():
            model(**left_padded())
    assert upper == [] and hooks(layers) == [([], [])] * 4


@pytest.mark.parametrize("at", ["input", "output"])
def test_hooks_are_removed_when_a_callback_or_the_block_raises(at):
    model = tiny_model("llama", 2)
    layers = layers_of(model)
    empty = hooks(layers)

    def fail(call):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        with capture_layers(layers, fail, at=at), torch.no_grad():
            model(**left_padded())
    assert hooks(layers) == empty
    with pytest.raises(KeyError):
        with capture_layers(layers, lambda c: None, at=at):
            raise KeyError("block failed")
    assert hooks(layers) == empty
    with pytest.raises(ValueError, match="at must be"):
        with capture_layers(layers, lambda c: None, at="middle"):
            pass
    assert hooks(layers) == empty


def test_capturing_equals_hooks_registered_by_hand():
    model = tiny_model("llama", 3)
    layers = layers_of(model)
    empty = hooks(layers)
    by_hand = SimilarityAccumulator(3, sample_tokens=8)
    handles = [  # plain torch hooks feeding the accumulator the same calls
        layer.register_forward_hook(
            lambda m, a, k, o, i=i: by_hand._record(LayerCall(i, m, a, k, o)),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        model(**left_padded())
    for h in handles:
        h.remove()
    scoped = SimilarityAccumulator(3, sample_tokens=8)
    with scoped.capturing(layers), torch.no_grad():
        model(**left_padded())
    assert hooks(layers) == empty
    assert scoped.sums == by_hand.sums and scoped.counts == by_hand.counts
    for i in range(3):
        for a, b in zip(scoped.sampled(i), by_hand.sampled(i)):
            assert torch.equal(a, b)


def test_routing_override_sets_and_restores_also_on_error():
    model = route_all(tiny_model("llama", 3), [0.5, 0.7, 1.0])
    layers = routed_layers(model)
    layers[0].causal_threshold = 0.1
    with routing_override(model, retention_ratio=1.0, mode="topk") as changed:
        assert changed == layers
        assert [m.retention_ratio for m in layers] == [1.0, 1.0, 1.0]
        assert {m.routing_mode for m in layers} == {"topk"}
    assert [m.retention_ratio for m in layers] == [0.5, 0.7, 1.0]
    assert {m.routing_mode for m in layers} == {"auto"}
    with pytest.raises(RuntimeError, match="inside"):
        with routing_override(layers[1], retention_ratio=0.0):
            assert layers[1].retention_ratio == 0.0
            raise RuntimeError("inside")
    assert layers[1].retention_ratio == 0.7
    # causal routing needs a threshold on layer 1 (0 < r < 1): refused, nothing kept
    with pytest.raises(ValueError, match="thresholds"):
        with routing_override(model, mode="causal"):
            pass
    assert {m.routing_mode for m in layers} == {"auto"}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        with routing_override(model, retention_ratio=1.5):
            pass
    assert [m.retention_ratio for m in layers] == [0.5, 0.7, 1.0]


def test_routing_override_of_a_layer_list_leaves_dense_layers_alone():
    model = tiny_model("llama", 3)
    layers = layers_of(model)
    route_all(model, 0.5)
    with pytest.raises(ValueError, match="no routed layers"):
        with routing_override(tiny_model("llama", 2), retention_ratio=1.0):
            pass
    with routing_override([layers[0], torch.nn.Linear(2, 2)], mode="topk") as got:
        assert got == [layers[0]] and layers[0].routing_mode == "topk"
    assert layers[0].routing_mode == "auto"
