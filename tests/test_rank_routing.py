"""Rank routing: each token runs a layer iff it is in the top ``r`` of its row so far.

Against a brute-force reference, across cached decoding (plain and kv-keeping layers,
left padding, batches), on text whose router scores moved away from the calibration
set, and in the FLOPs count.
"""

import math
from fractions import Fraction

import pytest
import torch
from test_causal_routing import incremental_logits, left_padded
from test_kept_attention_kv import keep_kv
from test_routing import positions, route_all
from tiny_models import tiny_model

from adadsf_modifier.fitting import calibrate_thresholds
from adadsf_modifier.flops import normalized_flops
from adadsf_modifier.routing import (
    get_routing_modes,
    rank,
    routed_layers,
    set_routing_mode,
)
from adadsf_modifier.routing.rank import (
    RANK_SLACK,
    choose_by_rank,
    clamped_counts,
    rank_quota,
    rank_tie_ranks,
    rank_tie_tolerance,
)

RATIOS = [0.8, 0.5, 1.0, 0.6]


def rank_model(arch="llama", kv=False, ratios=RATIOS, seed=0):
    model = route_all(tiny_model(arch, len(ratios), seed=seed), ratios)
    if kv:
        keep_kv(model, skip_rank=None)  # a full-rank random (ridge-shaped) skip path
    model.eval()
    set_routing_mode(model, "rank")
    model.generation_config.pad_token_id = 0
    return model


# -- the rule against a brute-force reference ------------------------------------------


def reference_quota(ratio, keep_first, length):
    """In exact arithmetic: the integer bringing E_p nearest r * p, the lower of two;
    the forced first token is no rival."""
    ratio, expected = Fraction(ratio), Fraction(0)
    quota = [0]
    for p in range(1, length + 1):
        if p == 1 and keep_first:
            quota.append(1)
            expected = Fraction(1)
            continue
        n = p - 1 if keep_first else p
        errs = [abs(expected + Fraction(c, n) - ratio * p) for c in range(n + 1)]
        c = errs.index(min(errs))
        expected += Fraction(c, n)
        quota.append(c)
    return quota


def reference_tie_rank(k):
    """Of ``k`` tied earlier rivals, how many count as ahead: ``floor(u_k (k + 1))``,
    ``u_k = frac(k * 0.618...)`` in 32-bit fixed point (``2^32`` / golden ratio)."""
    return (k * 0x9E3779B9 % 2**32) * (k + 1) >> 32


def reference_band(ratio, keep_first, p):
    """The fewest and the most of a row's first ``p`` real tokens that may have run:
    ``r p`` (the decimal ratio, exactly) within the slack, rounded inwards, within
    ``0 .. p``; the forced first token always runs."""
    centre = Fraction(str(ratio)) * p
    low = max(0, math.ceil(centre - RANK_SLACK))
    high = min(p, math.floor(centre + RANK_SLACK))
    if keep_first and p >= 1:
        low, high = max(low, 1), max(high, 1)
    return low, high


def reference_rank(scores, real, ratio, keep_first, banded=True):
    """A Python loop over each row's tokens: rivals above the new token's tie band
    count one each, the ``k`` within it ``reference_tie_rank(k)`` together; a token
    runs iff it ranks in, unless that takes the row's count out of
    ``reference_band``."""
    tol = rank_tie_tolerance(scores.dtype)
    batch, seq = scores.shape
    quota = reference_quota(ratio, keep_first, seq)
    out = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        earlier, p, kept = [], 0, 0
        for t in range(seq):
            if not real[b, t]:
                continue
            s = float(scores[b, t])
            width = tol * max(1.0, abs(s))
            p += 1
            ahead = sum(1 for e in earlier if e >= s + width)
            tied = sum(1 for e in earlier if s - width <= e < s + width)
            ranks_in = ahead + reference_tie_rank(tied) < quota[p]
            low, high = reference_band(ratio, keep_first, p)
            if banded:
                ranks_in = min(high, max(low, kept + ranks_in)) > kept
            out[b, t] = ranks_in
            kept += int(out[b, t])
            if p > 1 or not keep_first:  # the forced first token is no rival
                earlier.append(s)
    return out


def random_rows(seed, batch=3, seq=40):
    g = torch.Generator().manual_seed(seed)
    # few distinct values: many exact ties; plus near-ties inside the tolerance
    scores = torch.randint(-4, 5, (batch, seq), generator=g).float() * 0.5
    scores += (torch.rand(batch, seq, generator=g) < 0.2) * 1e-6
    real = torch.ones(batch, seq, dtype=torch.bool)
    real[1, :7] = False  # left padding
    real[0, 1:4] = False  # padding right after the first real token
    real[2, -5:] = False  # right padding
    real[2, 10:12] = False  # padding inside a row (a packed batch)
    return scores, real


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.71, 0.9])
@pytest.mark.parametrize("keep_first", [True, False])
def test_rule_equals_a_brute_force_reference(ratio, keep_first):
    for seed in range(3):
        scores, real = random_rows(seed)
        got, state = choose_by_rank(scores, real, ratio, keep_first)
        assert torch.equal(got, reference_rank(scores, real, ratio, keep_first))
        assert torch.equal(state.count, real.sum(1))
        assert torch.equal(state.kept, got.sum(1))


def test_quota_table_tracks_the_ratio_and_pays_back_the_first_token():
    for ratio in (0.13, 0.5, 0.77, 0.95):
        for keep_first in (True, False):
            table = rank_quota(ratio, keep_first, 300, torch.device("cpu")).tolist()
            assert table[:301] == reference_quota(ratio, keep_first, 300)
            rivals = [p - 1 if keep_first else p for p in range(1, 301)]
            rivals[0] = 1
            expected = sum(c / n for n, c in zip(rivals, table[1:301]))
            assert abs(expected - ratio * 300) < 0.5
    half = rank_quota(0.5, True, 8, torch.device("cpu")).tolist()
    assert half[1] == 1 and half[2] == 0  # the forced sink is paid back at once


@pytest.mark.parametrize("keep_first", [True, False])
def test_decoding_token_by_token_and_chunked_prefill_decide_the_same(
    monkeypatch, keep_first
):
    """The past carried as stored scores gives the decisions of the whole row, and a
    prefill chunked over queries gives those of one comparison."""
    monkeypatch.setattr(rank, "RANK_CHUNK_ELEMENTS", 50)
    scores, real = random_rows(5, seq=30)
    whole = reference_rank(scores, real, 0.6, keep_first)
    chunked, _ = choose_by_rank(scores, real, 0.6, keep_first)
    assert torch.equal(chunked, whole)
    got, past = choose_by_rank(scores[:, :9], real[:, :9], 0.6, keep_first)
    parts = [got]
    for t in range(9, 30):
        got, past = choose_by_rank(
            scores[:, t : t + 1], real[:, t : t + 1], 0.6, keep_first, past
        )
        parts.append(got)
    assert torch.equal(torch.cat(parts, 1), whole)
    assert past.scores.shape == (3, 30) and bool(past.scores[~real].isnan().all())
    assert torch.equal(past.kept, whole.sum(1))
    assert torch.equal(past.count, real.sum(1))


@pytest.mark.parametrize("keep_first", [True, False])
@pytest.mark.parametrize("ratio", [0.3, 0.81])
def test_one_row_s_decoding_steps_decided_on_the_host_equal_the_rule(keep_first, ratio):
    """A decoding step of one row on the CPU takes the host path (its integers in
    Python, two comparisons over the past): token by token it decides as the
    brute-force reference and as the tensor path on the same rows, padding, ties and
    near-ties included, and leaves the same state."""
    scores, real = random_rows(11, seq=60)
    whole = reference_rank(scores, real, ratio, keep_first)
    for row in range(scores.shape[0]):
        s, r = scores[row : row + 1], real[row : row + 1]
        got, past = choose_by_rank(s[:, :1], r[:, :1], ratio, keep_first)
        parts = [got]
        for t in range(1, s.shape[1]):
            assert rank._host_step(s[:, t : t + 1])
            got, past = choose_by_rank(
                s[:, t : t + 1], r[:, t : t + 1], ratio, keep_first, past
            )
            parts.append(got)
        assert torch.equal(torch.cat(parts, 1)[0], whole[row])
        _, tensor_path = choose_by_rank(s, r, ratio, keep_first)
        assert torch.equal(past.count, tensor_path.count)
        assert torch.equal(past.kept, tensor_path.kept)
        assert torch.equal(past.scores.isnan(), tensor_path.scores.isnan())
        finite = tensor_path.scores.isfinite()
        assert torch.equal(past.scores[finite], tensor_path.scores[finite])


def test_a_score_exactly_at_a_band_edge_counts_alike_in_prefill_and_on_the_host():
    """The tie band's edges are float32 arithmetic on both paths: an earlier score
    equal to a later token's float32 floor edge (which lies below the exact one here)
    is tied with it in a prefill and in a host decoding step alike."""
    later = torch.tensor(3.3046653270721436)
    floor = later + later.abs().clamp(min=1.0) * -rank_tie_tolerance(torch.float32)
    assert float(floor) < float(later) * (1 - rank_tie_tolerance(torch.float32))
    scores = torch.tensor([[9.0, 5.0, float(floor), float(later)]])
    real = torch.ones_like(scores, dtype=torch.bool)
    # at 0.7 the fourth token may have fewer than 2 rivals ahead: 5.0 is one, and its
    # tied twin counts as a second (ranks[1] = 1), so it skips; untied it would run
    prefill, _ = choose_by_rank(scores, real, 0.7, True)
    _, past = choose_by_rank(scores[:, :3], real[:, :3], 0.7, True)
    step, _ = choose_by_rank(scores[:, 3:], real[:, 3:], 0.7, True, past)
    assert not bool(prefill[0, 3]) and not bool(step[0, 0])


def test_ties_within_the_tolerance_are_split_by_how_many_twins_came_before():
    """A score within the tolerance of an earlier one ties it (matmul noise), one
    beyond it does not; a token with ``k`` tied earlier rivals counts
    ``floor(u_k (k + 1))`` of them as ahead, so ties go neither always to the earlier
    token nor always to the later one."""
    cpu = torch.device("cpu")
    tol = rank_tie_tolerance(torch.float32)
    real = torch.ones(1, 4, dtype=torch.bool)
    quota = rank_quota(0.8, True, 4, cpu)
    assert quota[3] == 1 and quota[4] == 2
    # u_1 = 0.618: its 1 twin is ahead; u_2 = 0.236: neither of its 2 twins is
    assert rank_tie_ranks(4, cpu)[:3].tolist() == [0, 1, 0]
    exact = torch.tensor([[9.0, 1.0, 1.0, 1.0]])
    noisy = torch.tensor([[9.0, 1.0, 1.0 + 0.25 * tol, 1.0 - 0.25 * tol]])
    for scores in (exact, noisy):
        got = choose_by_rank(scores, real, 0.8, True)[0]
        # the third token's one twin is ahead (1 >= quota 1): it skips; the fourth's
        # two are not (0 < quota 2): it runs, which ties to the earlier token denied
        assert got[0].tolist() == [True, True, False, True]
    # beyond the tolerance the scores alone decide: 1 + 4 tol beats the 1 before it,
    # 1 - 4 tol has both ahead
    apart = torch.tensor([[9.0, 1.0, 1.0 + 4 * tol, 1.0 - 4 * tol]])
    assert choose_by_rank(apart, real, 0.8, True)[0][0].tolist() == [
        True, True, True, False
    ]  # fmt: skip
    # the forced first token is no rival: a third token below it still runs
    below_first = torch.tensor([[9.0, 1.0, 2.0]])
    assert bool(choose_by_rank(below_first, real[:, :3], 0.8, True)[0][0, 2])


def test_untied_scores_decide_by_their_rank_alone_as_before():
    """Scores 0.01 apart, none within the tolerance of another: a token runs iff
    fewer than ``quota[p]`` earlier rivals score above it (as before ties were split)
    and its row's count stays in its band."""
    g = torch.Generator().manual_seed(7)
    perms = [torch.randperm(200, generator=g) for _ in range(3)]
    scores = torch.stack(perms).float() * 0.01 - 1.0
    real = torch.ones_like(scores, dtype=torch.bool)
    real[1, :9] = False
    real[2, 50:53] = False
    for ratio in (0.2, 0.5, 0.81):
        for keep_first in (True, False):
            quota = reference_quota(ratio, keep_first, 200)
            expected = torch.zeros_like(real)
            for b in range(3):
                rivals, p, kept = [], 0, 0
                for t in range(200):
                    if real[b, t]:
                        s, p = float(scores[b, t]), p + 1
                        ranks_in = sum(e > s for e in rivals) < quota[p]
                        low, high = reference_band(ratio, keep_first, p)
                        expected[b, t] = min(high, max(low, kept + ranks_in)) > kept
                        kept += int(expected[b, t])
                        if p > 1 or not keep_first:  # the forced first is no rival
                            rivals.append(s)
            got = choose_by_rank(scores, real, ratio, keep_first)[0]
            assert torch.equal(got, expected), (ratio, keep_first)


@pytest.mark.parametrize("trend", [0.05, -0.05])
def test_the_band_holds_the_ratio_where_scores_drift_along_the_row(trend):
    """Scores that rise along the row (later tokens have more context and outrank
    the early ones) carry the rank alone past the ratio, most in a continuation after
    a short prompt; falling ones below it. In its band no prefix of any row strays
    from ``r p`` by more than the slack, and a 32-token continuation, decoded one
    token at a time, keeps the ratio within 0.02."""
    g = torch.Generator().manual_seed(3)
    rows, prompt, steps, ratio = 64, 64, 32, 0.81
    length = prompt + steps
    scores = torch.randn(rows, length, generator=g) + trend * torch.arange(length)
    real = torch.ones_like(scores, dtype=torch.bool)
    alone = reference_rank(scores, real, ratio, True, banded=False)
    assert abs(float(alone[:, prompt:].float().mean()) - ratio) > 0.1
    got, state = choose_by_rank(scores[:, :prompt], real[:, :prompt], ratio, True)
    parts = [got]
    for t in range(prompt, length):  # decoding, one token at a time
        got, state = choose_by_rank(
            scores[:, t : t + 1], real[:, t : t + 1], ratio, True, state
        )
        parts.append(got)
    kept = torch.cat(parts, 1)
    assert torch.equal(kept, reference_rank(scores, real, ratio, True))
    band = torch.tensor([reference_band(ratio, True, p) for p in range(1, length + 1)])
    count = kept.long().cumsum(1)
    assert bool(((band[:, 0] <= count) & (count <= band[:, 1])).all())
    assert abs(float(kept[:, prompt:].float().mean()) - ratio) <= 0.02


@pytest.mark.parametrize("past_len", [0, 37, 130])
def test_counts_of_earlier_rivals_equal_comparing_every_pair(monkeypatch, past_len):
    """The blocked count (binary search in whole earlier blocks, pairs in the own
    block) gives every pair's comparison's integers: ties, NaN padding, the ``-inf``
    first token, rows longer than a block and not a multiple of it, a cached past, and
    queries taken a chunk at a time."""
    g = torch.Generator().manual_seed(past_len)
    batch, width = 3, 300
    keys = torch.randint(-6, 7, (batch, width), generator=g).float() * 0.25
    keys[0, :20] = float("nan")  # left padding
    keys[1, 150:160] = float("nan")  # padding inside the row
    keys[0, 20] = keys[1, 0] = keys[2, 0] = float("-inf")  # forced first tokens
    band = torch.tensor([-1e-3, 1e-3])
    edges = keys.unsqueeze(-1) + keys.abs().clamp(min=1.0).unsqueeze(-1) * band
    pos = torch.arange(width)
    pairs = (keys[:, None, :, None] >= edges[:, :, None, :]) & (
        pos[None, :] < pos[:, None]
    )[None, :, :, None]
    expected = pairs.sum(2).masked_fill(edges.isnan() | (edges == -math.inf), 0)
    for chunk in (1 << 24, 700):
        monkeypatch.setattr(rank, "RANK_CHUNK_ELEMENTS", chunk)
        got = rank._count_earlier(keys, edges[:, past_len:], past_len)
        assert torch.equal(got, expected[:, past_len:]), chunk


def test_clamped_counts_equal_a_loop_over_the_tokens():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch, q_len = 3, int(torch.randint(1, 70, (1,), generator=g))
        steps = torch.randint(0, 2, (batch, q_len), generator=g)
        low = torch.randint(0, 3, (batch, q_len), generator=g).cumsum(1)
        high = low + torch.randint(0, 4, (batch, q_len), generator=g)
        start = torch.randint(0, 5, (batch,), generator=g)
        expected = torch.zeros_like(steps)
        for b in range(batch):
            c = int(start[b])
            for q in range(q_len):
                c = min(int(high[b, q]), max(int(low[b, q]), c + int(steps[b, q])))
                expected[b, q] = c
        assert torch.equal(clamped_counts(steps, low, high, start), expected)


RUN_RATIOS = [0.1, 0.2, 0.33, 0.5, 0.71, 0.81, 0.9, 0.95]


@pytest.mark.parametrize("keep_first", [True, False])
def test_a_run_of_identical_scores_keeps_the_ratio(keep_first):
    """400 identical scores (a repeated token, a degenerate stream) keep within 0.02
    of the ratio; ties to the earlier token kept at most 0.025 of them at any of these
    ratios. Left padding moves no decision."""
    run = torch.ones(1, 400)
    real = torch.ones_like(run, dtype=torch.bool)
    padded = torch.cat([torch.zeros(1, 7), run], 1)
    padded_real = torch.cat([torch.zeros(1, 7, dtype=torch.bool), real], 1)
    for ratio in RUN_RATIOS:
        got = choose_by_rank(run, real, ratio, keep_first)[0]
        assert abs(float(got.float().mean()) - ratio) <= 0.02, ratio
        moved = choose_by_rank(padded, padded_real, ratio, keep_first)[0]
        assert torch.equal(moved[:, 7:], got) and not bool(moved[:, :7].any())


@pytest.mark.parametrize("level", [1.0, 0.0, -1.0])
@pytest.mark.parametrize("share", [0.3, 0.5])
def test_a_repeated_score_among_varied_ones_keeps_the_ratio(level, share):
    """Rows of 400 scores, ``share`` of them one repeated score (above, at or below
    the others' median), the rest varied: over 8 rows the kept share is within 0.03 of
    the ratio, each row within 0.08 (a row's own sampling noise). Ties to the earlier
    token kept 0.08-0.41 too few on 8 of these 18 cases."""
    g = torch.Generator().manual_seed(int(10 * share + level))
    scores = torch.randn(8, 400, generator=g)
    scores[torch.rand(8, 400, generator=g) < share] = level
    real = torch.ones_like(scores, dtype=torch.bool)
    for ratio in (0.2, 0.5, 0.81):
        kept = choose_by_rank(scores, real, ratio, True)[0].float().mean(1)
        assert abs(float(kept.mean()) - ratio) <= 0.03, (ratio, kept)
        assert float((kept - ratio).abs().max()) <= 0.08, (ratio, kept)


# -- cached decoding equals one full forward -------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv", [False, True])
def test_cached_decoding_equals_full_forward(arch, kv):
    model = rank_model(arch, kv)
    assert set(get_routing_modes(model)) == {"rank"}
    ids, mask = left_padded(2, 16)
    ids[0, 9] = ids[0, 2]  # repeated tokens: equal scores at the first layer
    ids[1, 12] = ids[1, 5]
    with torch.no_grad():
        full = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=False,
        ).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
        chunked, _ = incremental_logits(model, ids, mask, prefill=5, chunk=3)
        # a prefill of padding only: row 1's first real token arrives in decoding
        late, _ = incremental_logits(model, ids, mask, prefill=3)
    real = mask.bool()
    for got in (inc, chunked, late):
        torch.testing.assert_close(got[real], full[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]
    for layer in routed_layers(model):
        if layer.retention_ratio < 1.0:
            store = cache.layers[layer.layer_index]
            assert store.rank_state.scores.shape == (2, 16)
            assert torch.equal(store.rank_state.count, real.sum(1))
            if not kv:  # some tokens skipped: the routed cache holds fewer tokens
                held = int(store.slot_valid(2, ids.device).sum())
                assert 0 < held < int(real.sum())


@pytest.mark.parametrize("kv", [False, True])
def test_one_row_s_cached_decoding_equals_full_forward(kv):
    """Batch 1: the decoding steps take the host path."""
    model = rank_model("llama", kv, ratios=[0.8, 0.4, 1.0, 0.6])
    ids, mask = left_padded(1, 24)
    ids[0, 15] = ids[0, 4]  # a repeated token
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        inc, cache = incremental_logits(model, ids, mask, prefill=3)
    torch.testing.assert_close(inc, full, atol=1e-4, rtol=0)
    for layer in routed_layers(model):
        if 0 < layer.retention_ratio < 1:
            assert int(cache.layers[layer.layer_index].rank_state.count[0]) == 24


def test_decoding_a_repeated_token_keeps_the_ratio_where_scores_tie():
    """Two rows each repeating one token (the second left-padded): every occurrence
    enters the first routed layer with the same hidden state, so its scores all tie,
    and the second layer sees two tied groups (the tokens that ran the first and those
    that skipped it). Token-by-token decoding keeps within 0.05 of each ratio there,
    decides as the full forward does (same kept counts, same logits); ties to the
    earlier token kept 0.011 and 0.021 there."""
    ratios = [0.5, 0.8, 1.0, 0.6]
    model = rank_model("llama", ratios=ratios)
    ids = torch.full((2, 96), 17)
    ids[1] = 42
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    real = mask.bool()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=True)  # fmt: skip
        inc, cache = incremental_logits(model, ids, mask, prefill=4)
    torch.testing.assert_close(inc[real], out.logits[real], atol=1e-4, rtol=0)
    for i in (0, 1):
        whole = out.past_key_values.layers[i].slot_valid(2, ids.device).sum(1)
        decoded = cache.layers[i].slot_valid(2, ids.device).sum(1)
        assert torch.equal(decoded, whole)
        kept = float(decoded.sum()) / int(real.sum())
        assert abs(kept - ratios[i]) <= 0.05, (i, kept)


def test_decoding_after_a_crop_decides_as_without_it():
    """A cache cropped back (assisted decoding does it) forgets the cropped positions'
    scores and recounts how many of the rest ran, so decoding on from it gives the
    full forward's logits, and the state equals that of a cache never cropped."""
    model = rank_model("llama", kv=True, ratios=[0.8, 0.3, 1.0, 0.4])
    ids, mask = left_padded(2, 20)
    mask[0, 1:4] = 0  # padding right after a row's first real token
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        _, cache = incremental_logits(model, ids, mask, prefill=6)
        fresh = {i: cache.layers[i].rank_state for i in (0, 1, 3)}
        cache.crop(-8)  # the last 8 of 20 positions
        assert cache.layers[1].rank_state.kept is None
        out = model(input_ids=ids[:, 12:], attention_mask=mask,
                    position_ids=positions(mask)[:, 12:], past_key_values=cache,
                    use_cache=True)  # fmt: skip
    real = mask.bool()
    torch.testing.assert_close(out.logits[real[:, 12:]], full[:, 12:][real[:, 12:]],
                               atol=1e-4, rtol=0)  # fmt: skip
    for i, before in fresh.items():
        after = cache.layers[i].rank_state
        assert torch.equal(after.count, before.count)
        assert torch.equal(after.kept, before.kept)
        assert torch.equal(after.scores.isnan(), before.scores.isnan())


def test_a_cache_cropped_to_nothing_starts_over():
    model = rank_model("llama", kv=True)
    ids, mask = left_padded(2, 12)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits  # fmt: skip
        _, cache = incremental_logits(model, ids[:, :5], mask[:, :5], prefill=3)
        cache.crop(-5)  # every position
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    past_key_values=cache, use_cache=True)  # fmt: skip
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], full[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv", [False, True])
def test_greedy_generate_with_and_without_cache_agree(kv):
    model = rank_model("llama", kv)
    ids, mask = left_padded(2, 8)
    kw = dict(max_new_tokens=10, do_sample=False, attention_mask=mask)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        uncached = model.generate(ids, use_cache=False, **kw)
        beams = model.generate(ids, num_beams=2, num_return_sequences=2, **kw)
    assert torch.equal(cached, uncached)
    assert beams.shape == (4, 18)


def test_a_cache_filled_in_another_mode_is_refused():
    model = route_all(tiny_model("llama", 4), RATIOS)
    g = torch.Generator().manual_seed(0)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (4, 16), generator=g)}]
    )
    model.eval()
    ids, _ = left_padded(1, 8)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        set_routing_mode(model, "rank")
        with pytest.raises(RuntimeError, match="start a\\s+new cache"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


# -- the ratio holds on shifted text ---------------------------------------------------


def shift_routers(model, by):
    with torch.no_grad():
        for layer in routed_layers(model):
            layer.router.fc2.bias += by


def kept_per_layer(model, ids, prefill=None):
    """Per routed layer at ``0 < r < 1``: kept / real tokens, over a prefill of the
    whole rows (``prefill`` None) or over every decoding step after ``prefill``
    tokens (teacher-forced, one step per token), counted by the FLOPs recorder."""
    layers = [m.layer_index for m in routed_layers(model) if 0 < m.retention_ratio < 1]
    kept = dict.fromkeys(layers, 0)
    tokens = 0
    with torch.no_grad():
        if prefill is None:
            rep = normalized_flops(model, {"input_ids": ids})
            tokens = ids.numel()
            for i in layers:
                kept[i] += sum(rep.kept[i])
        else:
            cache = model(input_ids=ids[:, :prefill], use_cache=True).past_key_values
            for t in range(prefill, ids.shape[1]):
                rep = normalized_flops(
                    model,
                    {"input_ids": ids[:, t : t + 1], "past_key_values": cache,
                     "use_cache": True},
                )  # fmt: skip
                tokens += ids.shape[0]
                for i in layers:
                    kept[i] += sum(rep.kept[i])
    return {i: kept[i] / tokens for i in layers}


@pytest.mark.parametrize("shift", [3.0, -3.0])
def test_rank_routing_keeps_its_ratio_where_causal_thresholds_drift(shift):
    ratios = [0.7, 0.5, 0.8, 0.6]
    model = route_all(tiny_model("llama", 4, seed=1), ratios)
    g = torch.Generator().manual_seed(0)
    calibrate_thresholds(
        model, [{"input_ids": torch.randint(4, 128, (8, 64), generator=g)}]
    )
    model.eval()
    shift_routers(model, shift)  # every score moves: text unlike the calibration set
    ids = torch.randint(4, 128, (6, 96), generator=g)
    target = dict(enumerate(ratios))
    causal_pre = kept_per_layer(model, ids)
    causal_dec = kept_per_layer(model, ids, prefill=32)
    for kept in (causal_pre, causal_dec):
        drift = sum(abs(kept[i] - target[i]) for i in kept) / len(kept)
        assert drift > 0.25, kept
    set_routing_mode(model, "rank")
    for kept in (kept_per_layer(model, ids), kept_per_layer(model, ids, prefill=32)):
        # a few hundred tokens a layer: each within sampling noise, their mean closer
        for i, frac in kept.items():
            assert abs(frac - target[i]) < 0.08, (i, frac, kept)
        mean = sum(kept[i] - target[i] for i in kept) / len(kept)
        assert abs(mean) < 0.03, kept


# -- the FLOPs count sees what ran -----------------------------------------------------


def test_flops_kept_counts_equal_the_tokens_that_changed():
    """Identity skip path: a token ran a layer iff its hidden state changed there."""
    model = rank_model("llama")
    ids, mask = left_padded(2, 24)
    changed: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        changed[module.layer_index] = (out != x).any(-1).sum(1)

    handles = [
        m.register_forward_hook(hook, with_kwargs=True) for m in routed_layers(model)
    ]
    try:
        with torch.no_grad():
            batch = {"input_ids": ids, "attention_mask": mask}
            rep = normalized_flops(model, batch)
            for layer in routed_layers(model):
                if layer.retention_ratio < 1.0:
                    i = layer.layer_index
                    assert list(rep.kept[i]) == changed[i].tolist()
                    assert 0 < sum(rep.kept[i]) < int(mask.sum())
            cache = model(
                input_ids=ids[:, :12], attention_mask=mask[:, :12], use_cache=True
            ).past_key_values
            for t in range(12, 24):
                step = {
                    "input_ids": ids[:, t : t + 1],
                    "attention_mask": mask[:, : t + 1],
                    "past_key_values": cache,
                    "use_cache": True,
                }
                rep = normalized_flops(model, step)
                for layer in routed_layers(model):
                    if layer.retention_ratio < 1.0:
                        i = layer.layer_index
                        assert list(rep.kept[i]) == changed[i].tolist()
    finally:
        for h in handles:
            h.remove()
    assert math.isfinite(rep.normalized)


# -- the mode persists -----------------------------------------------------------------


def test_rank_mode_persists_through_a_checkpoint(tmp_path):
    """The sidecar stores each layer's mode (its schema takes the routing package's
    modes), so a checkpoint saved in rank mode reloads in rank mode, same logits, and
    keeps its KV cache for generate()."""
    from test_checkpoint_save_load import inputs, routed_model

    import adadsf_modifier

    settings = [None, (0.5, None, "rank"), (0.6, None, "rank"), (0.4, None, "rank")]
    model = routed_model("llama", settings)
    ids, mask = inputs()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(str(tmp_path / "ckpt"))
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "ckpt")
    assert get_routing_modes(reloaded) == ["rank"] * 3
    assert reloaded.generation_config.use_cache is not False
    with torch.no_grad():
        got = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_eval_and_bench_measure_a_rank_checkpoint_in_rank_mode(tmp_path):
    """``adadsf eval`` and ``adadsf bench`` keep the modes a checkpoint was saved in
    unless ``--routing-mode`` says otherwise, and their records name the mode."""
    import json

    from test_checkpoint_save_load import routed_model
    from tiny_models import tiny_tokenizer

    from adadsf_modifier.cli import main

    settings = [None, (0.5, None, "rank"), (0.6, None, "rank"), (0.4, None, "rank")]
    path = tmp_path / "ckpt"
    routed_model("llama", settings).save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    runs = {
        "eval": ["eval", "--model", path, "--no-ppl", "--ppl-tokens", 64],
        "eval-topk": ["eval", "--model", path, "--no-ppl", "--ppl-tokens", 64,
                      "--routing-mode", "topk"],
        "bench": ["bench", "--routed", path, "--seq-lens", 16, "--batch-sizes", 1,
                  "--repeats", 1, "--decode-tokens", 2],
    }  # fmt: skip
    modes = {}
    for name, argv in runs.items():
        out = tmp_path / f"{name}.json"
        assert main([str(a) for a in [*argv, "--output", out]]) == 0
        modes[name] = json.loads(out.read_text())["routing_mode"]
    assert modes == {"eval": "rank", "eval-topk": "topk", "bench": "rank"}


def test_a_recipe_asking_for_rank_routing_saves_a_rank_checkpoint(tmp_path):
    """``routing_mode: rank`` in the recipe (trained under it too): ``oneshot``'s model
    routes by rank in eval mode, still has causal thresholds to switch to, and its
    checkpoint reloads in rank mode with the same logits."""
    from test_recipes import compress_tiny

    import adadsf_modifier

    model = compress_tiny(
        tmp_path, "adadsf.yaml", 3, skip_path_rank=8, routing_mode="rank",
        align_routing="rank",
    )  # fmt: skip
    layers = routed_layers(model)
    assert get_routing_modes(model) == ["rank"] * len(layers)
    assert all(m.causal_threshold is not None for m in layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    model.save_pretrained(str(tmp_path / "ckpt"))
    reloaded = adadsf_modifier.from_pretrained(tmp_path / "ckpt")
    assert get_routing_modes(reloaded) == ["rank"] * len(layers)
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    with pytest.raises(ValueError, match="routing_mode"):
        adadsf_modifier.AdaDSFModifier(routing_mode="topk")


@pytest.mark.parametrize("kind", ["causal", "rank", "ftp"])
def test_generate_on_an_empty_prompt_is_refused_in_one_line(kind, tmp_path):
    """Rank routing indexed the row's last score, FTP the last logits, a dense layer
    fails to reshape: a routed model (reloaded, or as FTPModifier leaves it) refuses
    an input of 0 tokens by name."""
    from test_checkpoint_save_load import routed_model
    from test_ftp_routing import ftp_model

    import adadsf_modifier
    from adadsf_modifier.constraints import InputError
    from adadsf_modifier.routing import set_routing_mode

    if kind == "ftp":
        model = ftp_model("llama")[0]
    else:
        routed_model("llama").save_pretrained(tmp_path / "m")
        model = adadsf_modifier.from_pretrained(tmp_path / "m")
        if kind == "rank":
            set_routing_mode(model, "rank")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(InputError, match="0 tokens"):
        model.eval().generate(input_ids=empty, max_new_tokens=2, do_sample=False)
    with pytest.raises(InputError, match="0 tokens"):
        model(empty)
