"""The classical PL mixture: a free utility per item per cluster (choix's model, k clusters).

inputs: int64 [n, M] item ids into a pool of ``n_items`` (-1 at padding slots).
"""

from __future__ import annotations

from typing import Any

import torch

from moplex_core.em.types import as_integers
from moplex_core.scorers.convex import ConvexScorer


class ItemScorer(ConvexScorer):
    def __init__(self, k: int, n_items: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k
        self.n_items = n_items
        self.theta = torch.zeros(k, n_items, dtype=torch.float64)  # utilities [k, n_items]

    def _scores(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        ids = inputs.clamp_min(0)  # padding slots read item 0; the likelihood ignores them
        return theta[:, ids].permute(1, 0, 2)  # [k, n, M] -> [n, k, M]

    def _tensor(self, inputs: Any) -> torch.Tensor:
        ids = as_integers(inputs, "ItemScorer's inputs (item ids)")  # int64; an id of 1.5 is refused
        outside = (ids >= self.n_items) | (ids < -1)
        if outside.any():
            rows = outside.any(1).nonzero().flatten().tolist() if ids.ndim == 2 else []
            held = sorted(set(ids[outside].tolist()))[:5]
            raise ValueError(f"ItemScorer's item ids must be in 0..{self.n_items - 1} (-1 at padding); rankings "
                             f"{rows[:5]}{' ...' if len(rows) > 5 else ''} hold {held}")
        return ids

    def _project(self, slot_weights: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        n = inputs.shape[0]
        features = torch.zeros(n, self.n_items, dtype=torch.float64)
        return features.scatter_add_(1, inputs.clamp_min(0), torch.where(inputs >= 0, slot_weights, 0.0))
