"""What EM works on: the rankings, the `Scorer` protocol behind which a cluster scores
responses, EM's settings, and its state and result."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

import numpy as np
import torch

from moplex_core.pl import LIKELIHOODS, PAD, UNRANKED, RankingIndex, prepare_rankings


@dataclass(frozen=True)
class Rankings:
    """n rankings as tier codes (moplex_core.pl) with an optional top-l prefix and ids, and the
    observation model that scores them: `pl` (Plackett-Luce, DESIGN.md 5.2) or `bt_pairs`
    (Bradley-Terry over all pairs, the pairwise baselines).

    ``tiers[i, j]`` is the tier of slot j's response in ranking i (0 = best; equal codes are ties,
    only their order counts), UNRANKED for the unordered bottom set, PAD (-1) for a slot ranking i
    lacks; not the ranking's order of items (``np.argsort`` of a best-first permutation gives the
    tiers). Integer numpy arrays, lists and tensors are taken (as int64 tensors); ``ranked_prefix``
    may be one int for every ranking."""

    tiers: torch.Tensor  # int64 [n, M]
    ranked_prefix: torch.Tensor | None = None  # int64 [n]
    example_ids: tuple[str, ...] | None = None
    model: Literal["pl", "bt_pairs"] = "pl"

    def __post_init__(self) -> None:
        if self.model not in LIKELIHOODS:
            raise ValueError(f"unknown ranking model {self.model!r}; choose one of {sorted(LIKELIHOODS)}")
        tiers = as_integers(self.tiers, "tiers")
        if tiers.ndim != 2:
            raise ValueError(f"tiers must be [n, M], one row of tier codes per ranking; got shape {tuple(tiers.shape)}")
        if (tiers < PAD).any():
            raise ValueError(f"tiers hold codes below PAD = {PAD} (rankings "
                             f"{(tiers < PAD).any(1).nonzero().flatten()[:5].tolist()}); a tier is >= 0 (0 = best), "
                             "PAD or UNRANKED")
        object.__setattr__(self, "tiers", tiers)
        if self.ranked_prefix is not None:
            prefix = as_integers(self.ranked_prefix, "ranked_prefix").to(tiers.device)
            if prefix.ndim == 0:
                prefix = prefix.expand(len(tiers)).clone()
            if tuple(prefix.shape) != (len(tiers),):
                raise ValueError(f"ranked_prefix must be one int or [n] = [{len(tiers)}], got shape {tuple(prefix.shape)}")
            object.__setattr__(self, "ranked_prefix", prefix)
        if self.example_ids is not None:
            ids = tuple(self.example_ids)
            if len(ids) != len(tiers):
                raise ValueError(f"{len(ids)} example_ids for {len(tiers)} rankings")
            object.__setattr__(self, "example_ids", ids)

    def __len__(self) -> int:
        return self.tiers.shape[0]

    @cached_property
    def index(self) -> RankingIndex:
        """The tiers sorted once (frozen dataclass: computed on first use and kept)."""
        return prepare_rankings(self.tiers, self.ranked_prefix)

    @property
    def observed_tiers(self) -> torch.Tensor:
        """int64 [n, M]: tiers with those beyond ``ranked_prefix`` turned UNRANKED (never observed)."""
        if self.ranked_prefix is None:
            return self.tiers
        beyond = (self.tiers != PAD) & (self.tiers >= self.ranked_prefix.unsqueeze(1))
        return torch.where(beyond, UNRANKED, self.tiers)

    @property
    def all_tied(self) -> torch.Tensor:
        """bool [n]: rankings with every observed response in one tier. They order nothing: under pl
        their one tier holds every response, in any order (probability 1), under bt_pairs they have no pair."""
        tiers = self.observed_tiers
        return ((tiers == 0) | (tiers == PAD)).all(1)

    def log_likelihood(self, scores: torch.Tensor) -> torch.Tensor:
        """Per ranking (and cluster): scores [n, M] -> [n], or [n, k, M] -> [n, k]."""
        batch = tuple(scores.shape[1:-1])
        expanded = self.__dict__.setdefault("_expanded_index", {})  # per batch shape, e.g. (k,)
        if batch not in expanded:
            expanded[batch] = self.index.expand(*batch) if batch else self.index
        return LIKELIHOODS[self.model](scores, expanded[batch])

    def subset(self, idx: np.ndarray | torch.Tensor) -> Rankings:
        idx = torch.as_tensor(idx, dtype=torch.int64)
        return Rankings(
            self.tiers[idx],
            None if self.ranked_prefix is None else self.ranked_prefix[idx],
            None if self.example_ids is None else tuple(self.example_ids[i] for i in idx.tolist()),
            self.model,
        )


def as_integers(values: Any, name: str) -> torch.Tensor:
    """``values`` (a tensor, numpy array or nested list of integers) as an int64 tensor; a float with a
    fraction is refused (a tier of 0.5 has no meaning, and truncating it would tie it silently)."""
    tensor = torch.as_tensor(values)
    if tensor.dtype == torch.int64:
        return tensor
    if tensor.is_floating_point() and not bool((torch.isfinite(tensor) & (tensor == tensor.round())).all()):
        raise TypeError(f"{name} must be integers, got {tensor.dtype} values with a fraction, inf or NaN")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got {tensor.dtype}")
    return tensor.to(torch.int64)


class Scorer(Protocol):
    """Scores of responses under each of k clusters, and a weighted M-step.

    ``inputs`` is whatever the scorer needs to score the n examples (item ids, features, an LM
    cache); the engine passes it through untouched. ``iteration`` lets a scorer make per-iteration
    choices (anchor sampling) that must agree between the E-step and the M-step.
    """

    k: int

    def score(self, inputs: Any, iteration: int) -> torch.Tensor:
        """Scores float64 [n, k, M], no gradient."""
        ...

    def fit(self, inputs: Any, rankings: Rankings, weights: torch.Tensor, iteration: int) -> None:
        """Minimise - sum_ic weights_ic log P_c(sigma_i). weights: float64 [n, k], zero = skip."""
        ...

    def ranking_features(self, inputs: Any, rankings: Rankings) -> torch.Tensor:
        """One feature vector per ranking, float64 [n, d], for the k-means initialisation."""
        ...

    # Optional, for init="linearized": response_features(inputs) -> float64 [n, M, d], features in
    # which every cluster's score is (to first order) linear at the scorer's start.
    # Optional, for EMConfig.backtracks: scale_steps(factor) sets the M-step's step size (learning
    # rate) to factor times the configured one, until it is called again; ``estimates`` (true when an
    # iteration's E-step scores are estimates from that iteration's draw of anchors) makes
    # backtracking compare the scorer before and after an M-step under one draw, scoring the one
    # before with score(inputs, iteration, check=False): no check of its own that could change it.
    # An estimating scorer run with EMConfig.restarts > 1 also needs exact() (a Scorer whose scores
    # are every response exact): restarts are ranked by that log-likelihood (`fit_mixture`).

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class EMConfig:
    k: int = 2
    max_iter: int = 50
    tol: float = 1e-6
    """Stop when |LL_t - LL_{t-1}| <= tol * max(|LL_{t-1}|, 1) (LL per ranking, in nats: relative, and
    absolute where the LL nears 0, as it does when every ranking is alike)."""
    gamma_min: float = 1e-3
    """M-step skips (example, cluster) pairs whose responsibility is below this."""
    init: Literal["kmeans", "dirichlet", "linearized", "labels"] = "kmeans"
    """``labels``: the caller's known groups, given to `fit_mixture` as ``warm_start`` (`soft_one_hot`)."""
    dirichlet_concentration: float = 1.0
    restarts: int = 1
    """Independent runs from different initialisations; the best final log-likelihood is kept (with
    every response exact where a restart's scores are estimated: each restart's anchors are its own)."""
    hard: bool = False
    """Hard EM: gamma is one-hot at argmax_c (log alpha_c + log P_c), from the start on; with ``mixing =
    "uniform"`` at argmax_c log P_c, by the likelihood alone, as MaxMin-RLHF assigns."""
    mixing: Literal["learned", "uniform"] = "learned"
    """The mixing weights: ``learned``, alpha_c = mean_i gamma_ic each iteration (Algorithm 2; a large
    cluster keeps borderline rankings, and an emptied one gets none back); ``uniform``, alpha = 1/k
    throughout (the E-step and the mixture's log-likelihood weigh every cluster alike)."""
    seed: int = 0
    backtracks: int = 0
    """When the log-likelihood falls after an M-step, redo that M-step from where it started with the
    scorer's step halved (`Scorer.scale_steps`), up to this many times per iteration; the next
    iteration starts at the configured step again. Soft EM only, and scorers with ``scale_steps``."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"EM needs k >= 1 clusters, got k={self.k}")
        if self.max_iter < 1 or self.restarts < 1:
            raise ValueError("max_iter and restarts must be >= 1")
        if not 0 <= self.gamma_min < 1:
            raise ValueError(f"gamma_min must be in [0, 1), got {self.gamma_min}")
        if not self.hard and self.gamma_min > 1 / self.k:
            raise ValueError(f"gamma_min = {self.gamma_min} is above 1/k = {1 / self.k:.4g}: a ranking's largest "
                             "responsibility can be as low as 1/k, and such a ranking would train no cluster at all")
        if self.backtracks < 0:
            raise ValueError(f"backtracks must be >= 0, got {self.backtracks}")


@dataclass
class EMState:
    """Everything needed to continue a run after ``iteration`` finished."""

    restart: int
    iteration: int
    gamma: torch.Tensor  # float64 [n, k]
    alpha: torch.Tensor  # float64 [k], the weights used in this iteration's E-step
    history: list[float] = field(default_factory=list)  # LL per ranking, one per iteration
    converged: bool = False
    scorer_state: dict[str, Any] = field(default_factory=dict)
    halvings: list[int] = field(default_factory=list)  # per iteration: times its M-step was redone
    compared_on: float | None = None  # the LL per ranking restarts are compared on, when not history[-1]

    @property
    def log_likelihood(self) -> float:
        return self.history[-1]

    @property
    def comparable_log_likelihood(self) -> float:
        """What `fit_mixture` ranks restarts by: the final LL per ranking with every response exact
        where this restart ended on estimated scores (``compared_on``), else its last LL."""
        return self.log_likelihood if self.compared_on is None else self.compared_on


@dataclass
class EMResult:
    best: EMState
    restarts: list[EMState]
