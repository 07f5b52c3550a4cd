"""EM when an M-step lowers the log-likelihood: the warning, backtracking (the M-step redone at a
smaller step), estimated scores that fall back to exact ones, and resuming such runs."""

import shutil
import warnings

import numpy as np
import pytest
import torch

from moplex_core.em import EMConfig, fit_mixture, likelihood_falls, load_last_checkpoint, soft_one_hot
from moplex_core.scorers.linear import LinearScorer

from em_fixtures import synthetic


def test_soft_em_warns_when_an_m_step_lowered_the_likelihood_and_hard_em_does_not():
    class Spoiling(LinearScorer):  # M-step 2 ends with every preference turned around
        def fit(self, inputs, rankings, weights, iteration=0):
            super().fit(inputs, rankings, weights, iteration)
            if iteration == 2:
                self.theta = -self.theta

    _, rankings, x = synthetic(k=2, m=4, n=200)
    with pytest.warns(RuntimeWarning, match=r"EM iteration 2: the log-likelihood per ranking fell from"):
        result, _ = fit_mixture(lambda: Spoiling(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0))
    assert 2 in likelihood_falls(result.best.history)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, _ = fit_mixture(lambda: Spoiling(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0, hard=True))
    assert 2 in likelihood_falls(result.best.history)
    assert not [w for w in caught if "fell from" in str(w.message)]
    assert likelihood_falls([-3.0, -2.9, -2.9 - 1e-9, -2.95]) == [3]  # rounding is not a fall


class Overshooting(LinearScorer):
    """Its M-step moves 4 x scale_steps' factor as far as the L-BFGS optimum: past it at 1 and 2,
    onto it at 1/4, so only a backtracked M-step raises the log-likelihood."""

    step = 1.0

    def scale_steps(self, factor):
        self.step = factor

    def fit(self, inputs, rankings, weights, iteration=0):
        before = self.theta
        super().fit(inputs, rankings, weights, iteration)
        self.theta = before + 4 * self.step * (self.theta - before)


def test_backtracking_redoes_an_m_step_that_lowered_the_likelihood_and_resumes_alike(tmp_path):
    _, rankings, x = synthetic(k=2, m=4, n=200)
    with pytest.warns(RuntimeWarning, match="fell from"):
        plain, _ = fit_mixture(lambda: Overshooting(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0))
    assert likelihood_falls(plain.best.history) == [1, 3] and plain.best.halvings == [0, 0, 0, 0]

    config = EMConfig(k=2, max_iter=4, tol=0, backtracks=2)

    def copy_after_iteration_1(state):  # the checkpoints a kill after iteration 1 would leave
        if state.iteration == 1:
            shutil.copytree(tmp_path / "run", tmp_path / "killed")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall left to warn about
        result, scorer = fit_mixture(lambda: Overshooting(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "run",
                                     on_iteration=copy_after_iteration_1)
    assert likelihood_falls(result.best.history) == [] and result.best.halvings == [0, 2, 1, 1]
    assert result.best.history[-1] > plain.best.history[0] and scorer.step == 1.0  # the next M-step starts at 1
    assert load_last_checkpoint(tmp_path / "run" / "restart-00").halvings == [0, 2, 1, 1]

    again, _ = fit_mixture(lambda: Overshooting(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "killed")
    assert again.best.history == result.best.history and again.best.halvings == [0, 2, 1, 1]
    torch.testing.assert_close(again.best.gamma, result.best.gamma, rtol=0, atol=0)

    hard, _ = fit_mixture(lambda: Overshooting(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0, hard=True,
                                                                              backtracks=2))
    assert hard.best.halvings == [0, 0, 0, 0]  # hard EM may lower the likelihood: it never backtracks
    with pytest.raises(ValueError, match="backtracks must be >= 0"):
        EMConfig(backtracks=-1)


class Drawing(Overshooting):
    """An estimating scorer (``estimates``) whose M-step does not move it at all, and whose E-step
    scores carry a noise of their iteration's own (as the LoRA scorer's anchors are drawn anew each
    iteration): any fall of its log-likelihood comes from the draws, none from an M-step."""

    estimates = True

    def fit(self, inputs, rankings, weights, iteration=0):
        pass

    def score(self, inputs, iteration=0, check=True):
        noise = torch.randn(super().score(inputs, iteration).shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(iteration))
        return super().score(inputs, iteration) + 0.3 * noise


def test_backtracking_with_estimated_scores_compares_one_draw_before_and_after_the_m_step():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    with pytest.warns(RuntimeWarning, match="fell from"):  # the draws alone lower it between iterations
        plain, _ = fit_mixture(lambda: Drawing(2, 2), x, rankings, EMConfig(k=2, max_iter=5, tol=0))
    assert likelihood_falls(plain.best.history)
    with pytest.warns(RuntimeWarning, match="between two draws of anchors; under this iteration's anchors the "
                                            "M-step did not lower it") as caught:
        result, _ = fit_mixture(lambda: Drawing(2, 2), x, rankings, EMConfig(k=2, max_iter=5, tol=0, backtracks=2))
    assert not [w for w in caught if "steps too large" in str(w.message)]  # not blamed on the M-step
    assert result.best.halvings == [0] * 5  # nothing for a smaller step to mend: no M-step redone
    assert result.best.history == plain.best.history


def test_a_start_from_labels_is_soft_one_hot_and_all_ones_for_one_cluster():
    torch.testing.assert_close(soft_one_hot(np.array([1, 0]), 3), torch.tensor(
        [[0.05, 0.9, 0.05], [0.9, 0.05, 0.05]], dtype=torch.float64))
    torch.testing.assert_close(soft_one_hot(np.array([0, 0]), 1), torch.ones(2, 1, dtype=torch.float64))


class FallingBack(Overshooting):
    """A scorer whose E-step "estimates" fail at iteration 1 (the LoRA scorer's exact_fallback) once
    its step is below ``fail_below``; its step size is part of its state, as AdamW's learning rate is.
    It records each M-step's iteration, whether it ran exact, its step and its starting theta."""

    exact_fallback = 1

    def __init__(self, *args, fail_below=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.fell_back, self.fits, self.fail_below = None, [], fail_below

    def fit(self, inputs, rankings, weights, iteration=0):
        self.fits.append((iteration, self.fell_back is not None, self.step, self.theta.clone()))
        super().fit(inputs, rankings, weights, iteration)

    def score(self, inputs, iteration=0):
        if iteration == 1 and self.fell_back is None and self.step < self.fail_below:
            self.fell_back = {"iteration": 1, "relative_error": 2.0}
        return super().score(inputs, iteration)

    def state_dict(self):
        return {**super().state_dict(), "fell_back": self.fell_back, "step": self.step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.fell_back, self.step = state["fell_back"], state["step"]


def test_an_m_step_whose_estimates_then_failed_is_redone_exact_from_the_same_state():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    result, scorer = fit_mixture(lambda: FallingBack(2, 2), x, rankings, EMConfig(k=2, max_iter=3, tol=0))
    assert [fit[:3] for fit in scorer.fits] == [(0, False, 1.0), (1, False, 1.0), (1, True, 1.0), (2, True, 1.0)]
    torch.testing.assert_close(scorer.fits[1][3], scorer.fits[2][3], rtol=0, atol=0)  # the redo starts where it did
    assert len(result.best.history) == 3 and scorer.fell_back == {"iteration": 1, "relative_error": 2.0}
    # with backtracking: the LL falls after M-step 1 at step 1, the halved attempt's estimates fail, and the
    # exact redo keeps that attempt's half step (restoring the state restores the full one), then stops
    _, scorer = fit_mixture(lambda: FallingBack(2, 2, fail_below=1.0), x, rankings,
                            EMConfig(k=2, max_iter=2, tol=0, backtracks=2))
    assert [fit[:3] for fit in scorer.fits] == [(0, False, 1.0), (1, False, 1.0), (1, False, 0.5), (1, True, 0.5)]


def test_estimates_that_are_not_finite_fall_back_to_exact_scores_instead_of_stopping_em():
    class NaNEstimates(FallingBack):  # E-step 1's "estimates" are NaN, as an overflowing input gradient makes them
        def score(self, inputs, iteration=0):
            scores = super().score(inputs, iteration)
            return scores * float("nan") if self.fell_back is not None and not self.fits[-1][1] else scores

    _, rankings, x = synthetic(k=2, m=4, n=200)
    result, scorer = fit_mixture(lambda: NaNEstimates(2, 2, fail_below=2.0), x, rankings,
                                 EMConfig(k=2, max_iter=3, tol=0))
    assert [fit[:2] for fit in scorer.fits] == [(0, False), (1, False), (1, True), (2, True)]
    assert all(np.isfinite(result.best.history))


class Diverging(Overshooting):
    """Its full step at iteration 2 leaves scores that are inf (the clearest fall); half steps do not."""

    def fit(self, inputs, rankings, weights, iteration=0):
        super().fit(inputs, rankings, weights, iteration)
        if iteration == 2 and self.step == 1.0:
            self.theta = self.theta * float("inf")


def test_backtracking_redoes_an_m_step_whose_scores_diverged_and_without_it_em_stops():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    result, _ = fit_mixture(lambda: Diverging(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0, backtracks=2))
    assert result.best.halvings[2] >= 1 and all(np.isfinite(result.best.history))
    with pytest.raises(FloatingPointError, match="EM iteration 2: .* inf or NaN"):
        fit_mixture(lambda: Diverging(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0))


class BiasedEstimates(FallingBack):
    """Estimates (before its exact fallback at E-step 2) carry a bias toward each ranking's observed
    order, so the estimated LL is above the exact one: the switch alone "lowers" it."""

    def __init__(self, *args, rankings, **kwargs):
        super().__init__(*args, fail_below=0.0, **kwargs)  # FallingBack's own failure never comes
        self.tiers = rankings.tiers.to(torch.float64).clamp(min=0)  # 0 = best tier

    @property
    def estimates(self):
        return self.fell_back is None

    def score(self, inputs, iteration=0, check=True):
        scores = super().score(inputs, iteration)
        if self.fell_back is None:
            if check and iteration == 2:
                self.fell_back = {"iteration": 2, "relative_error": 3.0}
            scores = scores - 0.7 * self.tiers.unsqueeze(1)
        return scores


def test_the_iteration_that_falls_back_to_exact_scores_is_not_compared_with_the_estimated_one_before():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, scorer = fit_mixture(lambda: BiasedEstimates(2, 2, rankings=rankings), x, rankings,
                                     EMConfig(k=2, max_iter=4, tol=0, backtracks=2))
    history = result.best.history
    assert scorer.fell_back["iteration"] == 2 and history[2] < history[1]  # the switch alone "fell"
    assert 2 in likelihood_falls(history) and 2 not in likelihood_falls(history, became_exact=2)
    assert not [w for w in caught if "EM iteration 2:" in str(w.message)]


class DrawingOvershooting(Overshooting):
    """Overshooting M-steps and an E-step noise of each iteration's own (anchors drawn anew)."""

    estimates = True

    def score(self, inputs, iteration=0, check=True):
        scores = super().score(inputs, iteration)
        noise = torch.randn(scores.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + iteration))
        return scores + 0.5 * noise


def test_a_fall_between_draws_is_blamed_on_the_step_only_where_the_kept_m_step_fell_under_its_draw(monkeypatch):
    from moplex_core.em import fit as em

    under_draw = []  # (iteration, checked, LL): the look before each M-step is the unchecked one
    real_posteriors = em.posteriors

    def recording(scorer, inputs, rankings, alpha, iteration=0, **options):
        gamma, ll = real_posteriors(scorer, inputs, rankings, alpha, iteration, **options)
        under_draw.append((iteration, options.get("check", True), ll.mean().item()))
        return gamma, ll

    monkeypatch.setattr(em, "posteriors", recording)
    _, rankings, x = synthetic(k=2, m=4, n=200)
    blamed = {}
    for backtracks in (1, 2):  # one halving leaves overshooting M-steps that fall under their own draw; two do not
        under_draw.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit_mixture(lambda: DrawingOvershooting(2, 2), x, rankings,
                        EMConfig(k=2, max_iter=6, tol=0, backtracks=backtracks))
        for t in range(1, 6):
            before = next(ll for it, checked, ll in under_draw if it == t and not checked)
            after = [ll for it, _, ll in under_draw if it == t][-1]
            messages = [str(w.message) for w in caught if f"EM iteration {t}:" in str(w.message)]
            if any("steps too large" in m for m in messages):
                blamed.setdefault(backtracks, []).append(t)
                assert likelihood_falls([before, after]), (backtracks, t)  # it did fall under its own draw
            if any("between two draws" in m for m in messages):
                assert not likelihood_falls([before, after]), (backtracks, t)
                blamed.setdefault(f"draws {backtracks}", []).append(t)
    assert blamed == {1: [1, 3, 5], "draws 2": [3, 5]}

    # An estimating scorer that cannot scale its steps is not compared under one draw: no claim that it was.
    class NoSteps(DrawingOvershooting):
        scale_steps = None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_mixture(lambda: NoSteps(2, 2), x, rankings, EMConfig(k=2, max_iter=6, tol=0, backtracks=2))
    assert not [w for w in caught if "train.backtracks compared them" in str(w.message)]


def test_a_draw_whose_estimates_are_not_finite_before_the_m_step_does_not_stop_em():
    class NaNBefore(DrawingOvershooting):  # iteration 2's look before its M-step scores NaN, the E-step after does not
        def score(self, inputs, iteration=0, check=True):
            scores = super().score(inputs, iteration, check)
            return scores * float("nan") if iteration == 2 and not check else scores

    _, rankings, x = synthetic(k=2, m=4, n=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result, _ = fit_mixture(lambda: NaNBefore(2, 2), x, rankings, EMConfig(k=2, max_iter=4, tol=0, backtracks=2))
    assert len(result.best.history) == 4 and all(np.isfinite(result.best.history))
