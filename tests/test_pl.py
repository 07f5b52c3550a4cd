"""Plackett-Luce likelihoods against brute-force enumeration of orders (DESIGN.md 5.2)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moplex_core.pl import (
    PAD,
    UNRANKED,
    encode_tiers,
    encode_tiers_batch,
    pairwise_log_likelihood,
    plackett_luce_log_likelihood,
    prepare_rankings,
    score_gradient_at_zero,
)


def brute_force_order_prob(scores: list[float], order: list[int]) -> float:
    """Textbook PL probability of a full strict order (paper eq. 2), one factor per position."""
    p = 1.0
    remaining = list(order)
    for j in order:
        p *= math.exp(scores[j]) / sum(math.exp(scores[l]) for l in remaining)
        remaining.remove(j)
    return p


def strict(order):
    return [[j] for j in order]


scores_strategy = st.lists(st.floats(-4, 4, allow_nan=False), min_size=2, max_size=6)


@settings(max_examples=60, deadline=None)
@given(scores_strategy)
def test_probabilities_of_all_orders_sum_to_one(scores):
    m = len(scores)
    orders = list(itertools.permutations(range(m)))
    tiers = encode_tiers_batch([strict(o) for o in orders], [m] * len(orders))
    s = torch.tensor(scores, dtype=torch.float64).expand(len(orders), m)
    logp = plackett_luce_log_likelihood(s, tiers)
    assert torch.logsumexp(logp, 0).item() == pytest.approx(0.0, abs=1e-12)
    for order, lp in zip(orders[:10], logp[:10]):
        assert lp.exp().item() == pytest.approx(brute_force_order_prob(scores, list(order)), rel=1e-10)


@settings(max_examples=60, deadline=None)
@given(scores_strategy, st.data())
def test_top_l_partial_ranking_equals_brute_force_marginal(scores, data):
    m = len(scores)
    order = data.draw(st.permutations(range(m)))
    l = data.draw(st.integers(1, m))
    # marginal over every completion of the first l positions
    marginal = sum(
        brute_force_order_prob(scores, list(o))
        for o in itertools.permutations(range(m))
        if list(o[:l]) == list(order[:l])
    )
    tiers = torch.tensor([encode_tiers(strict(order), m)])
    logp = plackett_luce_log_likelihood(torch.tensor([scores], dtype=torch.float64), tiers, l)
    assert logp.exp().item() == pytest.approx(marginal, rel=1e-10)


@settings(max_examples=60, deadline=None)
@given(scores_strategy, st.integers(1, 3), st.data())
def test_augmented_bottom_set_equals_brute_force_marginal(scores, n_generated, data):
    """Paper eq. 5: originals ordered on top, generated items anywhere below them."""
    m = len(scores)
    gen_scores = data.draw(st.lists(st.floats(-4, 4), min_size=n_generated, max_size=n_generated))
    all_scores = scores + gen_scores
    order = data.draw(st.permutations(range(m)))
    marginal = sum(
        brute_force_order_prob(all_scores, list(order) + list(g))
        for g in itertools.permutations(range(m, m + n_generated))
    )
    tiers = torch.tensor([encode_tiers(strict(order), m + n_generated)])
    assert tiers[0, m:].eq(UNRANKED).all()
    logp = plackett_luce_log_likelihood(torch.tensor([all_scores], dtype=torch.float64), tiers)
    assert logp.exp().item() == pytest.approx(marginal, rel=1e-10)
    # Eq. 5 written out, with singleton tiers
    z_gen = sum(math.exp(s) for s in gen_scores)
    eq5 = 1.0
    for t in range(m):
        eq5 *= math.exp(all_scores[order[t]]) / (
            sum(math.exp(all_scores[order[l]]) for l in range(t, m)) + z_gen
        )
    assert logp.exp().item() == pytest.approx(eq5, rel=1e-10)


@settings(max_examples=60, deadline=None)
@given(scores_strategy, st.data())
def test_top_l_with_a_generated_bottom_set_equals_brute_force_marginal(scores, data):
    """A top-l ranking of the originals with generated items: the first l positions observed, the
    other originals and every generated item in any order below them."""
    m = len(scores)
    n_generated = data.draw(st.integers(0, 6 - m))
    all_scores = scores + data.draw(st.lists(st.floats(-4, 4), min_size=n_generated, max_size=n_generated))
    order, l = data.draw(st.permutations(range(m))), data.draw(st.integers(1, m))
    below = [j for j in range(m + n_generated) if j not in order[:l]]
    marginal = sum(brute_force_order_prob(all_scores, list(order[:l]) + list(o)) for o in itertools.permutations(below))
    tiers = torch.tensor([encode_tiers(strict(order), m + n_generated)])
    logp = plackett_luce_log_likelihood(torch.tensor([all_scores], dtype=torch.float64), tiers, l)
    assert logp.exp().item() == pytest.approx(marginal, rel=1e-10)


def test_breslow_ties_match_the_design_formula():
    r = [0.3, -1.2, 2.0, 0.7, -0.1]
    ranking = [[2], [0, 3], [1, 4]]
    gen = [0.5]
    s = r + gen
    lse = lambda idx: math.log(sum(math.exp(s[i]) for i in idx))  # noqa: E731
    expected = (
        r[2] - lse([0, 1, 2, 3, 4, 5])
        + (r[0] + r[3]) - 2 * lse([0, 1, 3, 4, 5])
        + (r[1] + r[4]) - 2 * lse([1, 4, 5])
    )
    tiers = torch.tensor([encode_tiers(ranking, 6)])
    got = plackett_luce_log_likelihood(torch.tensor([s], dtype=torch.float64), tiers).item()
    assert got == pytest.approx(expected, rel=1e-12)
    # a top-l prefix of tiers: the first l tiers' factors, the rest of the slate in every denominator
    terms = [r[2] - lse([0, 1, 2, 3, 4, 5]), (r[0] + r[3]) - 2 * lse([0, 1, 3, 4, 5])]
    for l in (1, 2):
        got = plackett_luce_log_likelihood(torch.tensor([s], dtype=torch.float64), tiers, l).item()
        assert got == pytest.approx(sum(terms[:l]), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=5), st.data())
def test_a_last_tier_of_every_item_left_equals_the_brute_force_marginal_over_its_orders(scores, data):
    """Without generated items the last tier holds every item left: all its orders follow, so it adds
    log 1 = 0, the exact marginal (Breslow's bracket would be below 0 and differ between clusters).
    A ranking of one tier, all tied, has probability 1 under every cluster."""
    m = len(scores)
    order = data.draw(st.permutations(range(m)))
    cut = data.draw(st.integers(0, m - 2))  # the strict tiers before the tied last one (at least 2 items)
    ranking = [[j] for j in order[:cut]] + [list(order[cut:])]
    marginal = sum(brute_force_order_prob(scores, list(order[:cut]) + list(tail))
                   for tail in itertools.permutations(order[cut:]))
    got = plackett_luce_log_likelihood(torch.tensor([[*scores, 9.0]], dtype=torch.float64),  # a PAD slot last
                                       torch.tensor([encode_tiers(ranking, m, m + 1)])).item()
    assert got == pytest.approx(math.log(marginal), rel=1e-9, abs=1e-12)
    if cut == 0:
        assert got == 0.0


def test_a_tied_last_tier_keeps_breslow_where_generated_items_lie_below_it():
    s = [0.3, -1.2, 2.0]  # item 2 generated: unranked, below the tie
    tiers = torch.tensor([encode_tiers([[0, 1]], 3)])
    got = plackett_luce_log_likelihood(torch.tensor([s], dtype=torch.float64), tiers).item()
    assert got == pytest.approx(s[0] + s[1] - 2 * math.log(sum(math.exp(v) for v in s)), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.floats(-30, 30), st.floats(-30, 30))
def test_bradley_terry_is_pl_with_two_items_and_the_sigmoid(rw, rl):
    s = torch.tensor([[rw, rl]], dtype=torch.float64)
    tiers = torch.tensor([[0, 1]])
    pl = plackett_luce_log_likelihood(s, tiers).item()
    bt = pairwise_log_likelihood(s, prepare_rankings(tiers)).item()
    assert pl == pytest.approx(bt, abs=1e-12)
    assert math.exp(bt) == pytest.approx(1 / (1 + math.exp(-(rw - rl))), rel=1e-9)


def test_ragged_slates_through_padding_match_unpadded():
    rankings = [strict([1, 0]), strict([2, 0, 3, 1]), [[0], [1, 2]]]
    sizes = [2, 4, 3]
    torch.manual_seed(0)
    scores = torch.randn(3, 4, dtype=torch.float64)
    padded = encode_tiers_batch(rankings, sizes)
    assert padded.shape == (3, 4) and padded[0, 2:].eq(PAD).all()
    scores_with_garbage = scores.clone()
    scores_with_garbage[padded == PAD] = float("nan")
    batched = plackett_luce_log_likelihood(scores_with_garbage, padded)
    for i, (r, m) in enumerate(zip(rankings, sizes)):
        single = plackett_luce_log_likelihood(scores[i : i + 1, :m], torch.tensor([encode_tiers(r, m)]))
        assert batched[i].item() == pytest.approx(single.item(), rel=1e-12)


def test_batch_dimensions_broadcast_over_clusters():
    tiers = encode_tiers_batch([strict([0, 1, 2]), strict([2, 1, 0])], [3, 3])
    scores = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # [n, k, M]
    index = prepare_rankings(tiers).expand(5)
    from moplex_core.pl import log_likelihood

    got = log_likelihood(scores, index)
    assert got.shape == (2, 5)
    for c in range(5):
        assert torch.allclose(got[:, c], plackett_luce_log_likelihood(scores[:, c], tiers))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "values, tiers, expected",
    [
        ([1e4, -1e4, 0.0, 3.0], [1, 0, UNRANKED, PAD], -2e4),
        ([1e4, 0.0, -1e4, 5.0], [0, 1, 2, 3], -10005.0 - 5.0 - math.log1p(math.exp(-5.0))),
        ([0.0, 1.0, -150.0], [0, 1, UNRANKED], -math.log1p(math.e)),
    ],
)
def test_extreme_scores_give_finite_values_and_gradients(dtype, values, tiers, expected):
    scores = torch.tensor([values], dtype=dtype, requires_grad=True)
    logp = plackett_luce_log_likelihood(scores, torch.tensor([tiers]))
    logp.sum().backward()
    assert torch.isfinite(logp).all() and torch.isfinite(scores.grad).all()
    assert logp.item() == pytest.approx(expected, rel=1e-5 if dtype == torch.float32 else 1e-9)


def test_float32_matches_the_float64_reference():
    torch.manual_seed(0)
    scores = torch.randn(500, 6, dtype=torch.float64) * 5
    tiers = torch.stack([torch.randperm(6) for _ in range(500)])
    tiers[::3, 4:] = UNRANKED
    tiers[1::3, 5] = PAD
    ref = plackett_luce_log_likelihood(scores, tiers)
    got = plackett_luce_log_likelihood(scores.float(), tiers)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4)


def test_fisher_score_at_zero_points_at_the_winner():
    tiers = torch.tensor([encode_tiers(strict([2, 0, 1]), 3)])
    g = score_gradient_at_zero(prepare_rankings(tiers))
    # d/dr_j at r=0: 1[j observed] - sum over observed positions t with j in the risk set of 1/|risk set|
    assert torch.allclose(g, torch.tensor([[1 - 1 / 3 - 1 / 2, 1 - 1 / 3 - 1 / 2 - 1, 1 - 1 / 3]], dtype=torch.float64))
    assert g.sum().item() == pytest.approx(0.0, abs=1e-12)
    # under Bradley-Terry pairs (the pairwise baselines' k-means start) each pair gives its winner +1/2
    # and its loser -1/2: response 2 wins both its pairs, 0 one of two, 1 none
    pairs = score_gradient_at_zero(prepare_rankings(tiers), "bt_pairs")
    assert torch.allclose(pairs, torch.tensor([[0.0, -1.0, 1.0]], dtype=torch.float64))


def test_rows_far_apart_use_the_exact_path_and_agree_with_their_neighbours():
    """One row needs the logcumsumexp fallback (scores 1500 nats apart), the other does not; the
    batch result equals each row alone and the textbook value."""
    scores = torch.tensor([[0.0, -1500.0, 3.0], [0.2, -0.1, 1.0]], dtype=torch.float64)
    tiers = encode_tiers_batch([strict([0, 1, 2]), strict([2, 0, 1])], [3, 3])
    batch = plackett_luce_log_likelihood(scores, tiers)
    for i in range(2):
        alone = plackett_luce_log_likelihood(scores[i : i + 1], tiers[i : i + 1])
        assert batch[i].item() == pytest.approx(alone.item(), rel=1e-12)
    # row 0: P = e^0/(e^0 + e^-1500 + e^3) * e^-1500/(e^-1500 + e^3)
    expected = -math.log(1 + math.exp(-1500) + math.exp(3)) + (-1500 - 3 - math.log1p(math.exp(-1503)))
    assert batch[0].item() == pytest.approx(expected, rel=1e-12)


def test_pairwise_likelihood_sums_bradley_terry_over_ordered_pairs():
    """Tiers [[2], [0, 3], [1]] plus a generated item 4: pairs 2>0, 2>3, 2>1, 0>1, 3>1 and every
    observed item above the generated one; the tie (0, 3) is not a pair."""
    from moplex_core.pl import pairwise_log_likelihood

    r = [0.3, -1.2, 2.0, 0.7, -0.5, 9.9]  # slot 5 is padding
    tiers = torch.tensor([encode_tiers([[2], [0, 3], [1]], 5, 6)])
    pairs = [(2, 0), (2, 3), (2, 1), (0, 1), (3, 1), (2, 4), (0, 4), (3, 4), (1, 4)]
    expected = sum(math.log(1 / (1 + math.exp(-(r[i] - r[j])))) for i, j in pairs)
    got = pairwise_log_likelihood(torch.tensor([r], dtype=torch.float64), prepare_rankings(tiers))
    assert got.item() == pytest.approx(expected, rel=1e-12)
    # top-2 tiers observed: item 1 joins the generated one below them, and is no pair's winner
    top = [(2, 0), (2, 3), (2, 1), (2, 4), (0, 1), (0, 4), (3, 1), (3, 4)]
    expected = sum(math.log(1 / (1 + math.exp(-(r[i] - r[j])))) for i, j in top)
    got = pairwise_log_likelihood(torch.tensor([r], dtype=torch.float64), prepare_rankings(tiers, torch.tensor([2])))
    assert got.item() == pytest.approx(expected, rel=1e-12)
    two = torch.tensor([[0.4, -0.3]], dtype=torch.float64)
    index = prepare_rankings(torch.tensor([[1, 0]]))
    assert pairwise_log_likelihood(two, index).item() == pytest.approx(
        plackett_luce_log_likelihood(two, torch.tensor([[1, 0]])).item(), rel=1e-12
    )


def naive_log_likelihood(scores: torch.Tensor, order: list[int], generated: list[int]) -> torch.Tensor:
    """Eq. 5 term by term in float64 with autograd: sum_t r_o(t) - logsumexp(r_o(t..m), r_G)."""
    terms = [scores[order[t]] - torch.logsumexp(scores[order[t:] + generated], 0) for t in range(len(order))]
    return torch.stack(terms).sum()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_gradient_matches_the_term_by_term_formula_also_on_the_underflow_fallback(data):
    # scores up to 2000 apart send rows to the logcumsumexp fallback; the gradient must still be eq. 5's
    m, g = data.draw(st.integers(2, 4)), data.draw(st.integers(0, 3))
    scale = data.draw(st.sampled_from([1.0, 50.0, 2000.0]))
    raw = data.draw(st.lists(st.floats(-1, 1), min_size=m + g, max_size=m + g))
    order = data.draw(st.permutations(range(m)))
    scores = (scale * torch.tensor(raw, dtype=torch.float64)).requires_grad_(True)  # [m + g]
    tiers = torch.tensor([encode_tiers(strict(order), m + g)])
    ours = plackett_luce_log_likelihood(scores[None], tiers)[0]
    (grad,) = torch.autograd.grad(ours, scores)
    reference_scores = scores.detach().clone().requires_grad_(True)
    reference = naive_log_likelihood(reference_scores, list(order), list(range(m, m + g)))
    (reference_grad,) = torch.autograd.grad(reference, reference_scores)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-12, abs=1e-9)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(grad).all()


def test_encode_tiers_refuses_an_index_outside_the_slate_or_in_two_tiers():
    """Before: -1 wrote the last slot (Python's index from the end) and a repeated index kept its last
    tier, both silently; 5 of 3 items failed as 'list assignment index out of range'."""
    from moplex_core.pl import encode_tiers, encode_tiers_batch

    assert encode_tiers([[2], [0, 1]], 3, 4) == [1, 1, 0, PAD]
    for ranking, message in (([[0], [-1]], r"index -1 in tier 1 is outside 0..2 \(the slate has 3 items\)"),
                             ([[0], [5]], r"index 5 in tier 1 is outside 0..2"),
                             ([[0], [0, 1]], r"index 0 appears twice \(tiers 0 and 1\)")):
        with pytest.raises(ValueError, match=message):
            encode_tiers(ranking, 3)
        with pytest.raises(ValueError, match=message):
            encode_tiers_batch([[[1], [0]], ranking], [2, 3])
