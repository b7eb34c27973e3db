"""Top-k routing breaks score ties the same way whatever padding surrounds a prompt."""

from functools import lru_cache

import pytest
import torch
from test_routing import positions, route_all
from tiny_models import ARCHITECTURES, tiny_model

from adadsf_modifier.routing.selection import select_topk, tokens_to_keep_per_row

# A prompt that repeats one token: at a routed layer 0 every occurrence that skips it
# enters layer 1 with the same hidden state, hence the same router score (a tie).
PROMPT = torch.tensor([[5, 7, 7, 7, 7, 9, 7, 7, 11, 7, 7, 7]])


@lru_cache(maxsize=None)
def routed(arch):
    return route_all(tiny_model(arch), [0.5, 0.5, 0.5, 0.5])


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("pad", [1, 2, 3, 5, 7])
def test_prompt_alone_equals_prompt_in_left_padded_batch_despite_tied_scores(arch, pad):
    model = routed(arch)
    n = PROMPT.shape[1]
    other = torch.randint(
        4, 128, (1, n + pad), generator=torch.Generator().manual_seed(pad)
    )
    ids = torch.cat(
        [torch.cat([torch.zeros(1, pad, dtype=torch.long), PROMPT], 1), other]
    )
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    with torch.no_grad():
        alone = model(input_ids=PROMPT).logits[0]
        batched = model(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask)
        ).logits[0, pad:]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad", [0, 1, 3, 6])
def test_tied_scores_keep_the_earliest_real_tokens(pad):
    """Scores 1, 1, 1, 1, 0 (four tied tokens), keep 2: the first two tied tokens win,
    counted from the first real token, with any amount of left padding."""
    real_scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    scores = torch.cat([torch.full((pad,), 5.0), real_scores]).unsqueeze(0)
    real = torch.cat(
        [torch.zeros(pad, dtype=torch.bool), torch.ones(5, dtype=torch.bool)]
    )
    real = real.unsqueeze(0)
    keep = tokens_to_keep_per_row(real, 0.4)
    index, valid = select_topk(scores, real, keep, int(keep.max()))
    assert (index[valid] - pad).tolist() == [0, 1]
