"""The M-step shared by scorers whose per-cluster log-likelihood is concave in their parameters.

A scorer with a parameter tensor theta [k, p] and a differentiable map (theta, inputs) -> scores
[n, k, M] minimises the weighted negative log-likelihood of the rankings' observation model (PL or
Bradley-Terry pairs) plus a small ridge term,

    f(theta) = - (1/n) sum_ic w_ic log P(sigma_i | scores_ic(theta)) + (l2 / 2) ||theta||^2,

with full-batch L-BFGS (strong Wolfe line search), warm-started from the previous iteration. The
ridge term fixes PL's shift invariance and keeps items that never win finite.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from moplex_core.em import Rankings
from moplex_core.pl import score_gradient_at_zero


class ConvexScorer(ABC):
    """Base class: subclasses set ``self.theta`` ([k, p] float64) and define the two maps below.
    Inputs may be tensors, numpy arrays or nested lists (`_tensor`)."""

    k: int
    theta: torch.Tensor

    def __init__(self, l2: float = 1e-6, max_lbfgs_iter: int = 200, tolerance: float = 1e-10) -> None:
        self.l2 = l2
        self.max_lbfgs_iter = max_lbfgs_iter
        self.tolerance = tolerance

    @abstractmethod
    def _scores(self, theta: torch.Tensor, inputs: Any) -> torch.Tensor:
        """float64 [n, k, M], differentiable in theta."""

    @abstractmethod
    def _project(self, slot_weights: torch.Tensor, inputs: Any) -> torch.Tensor:
        """Map per-slot weights [n, M] to a feature vector per ranking [n, d]."""

    def score(self, inputs: Any, iteration: int = 0) -> torch.Tensor:
        with torch.no_grad():
            return self._scores(self.theta, self._tensor(inputs))

    def fit(self, inputs: Any, rankings: Rankings, weights: torch.Tensor, iteration: int = 0) -> None:
        n = len(rankings)
        inputs = self._tensor(inputs)
        theta = self.theta.clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS(
            [theta],
            lr=1.0,
            max_iter=self.max_lbfgs_iter,
            tolerance_grad=self.tolerance,
            tolerance_change=self.tolerance * 1e-2,
            history_size=20,
            line_search_fn="strong_wolfe",
        )

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            logp = rankings.log_likelihood(self._scores(theta, inputs))  # [n, k]
            loss = -(weights * logp).sum() / n + 0.5 * self.l2 * theta.pow(2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        self.theta = theta.detach()

    def ranking_features(self, inputs: Any, rankings: Rankings) -> torch.Tensor:
        return self._project(score_gradient_at_zero(rankings.index, rankings.model), self._tensor(inputs))

    def _tensor(self, inputs: Any) -> torch.Tensor:
        """The inputs as the tensor the two maps take: float64 here."""
        return torch.as_tensor(inputs, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta = state["theta"].clone()
