"""``torch.compile`` on a routed model: the logits of the eager model, and the routing
compiled once for all layers, not once per layer (which runs past dynamo's recompile
limit, 8 by default, and leaves every later layer eager: the speed a user compiled for
is silently lost)."""

import torch
import torch._dynamo
from test_kept_attention_kv import causal_kv_model

# more routed layers than dynamo's default recompile limit, each at its own ratio
RATIOS = [0.7, 0.5, 0.8, 0.6, 0.9, 0.55, 0.65, 0.75, 0.85, 0.45, 0.6, 0.8]


def test_compiled_routed_model_equals_eager_within_the_default_recompile_limit():
    model = causal_kv_model(skip_rank=4, ratios=RATIOS)  # the shipped variant's paths
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 128, (1, n), generator=g) for n in (24, 40)]
    with torch.inference_mode():
        eager = [model(input_ids=ids, use_cache=False).logits for ids in prompts]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager", dynamic=True)
        with (
            torch._dynamo.config.patch(
                recompile_limit=8, fail_on_recompile_limit_hit=True
            ),
            torch.inference_mode(),
        ):
            out = [compiled(input_ids=ids, use_cache=False).logits for ids in prompts]
    finally:
        torch._dynamo.reset()
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
