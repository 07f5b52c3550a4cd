"""A per-cluster linear model on response features: r_c(y) = <w_c, phi(y)>.

inputs: float64 [n, M, d] response features, zeros at padding slots (NaN there would poison gradients).
"""

from __future__ import annotations

import torch

from moplex_core.scorers.convex import ConvexScorer


class LinearScorer(ConvexScorer):
    def __init__(self, k: int, n_features: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k
        self.theta = torch.zeros(k, n_features, dtype=torch.float64)  # weights [k, d]

    def _scores(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nmd,kd->nkm", inputs, theta)

    def _project(self, slot_weights: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nm,nmd->nd", slot_weights, inputs)
