"""EM at the numerical edges (issue 8, item 4): extreme scores, all-tied rankings, emptied clusters,
non-finite scores. The behaviour pinned here is the one docs/reliability.md documents.
(An emptied cluster under soft EM is tests/test_em.py::test_an_emptied_cluster_warns_and_stays_finite;
extreme scores in the PL likelihood itself are tests/test_pl.py.)"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.em import EMConfig, Rankings, fit_mixture, mixture_posteriors
from moplex_core.scorers.linear import LinearScorer


class FixedScorer:
    """Scores given once, float64 [n, k, M]; the M-step changes nothing."""

    def __init__(self, scores: torch.Tensor):
        self.scores, self.k = scores, scores.shape[1]

    def score(self, inputs, iteration):
        return self.scores

    def fit(self, inputs, rankings, weights, iteration):
        pass

    def ranking_features(self, inputs, rankings):
        return torch.randn(len(rankings), 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def random_rankings(n: int, m: int, seed: int = 0) -> Rankings:
    g = torch.Generator().manual_seed(seed)
    return Rankings(torch.stack([torch.randperm(m, generator=g) for _ in range(n)]))


def test_scores_of_plus_minus_1e4_give_finite_one_hot_posteriors():
    n, k, m = 60, 3, 4
    rankings = random_rankings(n, m)
    g = torch.Generator().manual_seed(1)
    scores = (torch.rand(n, k, m, generator=g, dtype=torch.float64) * 2 - 1) * 1e4  # uniform in [-1e4, 1e4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: large but finite is fine
        result, _ = fit_mixture(lambda: FixedScorer(scores), None, rankings,
                                EMConfig(k=k, max_iter=3, tol=0, init="dirichlet"))
    gamma = result.best.gamma
    assert torch.isfinite(gamma).all() and np.isfinite(result.best.history).all()
    assert torch.allclose(gamma.sum(1), torch.ones(n, dtype=torch.float64))
    # one cluster explains each ranking by a margin of ~1e4 nats: the posteriors saturate to 0 / 1
    assert ((gamma < 1e-12) | (gamma > 1 - 1e-12)).all()


def test_an_exactly_empty_cluster_gets_zero_posterior_without_nan():
    n, m = 40, 4
    rankings = random_rankings(n, m)
    scores = torch.randn(n, 3, m, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e4
    alpha = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    gamma, ll = mixture_posteriors(scores, rankings, alpha)
    assert torch.isfinite(gamma).all() and torch.isfinite(ll).all()
    assert (gamma[:, 2] == 0).all()


def test_hard_em_that_empties_a_cluster_warns_and_stays_finite():
    # every ranking is far likelier under cluster 0 or 1 than under 2: hard EM gives 2 no ranking
    n, m = 50, 4
    rankings = random_rankings(n, m, seed=3)
    good = torch.arange(m, 0, -1, dtype=torch.float64)  # agrees with the best-first order of tier codes
    order = torch.argsort(rankings.tiers, dim=1)
    aligned = torch.empty(n, m, dtype=torch.float64).scatter_(1, order, good.expand(n, m))
    scores = torch.stack([aligned * 5, aligned * 3, -aligned * 5], dim=1)  # [n, 3, m]
    # a soft start that gives cluster 2 a third of the rankings: hard EM's own argmax must empty it
    gamma0 = torch.as_tensor(np.random.default_rng(0).dirichlet(np.ones(3), n))
    assert (gamma0.argmax(1) == 2).sum() > 5
    with pytest.warns(RuntimeWarning, match="cluster\\(s\\) \\[(0, )?2\\] hold less than half a ranking"):
        result, _ = fit_mixture(lambda: FixedScorer(scores), None, rankings,
                                EMConfig(k=3, max_iter=3, tol=0, hard=True), warm_start=gamma0)
    assert result.best.alpha[2] == 0
    assert torch.isfinite(result.best.gamma).all() and np.isfinite(result.best.history).all()
    assert (result.best.gamma[:, 2] == 0).all()
    # by the likelihood alone cluster 0 (scores x5 against x3) takes every ranking from iteration 1 on
    with pytest.warns(RuntimeWarning, match="iteration 1: cluster\\(s\\) \\[1, 2\\] hold less than half a ranking"):
        uniform, _ = fit_mixture(lambda: FixedScorer(scores), None, rankings,  # alpha 1/k: warned of all the same
                                 EMConfig(k=3, max_iter=3, tol=0, hard=True, mixing="uniform"), warm_start=gamma0)
    assert uniform.best.alpha.tolist() == [1 / 3] * 3 and (uniform.best.gamma[:, 2] == 0).all()


@pytest.mark.parametrize("init", ["kmeans", "dirichlet"])
def test_all_tied_rankings_warn_and_leave_the_posteriors_at_the_mixing_weights(init):
    n, m = 80, 4
    data = generate_synthetic(SyntheticConfig(n=n, k=3, m=m, seed=0))
    tied = Rankings(torch.zeros(n, m, dtype=torch.int64))  # one tier holding every response
    with pytest.warns(RuntimeWarning, match="80 of 80 rankings put every response in one tier"):
        result, scorer = fit_mixture(lambda: LinearScorer(3, 3), data.features(), tied,
                                     EMConfig(k=3, max_iter=5, init=init))
    gamma, alpha = result.best.gamma, result.best.alpha
    assert torch.isfinite(gamma).all() and np.isfinite(result.best.history).all()
    # one tier of every response has probability 1 under every cluster (any order follows), so the
    # posterior of every ranking is the prior: alpha, whatever the initialisation made of it
    assert torch.allclose(gamma, alpha.expand(n, 3), atol=1e-12)
    assert result.best.log_likelihood == pytest.approx(0.0, abs=1e-12)  # log sum_c alpha_c


def test_all_tied_pairs_carry_no_likelihood_at_all():
    tied = Rankings(torch.zeros(10, 3, dtype=torch.int64), model="bt_pairs")
    scores = torch.randn(10, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1e4
    assert (tied.log_likelihood(scores) == 0).all()


def test_some_tied_rankings_warn_that_em_fits_on_the_others():
    rankings = random_rankings(30, 4)
    tiers = rankings.tiers.clone()
    tiers[:5] = 0
    scores = torch.randn(30, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with pytest.warns(RuntimeWarning, match="5 of 30 rankings .* EM fits on the others"):
        fit_mixture(lambda: FixedScorer(scores), None, Rankings(tiers), EMConfig(k=2, max_iter=1, init="dirichlet"))


def test_a_top_1_prefix_over_a_shared_first_tier_is_not_called_tied():
    # tier 0 = {0, 1}, then 2, 3 unobserved beyond the prefix: "0 and 1 beat 2 and 3" is information
    tiers = torch.tensor([[0, 0, 1, 2]] * 6)
    scores = torch.randn(6, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit_mixture(lambda: FixedScorer(scores), None, Rankings(tiers, torch.ones(6, dtype=torch.int64)),
                    EMConfig(k=2, max_iter=1, init="dirichlet"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_stop_em_with_an_error_not_nan(bad):
    rankings = random_rankings(20, 4)
    scores = torch.randn(20, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    scores[3, 1, 2] = bad
    with pytest.raises(FloatingPointError, match=r"EM iteration 0: 1 score\(s\) of cluster\(s\) \[1\] are inf or NaN"):
        fit_mixture(lambda: FixedScorer(scores), None, rankings, EMConfig(k=2, max_iter=2, init="dirichlet"))


def test_padding_slots_may_hold_anything():
    tiers = torch.tensor([[0, 1, -1], [1, 0, 2]])  # the first slate has 2 responses, its third slot is PAD
    scores = torch.randn(2, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    scores[0, :, 2] = float("nan")
    result, _ = fit_mixture(lambda: FixedScorer(scores), None, Rankings(tiers),
                            EMConfig(k=2, max_iter=1, init="dirichlet"))
    assert torch.isfinite(result.best.gamma).all()


def test_more_clusters_than_rankings_is_refused():
    with pytest.raises(ValueError, match="k = 5 clusters needs at least 5 rankings, got 4"):
        fit_mixture(lambda: FixedScorer(torch.zeros(4, 5, 3, dtype=torch.float64)), None, random_rankings(4, 3),
                    EMConfig(k=5))
