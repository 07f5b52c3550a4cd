"""The EM loop: E-step posteriors, M-steps through the scorer, restarts, backtracking, and the
warnings a run gives."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moplex_core.em.checkpoints import (
    claim_checkpoint_dir,
    keep_only_the_last_state,
    load_last_checkpoint,
    load_start,
    save_checkpoint,
    save_start,
)
from moplex_core.em.start import different_start, initial_responsibilities
from moplex_core.em.types import EMConfig, EMResult, EMState, Rankings, Scorer
from moplex_core.pl import PAD

log = logging.getLogger(__name__)


def posteriors(
    scorer: Scorer, inputs: Any, rankings: Rankings, alpha: torch.Tensor, iteration: int = 0, **score_options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """E-step: (gamma float64 [n, k], per-ranking mixture log-likelihood float64 [n]) of the n rankings
    ``inputs`` holds, under mixing weights alpha [k] (e.g. ``EMResult.best.alpha``); ``score_options``
    go to ``scorer.score`` (an estimating scorer's ``check``).

    Scores of any finite size are fine (the likelihood is a logsumexp in float64); a non-finite
    score of a response in a slate raises `FloatingPointError` instead of spreading NaN."""
    scores = scorer.score(inputs, iteration, **score_options)  # [n, k, M]
    alpha = _checked_alpha(scores, rankings, alpha)
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
    """gamma_ic = softmax_c(log alpha_c + log P_c(sigma_i)) from scores [n, k, M] (slot j of ranking i
    is ``rankings.tiers[i, j]``'s response) and alpha [k] (a tensor, numpy array or list); also the
    per-ranking mixture log-likelihood logsumexp_c(...) [n]. Empty clusters (alpha = 0) get gamma 0
    exactly, however well they score (log 0 = -inf; a clamped alpha would lose to a 1e3-nat margin)."""
    alpha = _checked_alpha(scores, rankings, alpha)
    joint = torch.log(alpha).unsqueeze(0) + rankings.log_likelihood(scores)  # [n, k]
    ll = torch.logsumexp(joint, dim=1)
    return torch.exp(joint - ll.unsqueeze(1)), ll


def _checked_alpha(scores: torch.Tensor, rankings: Rankings, alpha: Any) -> torch.Tensor:
    """alpha as a tensor (float64 from numpy or a list), once scores [n, k, M], the rankings' tiers
    [n, M] and alpha [k] are seen to agree (else a torch broadcast error would name none of them)."""
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.as_tensor(alpha, dtype=torch.float64, device=scores.device)
    n, width = rankings.tiers.shape
    if scores.ndim != 3 or scores.shape[0] != n or scores.shape[2] != width or alpha.shape != scores.shape[1:2]:
        raise ValueError(f"scores must be [n, k, M] = [{n}, k, {width}] for {n} rankings of {width} slots, with alpha "
                         f"[k]; got scores {tuple(scores.shape)} and alpha {tuple(alpha.shape)}")
    return alpha


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
    if warm_start is not None:
        warm_start = torch.as_tensor(warm_start)  # numpy's too (its rows are checked, then used in float64)
        _check_warm_start(warm_start, len(rankings), config.k)
    _warn_on_tied_rankings(rankings)
    if checkpoint_dir is not None:
        claim_checkpoint_dir(Path(checkpoint_dir), config, rankings, warm_start)
    finished: list[EMState] = []
    starts: list[torch.Tensor] = []
    best: EMState | None = None
    for restart in range(config.restarts):
        scorer = make_scorer()  # the only scorer alive: on a GPU each holds a model
        if getattr(scorer, "k", config.k) != config.k:
            raise ValueError(f"make_scorer made a scorer of k = {scorer.k} clusters for EMConfig(k={config.k})")
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


def _check_warm_start(warm_start: torch.Tensor, n: int, k: int) -> None:
    """Refuse a start EM could not use: not [n, k], or rows that are not distributions over the
    k clusters (each would carry into alpha, gamma and the log-likelihood as NaN or a wrong scale)."""
    if tuple(warm_start.shape) != (n, k):
        raise ValueError(f"warm_start must be [n, k] = [{n}, {k}] (one row of cluster probabilities per "
                         f"ranking), got {list(warm_start.shape)}")
    start = warm_start.to(torch.float64)  # [n, k]
    bad = ~(start.isfinite().all(1) & (start >= 0).all(1) & ((start.sum(1) - 1).abs() <= 1e-6))  # [n]
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"warm_start row(s) {rows[:10]}{' ...' if len(rows) > 10 else ''} ({len(rows)} of {n}) "
                         f"are not probabilities over the k clusters (finite, >= 0, summing to 1); row "
                         f"{rows[0]} is {start[rows[0]].tolist()}")


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
        keep_only_the_last_state(restart_dir, restart_dir / f"iter-{state.iteration:04d}")  # a kill may have left one
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
                gamma = different_start(gamma, starts, config, scorer, inputs, rankings, seed, restart,
                                         drawn=warm_start is None)
            if restart_dir is not None:
                save_start(restart_dir, gamma, rankings.example_ids)
        if starts is not None:
            starts.append(gamma)
        gamma, history, start, halvings = (_one_hot(gamma) if config.hard else gamma), [], 0, []

    n = len(rankings)
    for iteration in range(start, config.max_iter):
        alpha = gamma.mean(0) if config.mixing == "learned" else torch.full_like(gamma[0], 1.0 / config.k)  # [k]
        _warn_on_empty_clusters(gamma.mean(0), n, iteration)  # no ranking to train it, whatever its weight
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
        converged = comparable and abs(history[-1] - history[-2]) <= config.tol * max(abs(history[-2]), 1.0)
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
    """Rankings with every response in one observed tier (`Rankings.all_tied`) order nothing. EM still
    runs; their likelihood is 1 under every cluster, so if every ranking is tied no cluster can be
    told apart and the posteriors are the mixing weights."""
    tied = rankings.all_tied
    if tied.any():
        n_tied, n = int(tied.sum()), len(rankings)
        warnings.warn(
            f"{n_tied} of {n} rankings put every response in one tier (all tied); they say nothing about "
            "which response is better or which cluster they came from"
            + (". With every ranking tied the clusters cannot be told apart: the posteriors are the "
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


def _warn_on_empty_clusters(share: torch.Tensor, n: int, iteration: int) -> None:
    """Warn of clusters whose share of the rankings (the mean of their responsibilities [k]) is below
    half a ranking: no ranking trains them."""
    empty = (share * n < 0.5).nonzero().flatten().tolist()
    if empty:
        warnings.warn(
            f"EM iteration {iteration}: cluster(s) {empty} hold less than half a ranking "
            f"(share {[round(share[c].item(), 8) for c in empty]}); they keep their last parameters, "
            "as no ranking trains them. Lower k or change the initialisation if this persists.",
            RuntimeWarning,
            stacklevel=3,
        )
