"""Dataset-level EM for a mixture of k Plackett-Luce models (paper Algorithm 2, DESIGN.md 5.3).

The engine knows rankings and posteriors; everything about *how* a cluster scores a response lives
behind the `Scorer` protocol (free item utilities, a linear model, k LoRA adapters on an LM).

One iteration t:
    alpha_c   = mean_i gamma_ic                                  (M-step, mixing weights)
    theta     = argmin - sum_ic w_ic log P_c(sigma_i),  w = gamma * [gamma >= gamma_min]
    gamma_ic  = softmax_c(log alpha_c + log P_c(sigma_i))        (E-step, whole training set)
    LL_t      = mean_i logsumexp_c(log alpha_c + log P_c(sigma_i))

The first M-step starts from symmetry-breaking responsibilities (a seeded Dirichlet, k-means over
the rankings' Fisher-score features, or the posteriors of a linear PL mixture over features in which
the scorer is linear at its start: `linearized`), since scorers start equal (LoRA B = 0 makes every
adapter the reference). Every iteration can be checkpointed to ``<dir>/restart-RR/iter-NNNN/`` and a killed run
resumes at the last finished iteration with identical results; the responsibilities a restart started
from are kept beside them (``<dir>/restart-RR/start.parquet``), so a rerun does not recompute the start
and a reader can see how much of it EM kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moplex_core.artifacts import atomic_path
from moplex_core.pl import LIKELIHOODS, PAD, UNRANKED, RankingIndex, prepare_rankings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rankings:
    """n rankings as tier codes (moplex_core.pl) with an optional top-l prefix and ids, and the
    observation model that scores them: `pl` (Plackett-Luce, DESIGN.md 5.2) or `bt_pairs`
    (Bradley-Terry over all pairs, the pairwise baselines)."""

    tiers: torch.Tensor  # int64 [n, M]
    ranked_prefix: torch.Tensor | None = None  # int64 [n]
    example_ids: tuple[str, ...] | None = None
    model: Literal["pl", "bt_pairs"] = "pl"

    def __post_init__(self) -> None:
        if self.model not in LIKELIHOODS:
            raise ValueError(f"unknown ranking model {self.model!r}; choose one of {sorted(LIKELIHOODS)}")

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
    """Stop when |LL_t - LL_{t-1}| <= tol * |LL_{t-1}| (LL per ranking)."""
    gamma_min: float = 1e-3
    """M-step skips (example, cluster) pairs whose responsibility is below this."""
    init: Literal["kmeans", "dirichlet", "linearized", "labels"] = "kmeans"
    """``labels``: the caller's known groups, given to `fit_mixture` as ``warm_start`` (`soft_one_hot`)."""
    dirichlet_concentration: float = 1.0
    restarts: int = 1
    """Independent runs from different initialisations; the best final log-likelihood is kept (with
    every response exact where a restart's scores are estimated: each restart's anchors are its own)."""
    hard: bool = False
    """Hard EM: gamma is one-hot at argmax_c (log alpha_c + log P_c), from the start on. MaxMin-RLHF
    assigns by the likelihood alone; with the alpha prior a large cluster keeps borderline rankings."""
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


def posteriors(
    scorer: Scorer, inputs: Any, rankings: Rankings, alpha: torch.Tensor, iteration: int = 0, **score_options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """E-step: (gamma float64 [n, k], per-ranking mixture log-likelihood float64 [n]); ``score_options``
    go to ``scorer.score`` (an estimating scorer's ``check``).

    Scores of any finite size are fine (the likelihood is a logsumexp in float64); a non-finite
    score of a response in a slate raises `FloatingPointError` instead of spreading NaN."""
    scores = scorer.score(inputs, iteration, **score_options)  # [n, k, M]
    check_finite(scores, rankings, f"EM iteration {iteration}",
                 "Lower the learning rate (train.lr) or beta, or check the inputs; the last finished iteration's "
                 "checkpoint is kept.")
    return mixture_posteriors(scores, rankings, alpha)


def check_finite(scores: torch.Tensor, rankings: Rankings, where: str, advice: str) -> None:
    """Raise `FloatingPointError` when a score [n, k, M] of a response in a slate is inf or NaN (a NaN
    posterior's argmax would quietly be cluster 0); padding slots may hold anything."""
    bad = ~torch.isfinite(scores) & (rankings.tiers != PAD).unsqueeze(1)
    if bad.any():
        clusters = bad.any(2).any(0).nonzero().flatten().tolist()
        examples = bad.any(2).any(1).nonzero().flatten().tolist()
        raise FloatingPointError(
            f"{where}: {int(bad.sum())} score(s) of cluster(s) {clusters} are inf or NaN (rankings "
            f"{examples[:5]}{' ...' if len(examples) > 5 else ''}), so their parameters diverged (or the inputs "
            f"hold inf/NaN). {advice}"
        )


def mixture_posteriors(
    scores: torch.Tensor, rankings: Rankings, alpha: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """gamma_ic = softmax_c(log alpha_c + log P_c(sigma_i)) from scores [n, k, M]; also the
    per-ranking mixture log-likelihood logsumexp_c(...) [n]. Empty clusters (alpha = 0) get gamma 0
    exactly, however well they score (log 0 = -inf; a clamped alpha would lose to a 1e3-nat margin)."""
    joint = torch.log(alpha).unsqueeze(0) + rankings.log_likelihood(scores)  # [n, k]
    ll = torch.logsumexp(joint, dim=1)
    return torch.exp(joint - ll.unsqueeze(1)), ll


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
    from moplex_core.scorers.linear import LinearScorer  # scorers import this module

    if not hasattr(scorer, "response_features"):
        raise ValueError(f"init='linearized' needs a scorer with response features (the LM policy scorer); "
                         f"{type(scorer).__name__} has none: use init='kmeans' or 'dirichlet'")
    features = scorer.response_features(inputs)  # [n, M, d]
    tiers = torch.where(rankings.tiers == UNRANKED, PAD, rankings.tiers)  # [n, M]
    ranked = Rankings(tiers, rankings.ranked_prefix, rankings.example_ids, rankings.model)
    real = (tiers != PAD).unsqueeze(-1)  # [n, M, 1]
    values = features[real.expand_as(features)].view(-1, features.shape[-1])  # [slots, d]
    standardised = torch.where(real, (features - values.mean(0)) / (values.std(0) + 1e-12), 0.0)
    with warnings.catch_warnings():
        # Its M-step maximises the likelihood with a ridge (LINEARIZED_L2), so the likelihood alone may
        # fall a little; that warning's advice names the LoRA adapters' settings, which this fit has not.
        warnings.filterwarnings("ignore", message=r"EM iteration \d+: the log-likelihood per ranking fell",
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


def _different_start(gamma: torch.Tensor, earlier: list[torch.Tensor], config: EMConfig, scorer: Scorer,
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


def _one_hot(gamma: torch.Tensor) -> torch.Tensor:
    """Hard assignments: float64 [n, k] one-hot at argmax_c gamma_ic."""
    return torch.nn.functional.one_hot(gamma.argmax(1), gamma.shape[1]).to(torch.float64)


def fit_mixture(
    make_scorer: Callable[[], Scorer],
    inputs: Any,
    rankings: Rankings,
    config: EMConfig,
    checkpoint_dir: Path | None = None,
    on_iteration: Callable[[EMState], None] | None = None,
    warm_start: torch.Tensor | None = None,
    checkpoint_files: Callable[[Path, EMState, Scorer], None] | None = None,
) -> tuple[EMResult, Scorer]:
    """Fit the mixture with ``config.restarts`` restarts; return the result and the best scorer.
    ``make_scorer`` is called once per restart, in restart order (a caller may seed each restart's
    scorer differently by counting the calls), and no two scorers are alive at once: the scorer
    returned is the last restart's, holding the best restart's state.

    With ``checkpoint_dir`` every iteration is saved and a rerun resumes from the last finished one.
    ``warm_start`` (float64 [n, k], e.g. a previous run's posteriors) replaces ``config.init``. Each
    restart's start is saved (``restart-RR/start.parquet``; the soft responsibilities, also under
    ``config.hard``, where EM starts from their argmax) and a rerun reads it back.
    ``checkpoint_files(iter_dir, state, scorer)`` writes a caller's own files of an iteration (e.g.
    adapters in PEFT's format) before its state.json, so a finished iteration always has them.
    """
    if config.k > len(rankings):
        raise ValueError(f"EM with k = {config.k} clusters needs at least {config.k} rankings, got {len(rankings)}")
    _warn_on_tied_rankings(rankings)
    if checkpoint_dir is not None:
        _claim_checkpoint_dir(Path(checkpoint_dir), config, rankings, warm_start)
    finished: list[EMState] = []
    starts: list[torch.Tensor] = []
    best: EMState | None = None
    for restart in range(config.restarts):
        scorer = make_scorer()  # the only scorer alive: on a GPU each holds a model
        state = _run_restart(scorer, inputs, rankings, config, restart, checkpoint_dir, on_iteration, warm_start,
                             checkpoint_files, starts)
        if config.restarts > 1 and getattr(scorer, "estimates", False):
            state = replace(state, compared_on=_exact_log_likelihood(scorer, inputs, rankings, state))
            log.info("restart %d: log-likelihood per ranking %.6f with every response exact (%.6f estimated)",
                     restart, state.compared_on, state.log_likelihood)
        if best is None or state.comparable_log_likelihood > best.comparable_log_likelihood:
            best = state
        # Only the best restart's scorer state is used: the others' (adapters, Adam moments) free their memory.
        finished = [s if s is best else replace(s, scorer_state={}) for s in [*finished, state]]
        if restart < config.restarts - 1:
            del scorer
    if best is not state:
        scorer.load_state_dict(best.scorer_state)  # the last restart's scorer takes the best one's state
    return EMResult(best, finished), scorer


def _exact_log_likelihood(scorer: Scorer, inputs: Any, rankings: Rankings, state: EMState) -> float:
    """The LL per ranking of ``state``'s scorer with every response exact (``scorer.exact()``) and its
    last alpha: each restart's estimates come from anchors of its own seed, so estimated LLs of two
    restarts differ by their draws as well as by their fits. One exact E-step per restart."""
    scores = scorer.exact().score(inputs)  # [n, k, M]
    check_finite(scores, rankings, f"restart {state.restart}'s final adapters, every response exact",
                 "Lower the learning rate (train.lr) or beta, or check the inputs.")
    return mixture_posteriors(scores, rankings, state.alpha)[1].mean().item()


def _claim_checkpoint_dir(checkpoint_dir: Path, config: EMConfig, rankings: Rankings,
                          warm_start: torch.Tensor | None) -> None:
    """Record what the checkpoints belong to (run.json) and refuse to resume someone else's run."""
    data = hashlib.sha256(rankings.tiers.numpy().tobytes())
    if rankings.ranked_prefix is not None:
        data.update(rankings.ranked_prefix.numpy().tobytes())
    data.update(json.dumps([rankings.model, rankings.example_ids]).encode())
    warm = None if warm_start is None else \
        hashlib.sha256(warm_start.to(torch.float64).contiguous().numpy().tobytes()).hexdigest()
    identity = {"config": asdict(config), "n": len(rankings), "rankings_sha256": data.hexdigest(),
                "warm_start_sha256": warm}
    run_file = checkpoint_dir / "run.json"
    if run_file.exists():
        recorded = json.loads(run_file.read_text())
        if recorded != identity:
            changed = sorted(key for key in identity if recorded.get(key) != identity[key])
            raise ValueError(
                f"{checkpoint_dir} holds EM checkpoints of another run (different {', '.join(changed)}); "
                "resuming would mix the two. Use a new checkpoint directory or delete this one."
            )
        return
    with atomic_path(run_file) as tmp:
        tmp.write_text(json.dumps(identity, indent=2))


def _run_restart(
    scorer: Scorer,
    inputs: Any,
    rankings: Rankings,
    config: EMConfig,
    restart: int,
    checkpoint_dir: Path | None,
    on_iteration: Callable[[EMState], None] | None,
    warm_start: torch.Tensor | None,
    checkpoint_files: Callable[[Path, EMState, Scorer], None] | None = None,
    starts: list[torch.Tensor] | None = None,
) -> EMState:
    """One restart; ``starts`` collects the responsibilities each restart started from (a restart
    resumed after an iteration is not compared again, but its start, read back, is there for the
    restarts after it, as in an uninterrupted run)."""
    seed = config.seed + 1000 * restart
    restart_dir = None if checkpoint_dir is None else Path(checkpoint_dir) / f"restart-{restart:02d}"
    state = load_last_checkpoint(restart_dir) if restart_dir is not None else None
    started = load_start(restart_dir, rankings.example_ids) if restart_dir is not None else None
    if state is not None:
        _keep_only_the_last_state(restart_dir, restart_dir / f"iter-{state.iteration:04d}")  # a kill may have left one
        scorer.load_state_dict(state.scorer_state)
        log.info("restart %d: resuming after iteration %d (LL %.6f)", restart, state.iteration, state.log_likelihood)
        if starts is not None and started is not None:  # train artifacts before train-5 kept no start
            starts.append(started)
        if state.converged or state.iteration + 1 >= config.max_iter:
            return state
        gamma, history, start = state.gamma, list(state.history), state.iteration + 1
        halvings = list(state.halvings)
    else:
        gamma = started
        if gamma is None:
            gamma = warm_start.to(torch.float64) if warm_start is not None else \
                initial_responsibilities(config, scorer, inputs, rankings, seed, restart)
            if starts is not None:
                gamma = _different_start(gamma, starts, config, scorer, inputs, rankings, seed, restart,
                                         drawn=warm_start is None)
            if restart_dir is not None:
                save_start(restart_dir, gamma, rankings.example_ids)
        if starts is not None:
            starts.append(gamma)
        gamma, history, start, halvings = (_one_hot(gamma) if config.hard else gamma), [], 0, []

    n = len(rankings)
    for iteration in range(start, config.max_iter):
        alpha = gamma.mean(0)
        _warn_on_empty_clusters(alpha, n, iteration)
        weights = torch.where(gamma >= config.gamma_min, gamma, 0.0)
        step = _m_and_e_step(scorer, inputs, rankings, weights, alpha, iteration, history[-1] if history else None,
                             config)
        gamma = _one_hot(step.gamma) if config.hard else step.gamma
        history.append(step.ll.mean().item())
        halvings.append(step.halved)
        # An iteration that switched to exact scores has an LL that the estimated one before it cannot
        # be compared with: neither a fall nor convergence is read from that pair.
        comparable = len(history) > 1 and not step.became_exact
        if comparable and not config.hard:
            _warn_if_the_likelihood_fell(history, iteration, across_draws=step.held_under_its_draw)
        converged = comparable and abs(history[-1] - history[-2]) <= config.tol * abs(history[-2])
        state = EMState(restart, iteration, gamma, alpha, list(history), converged, scorer.state_dict(),
                        list(halvings))
        if restart_dir is not None:
            extra = None if checkpoint_files is None else lambda it_dir: checkpoint_files(it_dir, state, scorer)
            save_checkpoint(restart_dir, state, rankings.example_ids, extra)
        if on_iteration is not None:
            on_iteration(state)
        if converged:
            break
    return state


@dataclass(frozen=True)
class _Step:
    """What `_m_and_e_step` did in one iteration."""

    gamma: torch.Tensor  # float64 [n, k] posteriors of the E-step
    ll: torch.Tensor  # float64 [n] per-ranking mixture log-likelihood
    halved: int  # times the M-step was redone at half the step
    held_under_its_draw: bool  # estimated scores: under this iteration's anchors the kept M-step did not lower the LL
    became_exact: bool  # the exact fallback switched to exact scores in this iteration


def _m_and_e_step(scorer: Scorer, inputs: Any, rankings: Rankings, weights: torch.Tensor, alpha: torch.Tensor,
                  iteration: int, previous: float | None, config: EMConfig) -> _Step:
    """The M-step and E-step of one iteration.

    With ``config.backtracks`` (soft EM, a scorer with ``scale_steps``, an LL to compare with), an
    M-step after which the LL per ranking falls below ``previous``, or whose scores are no longer
    finite, is redone from the scorer's state before it, with its step halved, until the LL does not
    fall or the backtracks are spent (the last attempt is kept; non-finite scores then raise). Each
    attempt costs one M-step and one E-step more. With estimated scores (``scorer.estimates``)
    ``previous`` came from the last iteration's anchors, so the comparison is made instead with the
    scorer before the M-step scored under this iteration's anchors and ``alpha``: one E-step more
    per iteration, and a fall is the M-step's (the adapters' step, the only thing a halving
    changes), not another draw's. (Exact EM's claim is against the last iteration's alpha; under
    another draw the alpha taken from the last draw's posteriors is no better than this one, and a
    fall it caused no halving could mend.)

    With a scorer that falls back to exact scores (``exact_fallback``, ``fell_back``: the LoRA
    scorer's `train.exact_fallback`), an E-step whose estimates failed (also when they are not
    finite) is redone exactly, and so is the M-step before it (its estimated objective led there),
    from the same state at the same step size. That iteration backtracks no further: its exact
    log-likelihood and the estimated one before it are not comparable.
    """
    scale_steps = getattr(scorer, "scale_steps", None)
    backtracks = config.backtracks if scale_steps is not None and previous is not None and not config.hard else 0
    fallback = bool(getattr(scorer, "exact_fallback", 0)) and getattr(scorer, "fell_back", None) is None
    before = scorer.state_dict() if backtracks or fallback else None
    under_one_draw = bool(backtracks) and getattr(scorer, "estimates", False)
    if under_one_draw:
        try:
            previous = posteriors(scorer, inputs, rankings, alpha, iteration, check=False)[1].mean().item()
        except FloatingPointError:  # this draw's estimates are not finite: the E-step after the M-step will say
            under_one_draw = False  # so (the exact fallback, or EM's error); compare with the last LL meanwhile
            log.info("EM iteration %d: this iteration's anchors give scores that are inf or NaN before the M-step; "
                     "backtracking compares with the last iteration's log-likelihood instead", iteration)
        scorer.load_state_dict(before)  # the E-step's estimates as they were
    for halved in range(backtracks + 1):
        if backtracks:
            scale_steps(0.5 ** halved)
        scorer.fit(inputs, rankings, weights, iteration)
        try:
            gamma, ll = posteriors(scorer, inputs, rankings, alpha, iteration)
            fell = likelihood_falls([previous, ll.mean().item()]) if previous is not None else []
        except FloatingPointError:
            if not (fallback and scorer.fell_back is not None) and halved == backtracks:
                raise
            gamma = ll = None
        if fallback and scorer.fell_back is not None:
            log.info("EM iteration %d: redoing the M-step and E-step with every response exact", iteration)
            scorer.load_state_dict({**before, "fell_back": scorer.fell_back})
            if backtracks:
                scale_steps(0.5 ** halved)  # the restored optimizer state holds the full step
            scorer.fit(inputs, rankings, weights, iteration)
            gamma, ll = posteriors(scorer, inputs, rankings, alpha, iteration)
            if backtracks:
                scale_steps(1.0)
            return _Step(gamma, ll, halved, held_under_its_draw=False, became_exact=True)
        if ll is not None and (halved == backtracks or not fell):
            break
        if ll is None:
            log.info("EM iteration %d: the M-step left scores that are inf or NaN; redoing it with its step halved "
                     "(%d of %d)", iteration, halved + 1, backtracks)
        else:
            log.info("EM iteration %d: the log-likelihood per ranking fell from %.6f to %.6f; redoing the M-step "
                     "with its step halved (%d of %d)", iteration, previous, ll.mean().item(), halved + 1, backtracks)
        scorer.load_state_dict(before)
    if backtracks:
        scale_steps(1.0)
    return _Step(gamma, ll, halved, held_under_its_draw=under_one_draw and not fell, became_exact=False)


def _warn_on_tied_rankings(rankings: Rankings) -> None:
    """Rankings with every response in one observed tier order nothing: under Breslow ties (pl) they
    only pull a cluster's scores together, under bt_pairs they have no pair at all. EM still runs;
    if every ranking is tied, no cluster can be told apart and the posteriors tend to the mixing
    weights."""
    tiers = rankings.observed_tiers
    tied = ((tiers == 0) | (tiers == PAD)).all(1)
    if tied.any():
        n_tied, n = int(tied.sum()), len(rankings)
        warnings.warn(
            f"{n_tied} of {n} rankings put every response in one tier (all tied); they say nothing about "
            "which response is better or which cluster they came from"
            + (". With every ranking tied the clusters cannot be told apart: the posteriors tend to the "
               "mixing weights." if n_tied == n else "; EM fits on the others."),
            RuntimeWarning,
            stacklevel=3,
        )


LIKELIHOOD_FALL = 1e-6
"""Relative fall of the log-likelihood per ranking between two EM iterations that counts as one."""


def likelihood_falls(history: list[float], became_exact: int | None = None) -> list[int]:
    """The iterations (counted from 0, as iter-NNNN) whose log-likelihood per ranking fell below the
    one before. Soft EM never lowers it when each M-step raises its own weighted objective, so a fall
    says an M-step lowered it (with estimated scores, a stochastic M-step or weights dropped below
    gamma_min a small fall can also be noise; hard EM may lower it). ``became_exact``: the iteration
    whose scores were exact after estimated ones (an exact fallback), not compared with the one before."""
    return [t for t in range(1, len(history))
            if t != became_exact and history[t - 1] - history[t] > LIKELIHOOD_FALL * abs(history[t - 1])]


def estimates_off_by(relative_error: float | None) -> str:
    """How far off an exact fallback found the estimates (the scorer's ``fell_back["relative_error"]``;
    None where they were not finite), as the train log and the report say it."""
    return "not finite" if relative_error is None else \
        f"off by {relative_error:.2f} times the spread of the exact scores"


def _warn_if_the_likelihood_fell(history: list[float], iteration: int, across_draws: bool = False) -> None:
    if not likelihood_falls(history[-2:]):
        return
    fell = f"EM iteration {iteration}: the log-likelihood per ranking fell from {history[-2]:.6f} to {history[-1]:.6f}"
    why = (" between two draws of anchors; under this iteration's anchors the M-step did not lower it "
           "(train.backtracks compared them), so the fall is the estimates': raise train.anchors, set it to null for "
           "exact scores, or let train.exact_fallback switch to them when they fail" if across_draws else
           ". EM only lowers it when an M-step lowers its own weighted objective: for the LoRA adapters, steps too "
           "large (lower train.lr, or let train.backtracks redo such an M-step at half the rate) or too few to "
           "recover from the last ones (raise train.epochs). A small fall can also come from estimated scores "
           "(anchors) or from the weights below train.gamma_min that the M-step drops")
    warnings.warn(fell + why, RuntimeWarning, stacklevel=3)


def _warn_on_empty_clusters(alpha: torch.Tensor, n: int, iteration: int) -> None:
    empty = (alpha * n < 0.5).nonzero().flatten().tolist()
    if empty:
        warnings.warn(
            f"EM iteration {iteration}: cluster(s) {empty} hold less than half a ranking "
            f"(alpha = {[round(alpha[c].item(), 8) for c in empty]}); they keep their last parameters "
            "and receive no weight. Lower k or change the initialisation if this persists.",
            RuntimeWarning,
            stacklevel=3,
        )


START_FILE = "start.parquet"


def posteriors_table(example_ids: tuple[str, ...] | None, gamma: torch.Tensor) -> pa.Table:
    """Responsibilities float64 [n, k] as (example_id, gamma, assigned); ids "0".."n-1" when None."""
    ids = list(example_ids) if example_ids is not None else [str(i) for i in range(gamma.shape[0])]
    return pa.table({
        "example_id": pa.array(ids, pa.string()),
        "gamma": pa.array(gamma.tolist(), pa.list_(pa.float64())),
        "assigned": pa.array(gamma.argmax(1).tolist(), pa.int32()),
    })


def read_posteriors(path: Path, example_ids: tuple[str, ...] | None = None) -> torch.Tensor:
    """A `posteriors_table` file as float64 [n, k], checked against ``example_ids`` (same order) when given."""
    table = pq.read_table(path, columns=["example_id", "gamma"]).to_pydict()
    if example_ids is not None and tuple(table["example_id"]) != tuple(example_ids):
        raise ValueError(f"{path} holds posteriors of other rankings than these ({len(table['example_id'])} "
                         f"ids against {len(example_ids)}, or in another order)")
    return torch.tensor(table["gamma"], dtype=torch.float64)


def save_start(restart_dir: Path, gamma: torch.Tensor, example_ids: tuple[str, ...] | None) -> Path:
    """Write the responsibilities a restart starts from (``restart_dir/start.parquet``, atomically)."""
    restart_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(restart_dir / START_FILE) as tmp:
        pq.write_table(posteriors_table(example_ids, gamma), tmp)
    return restart_dir / START_FILE


def load_start(restart_dir: Path, example_ids: tuple[str, ...] | None) -> torch.Tensor | None:
    """The start `save_start` wrote for this restart, or None when there is none yet."""
    path = restart_dir / START_FILE
    if not path.is_file():
        return None
    return read_posteriors(path, example_ids)


def save_checkpoint(
    restart_dir: Path,
    state: EMState,
    example_ids: tuple[str, ...] | None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``iter-NNNN/`` (posteriors.parquet, state.pt, ``extra_files(iter_dir)``, then state.json
    last) atomically, then delete the earlier iterations' state.pt: only the last whole iteration's is
    needed to resume, and with a large model each is gigabytes (adapters and both Adam moments)."""
    it_dir = restart_dir / f"iter-{state.iteration:04d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(it_dir / "posteriors.parquet") as tmp:
        pq.write_table(posteriors_table(example_ids, state.gamma), tmp)
    payload = {"gamma": state.gamma, "alpha": state.alpha, "scorer": state.scorer_state}
    with atomic_path(it_dir / "state.pt") as tmp:
        torch.save(payload, tmp)
    if extra_files is not None:
        extra_files(it_dir)
    summary = {
        "restart": state.restart,
        "iteration": state.iteration,
        "alpha": state.alpha.tolist(),
        "log_likelihood": state.log_likelihood,
        "history": state.history,
        "step_halvings": state.halvings,
        "converged": state.converged,
    }
    with atomic_path(it_dir / "state.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2))
    _keep_only_the_last_state(restart_dir, it_dir)
    return it_dir


def _keep_only_the_last_state(restart_dir: Path, last: Path) -> None:
    """Delete every iteration's state.pt but ``last``'s: a resume needs the last whole iteration's only."""
    for older in restart_dir.glob("iter-*/state.pt"):
        if older.parent != last:
            older.unlink()


def load_last_checkpoint(restart_dir: Path) -> EMState | None:
    """The last iteration whose state.json exists (written last, so the iteration is whole)."""
    if not restart_dir.is_dir():
        return None
    done = sorted((p.parent for p in restart_dir.glob("iter-*/state.json")), key=lambda d: int(d.name[5:]))
    if not done:
        return None
    summary = json.loads((done[-1] / "state.json").read_text())
    payload = torch.load(done[-1] / "state.pt", weights_only=False)
    return EMState(
        restart=summary["restart"],
        iteration=summary["iteration"],
        gamma=payload["gamma"],
        alpha=payload["alpha"],
        history=summary["history"],
        converged=summary["converged"],
        scorer_state=payload["scorer"],
        halvings=summary["step_halvings"],
    )
