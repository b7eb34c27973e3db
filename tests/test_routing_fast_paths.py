"""The row-copy forms of the routing's gather/scatter (``index_select`` /
``index_copy``) against the element-wise definitions, and the router's normalisation
after ``fc1`` against ``rms_norm`` first.

These replaced ``gather``/``scatter`` with expanded indices and a leading ``rms_norm``
for speed (``lab/NOTEBOOK.md`` §4); they must compute the same thing, gradients
included."""

import pytest
import torch
import torch.nn.functional as F

from adadsf_modifier.routing.kept_attention import place_kv
from adadsf_modifier.routing.router import TokenRouter
from adadsf_modifier.routing.selection import (
    gather_tokens,
    scatter_tokens,
    select_by_mask,
)


def _selection(batch=3, seq=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(batch, seq, generator=g) < 0.5
    chosen[:, 0] = True
    chosen[1] = False  # a row with fewer tokens: unused slots hold ``seq``
    chosen[1, :2] = True
    k_max = int(chosen.sum(1).max())
    return select_by_mask(chosen, k_max)


def test_gather_tokens_reads_each_rows_positions_and_the_last_token_for_unused():
    index, valid = _selection()
    x = torch.randn(3, 10, 4, requires_grad=True)
    out = gather_tokens(x, index)
    for b in range(3):
        for k in range(index.shape[1]):
            pos = min(int(index[b, k]), 9)
            assert torch.equal(out[b, k], x[b, pos])
    out.sum().backward()
    counts = torch.zeros(3, 10)
    for b in range(3):
        for k in range(index.shape[1]):
            counts[b, min(int(index[b, k]), 9)] += 1
    assert torch.equal(x.grad, counts.unsqueeze(-1).expand(3, 10, 4))


def test_gather_tokens_broadcasts_a_batch_one_table_over_the_index_rows():
    index, _ = _selection()
    table = torch.randn(1, 10, 6)  # e.g. rotary cos/sin shared by the batch
    out = gather_tokens(table, index)
    assert out.shape == (3, index.shape[1], 6)
    for b in range(3):
        assert torch.equal(out[b], table[0, index[b].clamp(max=9)])
    ids = torch.arange(30).view(3, 10)  # 2D inputs (position ids)
    assert torch.equal(gather_tokens(ids, index), ids.gather(1, index.clamp(max=9)))


def test_scatter_tokens_writes_used_slots_only_and_passes_gradients():
    index, valid = _selection()
    x = torch.randn(3, 10, 4, requires_grad=True)
    values = torch.randn(3, index.shape[1], 4, requires_grad=True)
    out = scatter_tokens(x, index, values)
    expected = x.detach().clone()
    for b in range(3):
        for k in range(index.shape[1]):
            if valid[b, k]:
                expected[b, index[b, k]] = values[b, k].detach()
    assert torch.equal(out, expected)
    out.sum().backward()
    written = torch.zeros(3, 10, dtype=torch.bool)
    for b in range(3):
        written[b, index[b][valid[b]]] = True
    assert torch.equal(x.grad, (~written).float().unsqueeze(-1).expand(3, 10, 4))
    assert torch.equal(values.grad, valid.float().unsqueeze(-1).expand_as(values))


def test_place_kv_puts_each_slot_at_its_position_and_keeps_the_base():
    index, valid = _selection()
    seq, heads, dim = 10, 2, 3
    new = torch.randn(3, heads, index.shape[1], dim)
    placed = place_kv(None, new, index, seq)
    assert placed.shape == (3, heads, seq + 1, dim)
    expected = torch.zeros(3, heads, seq + 1, dim)
    for b in range(3):
        for k in range(index.shape[1]):
            if valid[b, k]:
                expected[b, :, index[b, k]] = new[b, :, k]
    assert torch.equal(placed[:, :, :seq], expected[:, :, :seq])
    base = torch.randn(3, heads, seq + 1, dim)
    before = base.clone()
    merged = place_kv(base, new, index, seq)
    assert torch.equal(base, before)
    keep = expected.abs().sum(-1, keepdim=True) == 0  # positions not written
    assert torch.equal(
        merged[:, :, :seq], torch.where(keep, base, expected)[:, :, :seq]
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_router_equals_rms_norm_then_mlp(dtype, tol):
    torch.manual_seed(0)
    router = TokenRouter(48, 8, eps=1e-5).to(dtype)
    # residual-stream-like inputs whose norms span five orders of magnitude
    x = torch.randn(2, 20, 48) * torch.logspace(-2, 3, 20).view(1, 20, 1)
    x = x.to(dtype)
    w = {n: p.detach().double() for n, p in router.named_parameters()}
    ref = F.linear(
        F.gelu(
            F.linear(
                F.rms_norm(x.double(), (48,), eps=1e-5), w["fc1.weight"], w["fc1.bias"]
            )
        ),
        w["fc2.weight"],
        w["fc2.bias"],
    ).squeeze(-1)
    out = router(x)
    assert out.dtype == torch.float32 and out.shape == (2, 20)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    out.sum().backward()  # every parameter is reached
    assert all(p.grad is not None for p in router.parameters())


def test_scatter_tokens_second_write_and_a_full_cover_skip_the_copy_of_x():
    chosen = torch.tensor([[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    index, _ = select_by_mask(chosen, 3)
    rest, _ = select_by_mask(~chosen, 4)
    x = torch.randn(2, 6, 5)
    a, b = torch.randn(2, 3, 5), torch.randn(2, 4, 5)
    expected = scatter_tokens(scatter_tokens(x, index, a), rest, b)
    for covers_all in (False, True):
        out = scatter_tokens(x, index, a, (rest, b), covers_all=covers_all)
        assert torch.equal(out, expected)
    # every position was written: nothing of x is left
    assert not any(
        torch.equal(expected[i, j], x[i, j]) for i in range(2) for j in range(6)
    )


def test_place_kv_in_place_writes_into_its_own_layout_only():
    index, _ = _selection()
    new = torch.randn(3, 2, index.shape[1], 4)
    base = place_kv(
        None, torch.randn(3, 2, 5, 4), torch.tensor([[1, 3, 5, 7, 9]] * 3), 10
    )
    expected = place_kv(base, new, index, 10)
    out = place_kv(base, new, index, 10, inplace=True)
    assert torch.equal(out, expected) and torch.equal(
        base, expected
    )  # written in place
    other = torch.randn(3, 2, 11, 4)  # head-major memory: not this layout, left alone
    before = other.clone()
    assert torch.equal(place_kv(other, new, index, 10, inplace=True),
                       place_kv(before, new, index, 10))  # fmt: skip
    assert torch.equal(other, before)


def test_one_row_selection_and_its_complement_equal_the_batched_path():
    """A prompt alone takes the one-row forms (``nonzero`` instead of the padded sort,
    flat positions without offsets); each row of a batch must select, alone, the tokens
    and skipped tokens the batched path gives it, gathers and flat positions too."""
    from adadsf_modifier.routing.selection import (
        choose_tokens,
        flat_positions,
        skipped_slots,
    )

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 12, generator=g)
    real = torch.ones(4, 12, dtype=torch.bool)
    real[2, :3] = False  # a left-padded row
    first = real & (real.cumsum(1) == 1)
    scores[3] = -10.0  # a row where only the forced first token runs
    index, valid, k_max = choose_tokens("causal", scores, real, first, 0.5, 0.0)
    slots = skipped_slots(real, index)
    x = torch.randn(4, 12, 5, generator=g)
    for b in range(4):
        one = choose_tokens("causal", scores[b : b + 1], real[b : b + 1],
                            first[b : b + 1], 0.5, 0.0)  # fmt: skip
        n = int(valid[b].sum())
        assert one[2] == n and torch.equal(one[0][0], index[b, :n])
        assert bool(one[1].all())
        alone = skipped_slots(real[b : b + 1], one[0])
        n_skip = int(slots[1][b].sum())
        assert alone[0].shape == (1, n_skip)
        assert torch.equal(alone[0][0], slots[0][b, :n_skip])
        assert torch.equal(flat_positions(one[0], 13), one[0][0])
        assert torch.equal(gather_tokens(x[b : b + 1], one[0])[0],
                           gather_tokens(x, index)[b, :n])  # fmt: skip
    # every token chosen: nothing skipped; nothing above an infinite threshold but the
    # forced token; no forced token and nothing above it: nothing runs
    assert skipped_slots(real[:1], torch.arange(12).view(1, -1)) is None
    assert choose_tokens("causal", scores[:1], real[:1], first[:1], 0.5, 1e9)[2] == 1
    assert choose_tokens("causal", scores[:1], real[:1], None, 0.5, 1e9) == (
        None, None, 0)  # fmt: skip


@pytest.mark.parametrize("mode", ["topk", "quantile"])
def test_one_row_topk_and_quantile_choices_equal_the_batched_path(mode):
    """Top-k and the batch's own quantile: a row alone chooses what it chooses in a
    batch of identical rows (the forced first token included)."""
    from adadsf_modifier.routing.selection import choose_tokens

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(1, 15, generator=g)
    scores[0, 0] = -5.0  # the forced first token scores lowest
    real = torch.ones(1, 15, dtype=torch.bool)
    first = real & (real.cumsum(1) == 1)
    one = choose_tokens(mode, scores, real, first, 0.4)
    many = choose_tokens(mode, scores.expand(3, -1), real.expand(3, -1),
                         first.expand(3, -1), 0.4)  # fmt: skip
    assert one[2] == many[2] and int(one[0][0, 0]) == 0
    for b in range(3):
        assert torch.equal(many[0][b], one[0][0]) and bool(many[1][b].all())


@pytest.mark.parametrize("threshold", [float("inf"), float("nan")])
def test_the_forced_first_token_runs_whatever_the_causal_threshold(threshold):
    """Outside top-k the forced token is no longer written into the scores: it must
    still run when no score clears the threshold (or the threshold is NaN)."""
    from adadsf_modifier.routing.selection import choose_tokens

    scores = torch.randn(1, 9)
    real = torch.ones(1, 9, dtype=torch.bool)
    first = real & (real.cumsum(1) == 1)
    for rows in (1, 2):  # the one-row and the batched form
        index, valid, k_max = choose_tokens(
            "causal", scores.expand(rows, -1), real.expand(rows, -1),
            first.expand(rows, -1), 0.5, threshold,
        )  # fmt: skip
        assert k_max == 1 and index.tolist() == [[0]] * rows and bool(valid.all())


def test_a_prompt_alone_equals_its_row_in_a_batch_with_skip_path_and_kv():
    """End to end through the one-row forms (skip path, skipped tokens' keys/values,
    causal routing), with and without a recorder: a prompt's logits alone equal its
    row in a batch of two prompts of the same length, and the recorder changes
    nothing."""
    from test_kept_attention_kv import causal_kv_model

    from adadsf_modifier.routing import RoutingRecorder, routed_layers

    model = causal_kv_model(skip_rank=4)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 128, (2, 14), generator=g)
    with torch.no_grad():
        batch = model(input_ids=ids, use_cache=False).logits
        alone = model(input_ids=ids[1:], use_cache=False).logits
        recorder = RoutingRecorder()
        with recorder.attached(routed_layers(model)):
            recorded = model(input_ids=ids[1:], use_cache=False).logits
    torch.testing.assert_close(alone[0], batch[1], rtol=0, atol=1e-5)
    assert torch.equal(recorded, alone)
    gathers = [r for rs in recorder.records.values() for r in rs if r.path == "gather"]
    assert gathers and all(r.skip_path is not None for r in gathers)
    assert all(int(r.kept[0] + r.skip_path[0]) == 14 for r in gathers)


def test_router_without_gradient_follows_every_change_of_its_parameters():
    """Without a gradient a bfloat16 router keeps float32 copies of its small
    parameters between calls; each way of changing them (in place, as an optimizer
    step does; a state dict; a new dtype) must still change its scores to what a
    freshly built router with those parameters gives, and they equal the scores with
    a gradient (which never keeps copies)."""
    torch.manual_seed(0)
    router = TokenRouter(48, 8).to(torch.bfloat16)
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16)

    def fresh_scores():
        twin = TokenRouter(48, 8).to(router.fc1.weight.dtype)
        twin.load_state_dict(router.state_dict())
        return twin(x).detach()

    with torch.no_grad():
        assert torch.equal(router(x), fresh_scores())
        router.fc2.weight.add_(0.5)  # in place: the version counter moves
        router.fc1.bias.mul_(-1)
        assert torch.equal(router(x), fresh_scores())
        state = {k: v.clone() for k, v in router.state_dict().items()}
        state["fc2.bias"] += 1.0
        router.load_state_dict(state)
        assert torch.equal(router(x), fresh_scores())
        before = router(x)
    assert torch.equal(router(x).detach(), before)  # with a gradient: the same
    router.to(torch.float32)
    with torch.no_grad():
        assert torch.equal(router(x), fresh_scores())
