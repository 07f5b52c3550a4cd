"""Synthetic mixtures of rankings (paper appendix B.1).

Each response is a list of k integers; cluster c ranks responses by their c-th integer. With Gumbel
noise of scale s > 0 on the utilities, a ranking of cluster c is an exact Plackett-Luce draw with
scores ``value[c] / s``, so the true model exists and its posterior is the oracle. With s = 0 the
ranking is deterministic and equal integers form tied tiers.

Augmentation appends m' - m extra responses that every ranking leaves in the unordered bottom set:
``below`` draws their integers strictly below every original's (every cluster truly ranks them last);
``random`` draws them like the originals (the misspecified case).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

from moplex_core.pl import UNRANKED

SOURCE = "synthetic"


@dataclass(frozen=True)
class SyntheticConfig:
    n: int = 2000
    k: int = 3
    m: int = 4
    n_values: int = 10
    """Integers are drawn uniformly from [0, n_values)."""
    noise: float = 1.0
    """Gumbel scale on the utilities; 0 gives deterministic rankings (ties become tiers)."""
    n_generated: int = 0
    """m' - m extra responses below the originals."""
    augment_mode: Literal["below", "random"] = "below"
    alpha: tuple[float, ...] | None = None
    """Cluster proportions; uniform when None."""
    seed: int = 0


@dataclass
class SyntheticRankings:
    """n rankings over m' = m + n_generated responses. Arrays are numpy, row i is ranking i."""

    config: SyntheticConfig
    values: np.ndarray  # int64 [n, m', k]: the k integers of every response
    tiers: np.ndarray  # int64 [n, m']: tier codes of moplex_core.pl (generated = UNRANKED)
    labels: np.ndarray  # int64 [n]: true cluster of each ranking

    @property
    def n_slots(self) -> int:
        return self.values.shape[1]

    def true_scores(self) -> torch.Tensor:
        """Scores of the true PL mixture, float64 [n, k, m'] (only defined for noise > 0)."""
        if self.config.noise <= 0:
            raise ValueError("true PL scores exist only for noise > 0 (noise=0 is a degenerate limit)")
        v = torch.as_tensor(self.values, dtype=torch.float64)  # [n, m', k]
        return v.permute(0, 2, 1) / self.config.noise

    def true_alpha(self) -> torch.Tensor:
        k = self.config.k
        a = self.config.alpha or (1.0 / k,) * k
        return torch.tensor(a, dtype=torch.float64)

    def features(self) -> torch.Tensor:
        """Response features for the linear scorer: the integers, float64 [n, m', k]."""
        return torch.as_tensor(self.values, dtype=torch.float64)

    def subset(self, idx: np.ndarray) -> SyntheticRankings:
        return SyntheticRankings(self.config, self.values[idx], self.tiers[idx], self.labels[idx])

    def to_frame(self, split: np.ndarray | None = None) -> pd.DataFrame:
        """The canonical `rankings` rows (DESIGN.md 3) with responses rendered as text.

        Generated responses go to a `generated` column (the `augmented` contract); `responses` holds
        the m originals only.
        """
        m = self.config.m
        rows = []
        for i in range(len(self.labels)):
            prompt = f"Synthetic example {self.config.seed}-{i}: which list of numbers is best?"
            texts = [render_response(v) for v in self.values[i]]
            order = self.tiers[i, :m]
            ranking = [
                [int(j) for j in np.flatnonzero(order == t)] for t in sorted(set(order.tolist()))
            ]
            rows.append(
                {
                    "example_id": _short_hash(f"{SOURCE}:{self.config.seed}:{i}:{self.labels[i]}"),
                    "prompt_id": _short_hash(prompt),
                    "prompt": prompt,
                    "responses": texts[:m],
                    "generated": texts[m:],
                    "ranking": ranking,
                    "ranked_prefix": len(ranking),
                    "cluster": f"c{self.labels[i]}",
                    "split": None if split is None else str(split[i]),
                    "source": SOURCE,
                }
            )
        return pd.DataFrame(rows)


def render_response(values: np.ndarray) -> str:
    """The text of one synthetic response, e.g. "[3, 1, 2]" (paper appendix B.1)."""
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def generate_synthetic(config: SyntheticConfig) -> SyntheticRankings:
    """Draw ``config.n`` rankings from the synthetic mixture; deterministic in ``config.seed``."""
    if config.k < 1 or config.m < 2 or config.n < 1:
        raise ValueError(f"need k >= 1, m >= 2, n >= 1; got k={config.k}, m={config.m}, n={config.n}")
    rng = np.random.default_rng(config.seed)
    n, k, m, g = config.n, config.k, config.m, config.n_generated
    alpha = np.full(k, 1.0 / k) if config.alpha is None else np.asarray(config.alpha, dtype=float)
    if alpha.shape != (k,) or not np.isclose(alpha.sum(), 1.0) or (alpha < 0).any():
        raise ValueError(f"alpha must be {k} non-negative proportions summing to 1, got {config.alpha}")

    labels = rng.choice(k, size=n, p=alpha)
    originals = rng.integers(0, config.n_values, size=(n, m, k))
    if config.augment_mode == "below":
        extra = rng.integers(-config.n_values, 0, size=(n, g, k))
    elif config.augment_mode == "random":
        extra = rng.integers(0, config.n_values, size=(n, g, k))
    else:
        raise ValueError(f"augment_mode must be 'below' or 'random', got {config.augment_mode!r}")
    values = np.concatenate([originals, extra], axis=1)

    utility = originals[np.arange(n), :, labels].astype(np.float64)  # [n, m]
    if config.noise > 0:
        utility = utility + config.noise * rng.gumbel(size=(n, m))
    # Tier = number of distinct utilities strictly above (ties only possible when noise == 0).
    tiers_orig = (utility[:, None, :] > utility[:, :, None]).sum(-1)  # [n, m] rank with gaps
    tiers_orig = np.stack([np.unique(t, return_inverse=True)[1] for t in tiers_orig])
    tiers = np.concatenate([tiers_orig, np.full((n, g), UNRANKED)], axis=1).astype(np.int64)
    return SyntheticRankings(config, values.astype(np.int64), tiers, labels.astype(np.int64))


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
