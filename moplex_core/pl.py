"""Plackett-Luce and Bradley-Terry log-likelihoods of batches of rankings given scores.

A ranking over a slate of M items (the m originals, then the m' - m generated ones, then padding) is
encoded as one integer *tier* per item:

    tier >= 0          the item's position among the ordered tiers T_1 > T_2 > ... (0 = best);
    tier == UNRANKED   the item is in the unordered bottom set (generated responses, paper eq. 5);
    tier == PAD        the slot is padding (ragged m).

Items whose tier is >= ``ranked_prefix`` are treated as UNRANKED (top-l partial rankings).

The log-likelihood (DESIGN.md 5.2; paper eqs. 2 and 5, Breslow's treatment of ties):

    log P = sum_t [ sum_{j in T_t} r_j - |T_t| * logsumexp({r_l : l in T_t ... T_L} U {r_g : g in G}) ]

computed for every observed item j as  r_j - logsumexp{r_l : tier_l >= tier_j}, which summed over the
items of one tier gives the bracket above; with G empty the last tier's bracket is 0 (it holds every
item left, in any order: the exact marginal, where Breslow's bracket is below 0 for a tie). So a tied
last tier and the unranked bottom set G are one thing: the items whose order the ranking leaves open.
Cost O(M log M) per ranking (a sort, once per dataset, and a cumulative sum), vectorised over any
number of leading batch dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD = -1
UNRANKED = 1 << 20


def encode_tiers(
    ranking: Sequence[Sequence[int]], n_items: int, n_slots: int | None = None
) -> list[int]:
    """Tier code of each slot for one ranking given as ordered tiers of item indices.

    ``ranking`` lists tiers best first, each a collection of indices in [0, n_items). Items of the
    slate that appear in no tier are UNRANKED (the augmented bottom set); slots from ``n_items`` to
    ``n_slots`` are PAD. An index outside [0, n_items) or in two tiers is refused (a negative one
    indexed from the end before, and a repeated one kept its last tier, silently); the rankings
    schema's other rules live in ``moplex_core.schema``.
    """
    n_slots = n_items if n_slots is None else n_slots
    tiers = [UNRANKED] * n_items + [PAD] * (n_slots - n_items)
    for t, tier in enumerate(ranking):
        for j in tier:
            if not 0 <= j < n_items:
                raise ValueError(f"index {j} in tier {t} is outside 0..{n_items - 1} (the slate has {n_items} items)")
            if tiers[j] != UNRANKED:
                raise ValueError(f"index {j} appears twice (tiers {tiers[j]} and {t})")
            tiers[j] = t
    return tiers


def encode_tiers_batch(
    rankings: Sequence[Sequence[Sequence[int]]], n_items: Sequence[int], n_slots: int | None = None
) -> torch.Tensor:
    """Stack ``encode_tiers`` over a batch: returns int64 [B, n_slots] (n_slots = max n_items)."""
    n_slots = max(n_items) if n_slots is None else n_slots
    return torch.tensor(
        [encode_tiers(r, m, n_slots) for r, m in zip(rankings, n_items, strict=True)],
        dtype=torch.int64,
    )


@dataclass(frozen=True)
class RankingIndex:
    """What the likelihood needs from the tiers alone, computed once per dataset (tiers never change
    while scores do, so EM reuses it every evaluation). All tensors [..., M], in *worst-first* sorted
    order: padding, then the unranked bottom set, then tiers from the last to the best, so that the
    risk set of a position (everything ranked at or below it) is a prefix."""

    order: torch.Tensor  # int64: slot at each sorted position
    in_slate: torch.Tensor  # bool: sorted position holds a real item (enters denominators)
    observed: torch.Tensor  # bool: sorted position holds an item of an observed tier (numerator)
    last: torch.Tensor  # int64: last sorted position of the item's tier (ties share a denominator)

    def expand(self, *batch: int) -> RankingIndex:
        """Insert broadcast dimensions after the leading one, e.g. [n, M] -> [n, k, M] for k clusters."""

        def grow(t: torch.Tensor) -> torch.Tensor:
            shape = (t.shape[0], *batch, t.shape[-1])
            return t.reshape(t.shape[0], *([1] * len(batch)), t.shape[-1]).expand(shape).contiguous()

        return RankingIndex(grow(self.order), grow(self.in_slate), grow(self.observed), grow(self.last))


def prepare_rankings(tiers: torch.Tensor, ranked_prefix: torch.Tensor | int | None = None) -> RankingIndex:
    """Sort every slate by tier once. tiers: int64 [..., M]; ranked_prefix: broadcastable to [...]
    under numpy's rules, trailing dimensions first: with tiers [n, k, M], a prefix per ranking is [n, 1]
    (an [n] prefix would be read as one per cluster)."""
    valid = tiers != PAD
    if ranked_prefix is not None:
        prefix = torch.as_tensor(ranked_prefix, device=tiers.device).unsqueeze(-1)
        tiers = torch.where(valid & (tiers >= prefix), UNRANKED, tiers)
    observed = valid & (tiers != UNRANKED)
    sort_key = torch.where(valid, -tiers, -UNRANKED - 1)  # worst first, padding before everything
    sort_key, order = torch.sort(sort_key, dim=-1, stable=True)  # [..., M]
    flat_key = sort_key.reshape(-1, sort_key.shape[-1]).contiguous()
    last = torch.searchsorted(flat_key, flat_key, right=True).reshape(sort_key.shape) - 1
    observed = torch.gather(observed, -1, order)  # [..., M], sorted
    # The worst tier, where no unranked item lies below it, is every item left: each order of its
    # items follows, so a tie there contributes log 1 = 0 (Breslow's term would be below 0, and differ
    # between clusters, for a ranking that says nothing of their order). A single item's term is 0
    # already (r - r), and is kept as it was computed.
    first = (~valid).sum(-1, keepdim=True).clamp(max=max(tiers.shape[-1] - 1, 0))  # padding sorts first
    rest = torch.gather(observed, -1, first) & (sort_key == torch.gather(sort_key, -1, first))
    tied_rest = rest & (rest.sum(-1, keepdim=True) > 1)
    return RankingIndex(order, sort_key >= -UNRANKED, observed & ~tied_rest, last)


def log_likelihood(scores: torch.Tensor, index: RankingIndex) -> torch.Tensor:
    """Log-probability of each prepared ranking: scores float [..., M] -> float [...]."""
    sorted_scores = torch.gather(scores, -1, index.order)
    # A finite floor instead of -inf keeps the backward pass free of 0 * inf.
    floor = torch.finfo(scores.dtype).min / 4
    sorted_scores = torch.where(index.in_slate, sorted_scores, floor)
    # risk[p] = logsumexp of sorted_scores[:p + 1], everything ranked at or below position p.
    # A cumulative sum of exp(s - row max) is several times faster than logcumsumexp; rows where a
    # real item's partial sum nears underflow (scores ~80 nats apart in float32, ~700 in float64)
    # fall back to the exact logcumsumexp. Padding slots (partial sum 0) never trigger it.
    shift = sorted_scores.detach().amax(-1, keepdim=True)
    partial = torch.cumsum(torch.exp(sorted_scores - shift), dim=-1)
    finfo = torch.finfo(scores.dtype)
    underflow = ((partial < finfo.tiny / finfo.eps) & index.in_slate).any(-1, keepdim=True)
    risk = shift + torch.log(torch.where(underflow | ~index.in_slate, 1.0, partial))
    if scores.device.type != "cpu" or underflow.any():  # on a GPU, no read of it to decide (the host would wait)
        risk = torch.where(underflow, torch.logcumsumexp(sorted_scores, dim=-1), risk)
    denominator = torch.gather(risk, -1, index.last)
    return torch.where(index.observed, sorted_scores - denominator, 0.0).sum(-1)


def pairwise_log_likelihood(scores: torch.Tensor, index: RankingIndex) -> torch.Tensor:
    """Bradley-Terry over every ordered pair of a prepared ranking: scores [..., M] -> [...].

        log P_pairs = sum_{i above j} log sigmoid(r_i - r_j)

    over pairs in different tiers where i is observed (j may be in the unranked bottom set). The
    pairwise baselines (DPO, EM-DPO, MaxMin-RLHF; the `no_pl` ablation) use this in place of PL.
    Not a normalised distribution over rankings; O(M^2) per ranking.
    """
    sorted_scores = torch.gather(scores, -1, index.order)
    above = index.last.unsqueeze(-1) > index.last.unsqueeze(-2)  # [..., M(i), M(j)]: i's tier beats j's
    pairs = above & index.observed.unsqueeze(-1) & index.in_slate.unsqueeze(-2)
    diff = torch.where(pairs, sorted_scores.unsqueeze(-1) - sorted_scores.unsqueeze(-2), 0.0)
    return torch.where(pairs, torch.nn.functional.logsigmoid(diff), 0.0).sum((-1, -2))


LIKELIHOODS = {"pl": log_likelihood, "bt_pairs": pairwise_log_likelihood}
"""Observation models a `Rankings` can declare; each maps (scores [..., M], index) -> [...]."""


def plackett_luce_log_likelihood(
    scores: torch.Tensor,
    tiers: torch.Tensor,
    ranked_prefix: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Log-probability of each ranking under Plackett-Luce with the given scores.

    scores: float [..., M]; tiers: int64 broadcastable to [..., M] (codes above); ranked_prefix:
    int64 broadcastable to [...] or None (all tiers observed). Returns float [...].
    Scores at PAD slots are ignored (they may be anything finite or not).
    """
    return log_likelihood(scores, prepare_rankings(torch.broadcast_to(tiers, scores.shape), ranked_prefix))


def score_gradient_at_zero(index: RankingIndex, model: str = "pl") -> torch.Tensor:
    """d log P / d r at r = 0 for every ranking: float64 [..., M] in slot order.

    The Fisher score of a ranking under uniform utilities and the observation model ``model`` (a
    key of LIKELIHOODS): positive for items ranked high, negative for items ranked low. Projected
    on response features it gives a ranking's feature vector (used by the k-means initialisation
    of EM).
    """
    scores = torch.zeros(index.order.shape, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(LIKELIHOODS[model](scores, index).sum(), scores)
    return grad
