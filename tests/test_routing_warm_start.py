"""The router warm start works with any sample size, down to one token."""

import math

import pytest
import torch
from llmcompressor import oneshot
from tiny_models import save_tiny_model, token_dataset
from transformers import AutoModelForCausalLM

from adadsf_modifier import AdaDSFModifier
from adadsf_modifier.fitting.warm_start import (
    MIN_HELDOUT_SAMPLE,
    importance_target,
    warm_start_router,
)
from adadsf_modifier.routing import TokenRouter


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 8, 40])
def test_warm_start_fits_any_sample_size(tokens):
    torch.manual_seed(0)
    router = TokenRouter(16, 4)
    before = {k: v.clone() for k, v in router.state_dict().items()}
    x = torch.randn(tokens, 16)
    cos = torch.rand(tokens) * 0.5 + 0.4
    result = warm_start_router(
        router, x, importance_target(cos), layer_index=1, steps=5
    )
    assert result.tokens == tokens
    assert math.isfinite(result.loss_last)
    assert all(torch.isfinite(v).all() for v in router.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in router.state_dict().items())
    # a held-out quarter is only reported once the sample is big enough to spare it
    assert math.isnan(result.heldout_rank_corr) == (tokens < MIN_HELDOUT_SAMPLE)


def test_warm_start_trains_the_router_as_adam_on_its_forward_would():
    """The fit normalises the fixed inputs once; the router it leaves is, to the bit,
    that of full-batch Adam on the router's own forward over the fit tokens."""
    torch.manual_seed(0)
    x = (torch.randn(64, 16) * 3).bfloat16()
    target = torch.randn(64)
    router = TokenRouter(16, 4).bfloat16()
    reference = TokenRouter(16, 4)
    reference.load_state_dict({k: v.float() for k, v in router.state_dict().items()})
    warm_start_router(router, x, target, layer_index=2, steps=7, seed=3)

    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3 + 2))
    fit = perm[max(2, 64 // 4) :]
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(7):
        loss = torch.nn.functional.mse_loss(reference(x.float()[fit]), target[fit])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for k, v in reference.state_dict().items():
        assert torch.equal(router.state_dict()[k], v.bfloat16()), k


def test_warm_start_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="importance targets"):
        warm_start_router(TokenRouter(16, 4), torch.randn(5, 16), torch.rand(4), 0)


@pytest.mark.parametrize("tokens", [1, 7])
def test_modifier_with_few_router_init_tokens_routes_and_warm_starts(tokens, tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"))
    modifier = AdaDSFModifier(retention=0.7, router_init_tokens=tokens)
    model = oneshot(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        recipe=[modifier],
        dataset=token_dataset(8, 16),
        num_calibration_samples=8,
        max_seq_length=16,
    )
    results = modifier.warm_start_report
    assert results and all(r.tokens == tokens for r in results)
    with torch.no_grad():
        model(input_ids=torch.randint(4, 128, (1, 8)))
