"""Where EM starts: symmetry-breaking responsibilities for the first M-step (a seeded Dirichlet,
k-means over the rankings' Fisher-score features, or a linear PL mixture's posteriors: `linearized`),
and a restart kept from repeating an earlier restart's start."""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from moplex_core.em.types import EMConfig, Rankings, Scorer
from moplex_core.pl import PAD, UNRANKED

log = logging.getLogger(__name__)


def initial_responsibilities(
    config: EMConfig, scorer: Scorer, inputs: Any, rankings: Rankings, seed: int, restart: int = 0
) -> torch.Tensor:
    """Symmetry-breaking start, float64 [n, k], of restart ``restart`` (whose seed is ``seed``,
    config.seed + 1000 restart). The linearized start runs an EM of its own with 3 restarts 1000 seeds
    apart, so it draws from seed + 2000 restart (config.seed + 3000 restart): no two restarts share a
    start's draw."""
    n, k = len(rankings), config.k
    if k == 1:
        return torch.ones(n, 1, dtype=torch.float64)
    if config.init == "labels":
        raise ValueError("init='labels' starts from the caller's known groups: give them to fit_mixture as "
                         "warm_start (soft_one_hot of each ranking's group)")
    if config.init == "dirichlet":
        # Normalised Gamma(c, 1) draws from a generator seeded here, never the global RNG.
        rng = np.random.default_rng(seed)
        g = rng.gamma(config.dirichlet_concentration, size=(n, k))
        return torch.as_tensor(g / g.sum(1, keepdims=True), dtype=torch.float64)
    if config.init == "linearized":
        return _linearized_start(config, scorer, inputs, rankings, seed + 2000 * restart)
    from sklearn.cluster import KMeans

    features = scorer.ranking_features(inputs, rankings).numpy()
    features = features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-12)
    return soft_one_hot(KMeans(k, n_init=4, random_state=seed).fit_predict(features), k)


def soft_one_hot(labels: np.ndarray, k: int) -> torch.Tensor:
    """Responsibilities float64 [n, k] that put 0.9 on each ranking's cluster ``labels[i]`` (in 0..k-1)
    and share 0.1 among the others: confident but not certain, so the first M-step still sees every
    cluster (k = 1: all ones)."""
    if k == 1:
        return torch.ones(len(labels), 1, dtype=torch.float64)
    gamma = torch.full((len(labels), k), 0.1 / (k - 1), dtype=torch.float64)
    gamma[torch.arange(len(labels)), torch.as_tensor(labels, dtype=torch.long)] = 0.9
    return gamma


LINEARIZED_L2 = 1e-2
"""Ridge of the linearized start's linear scorer, on standardised features. Of 1e-3, 1e-2 and 1e-1,
1e-2 clustered the synthetic demo's training rankings best (0.83 against 0.73 and 0.69; one sweep
with the 256 features of `LoRAPolicyScorer.response_features`)."""
LINEARIZED_ITERATIONS = 20
LINEARIZED_SOLVER = {"max_lbfgs_iter": 30, "tolerance": 1e-6}
"""A start, not a final fit: 20 EM iterations of at most 30 L-BFGS steps to 1e-6 gave the same
clustering (0.85 and 0.75 of the demo's and lm_synthetic_cpu.py's training rankings) as 50 of 200 to
1e-10 (0.83, 0.76) in a 15th and a 19th of the time (5.6 s against 85 s, 9.6 s against 186 s)."""


def _linearized_start(config: EMConfig, scorer: Scorer, inputs: Any, rankings: Rankings, seed: int) -> torch.Tensor:
    """Posteriors float64 [n, k] of a linear PL mixture fitted by EM (a seeded Dirichlet start, 3
    restarts) over ``scorer.response_features(inputs)``: the mixture the scorer would be if its
    scores were linear in those features (for the LM policy scorer, its first-order model when the
    output layer moves). Its M-step is convex and L-BFGS nearly solves it (LINEARIZED_SOLVER), where
    the scorer's own first M-steps are a few noisy optimizer steps.

    Only ranked responses take part: the augmented bottom set (UNRANKED) says the same in every
    cluster (the originals beat the generated ones), so it tells nothing about the cluster and a
    linear model would spend itself on it.
    """
    from moplex_core.em.fit import fit_mixture  # which imports this module
    from moplex_core.scorers.linear import LinearScorer  # scorers import this package

    if not hasattr(scorer, "response_features"):
        raise ValueError(f"init='linearized' needs a scorer with response features (the LM policy scorer); "
                         f"{type(scorer).__name__} has none: use init='kmeans' or 'dirichlet'")
    features = scorer.response_features(inputs)  # [n, M, d]
    tiers = torch.where(rankings.tiers == UNRANKED, PAD, rankings.tiers)  # [n, M]
    ranked = Rankings(tiers, rankings.ranked_prefix, rankings.example_ids, rankings.model)
    real = (tiers != PAD).unsqueeze(-1)  # [n, M, 1]
    values = features[real.expand_as(features)].view(-1, features.shape[-1])  # [slots, d]
    standardised = torch.where(real, (features - values.mean(0)) / (values.std(0) + 1e-12), 0.0)
    tied = ranked.all_tied  # [n]: no order among its own ranked responses
    if tied.any():
        warnings.warn(f"init='linearized': {int(tied.sum())} of {len(tied)} rankings order none of their ranked "
                      "responses (all tied; generated responses below them say the same in every cluster), so "
                      "they tell the start nothing about their cluster"
                      + ("; with none ordered the start is no better than a random one" if tied.all() else ""),
                      RuntimeWarning, stacklevel=2)
    with warnings.catch_warnings():
        # Its M-step maximises the likelihood with a ridge (LINEARIZED_L2), so the likelihood alone may
        # fall a little; that warning's advice names the LoRA adapters' settings, which this fit has not.
        warnings.filterwarnings("ignore", message=r"EM iteration \d+: the log-likelihood per ranking fell",
                                category=RuntimeWarning)
        # Its rankings without the generated responses: their ties are said above, as the start's.
        warnings.filterwarnings("ignore", message=r"\d+ of \d+ rankings put every response in one tier",
                                category=RuntimeWarning)
        result, _ = fit_mixture(
            lambda: LinearScorer(config.k, features.shape[-1], l2=LINEARIZED_L2, **LINEARIZED_SOLVER), standardised,
            ranked, EMConfig(k=config.k, max_iter=LINEARIZED_ITERATIONS, init="dirichlet", restarts=3, seed=seed))
    return result.best.gamma


def _repeated_start(gamma: torch.Tensor, earlier: list[torch.Tensor]) -> int | None:
    """The earlier restart whose start has the partition ``gamma`` has (up to relabelling), or None."""
    labels = gamma.argmax(1).tolist()
    for previous, start in enumerate(earlier):
        pairs = set(zip(start.argmax(1).tolist(), labels, strict=True))
        if len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs}):
            return previous
    return None


def different_start(gamma: torch.Tensor, earlier: list[torch.Tensor], config: EMConfig, scorer: Scorer,
                     inputs: Any, rankings: Rankings, seed: int, restart: int, drawn: bool) -> torch.Tensor:
    """``gamma``, unless it repeats an earlier restart's partition. A k-means start (``drawn``: not
    the caller's warm start) then found one partition however it was seeded, and the restart would
    repeat that run, so it starts from a seeded Dirichlet draw instead; another start is kept and
    warned about (the LM scorer's seed still differs between restarts)."""
    previous = _repeated_start(gamma, earlier)
    if previous is None:
        return gamma
    if drawn and config.init == "kmeans":
        log.info("restart %d: k-means found restart %d's partition again; starting from a Dirichlet draw "
                 "instead", restart, previous)
        return initial_responsibilities(replace(config, init="dirichlet"), scorer, inputs, rankings, seed, restart)
    log.warning("restart %d starts from the partition restart %d started from (up to relabelling): the start "
                "finds one optimum however it is seeded, so restarts add little here; use init='dirichlet' for "
                "different starts", restart, previous)
    return gamma
