"""Synthetic mixtures of rankings (paper appendix B.1).

Each response is a list of k integers; cluster c ranks responses by their c-th integer. With Gumbel
noise of scale s > 0 on the utilities, a ranking of cluster c is an exact Plackett-Luce draw with
scores ``value[c] / s``, so the true model exists and its posterior is the oracle. With s = 0 the
ranking is deterministic and equal integers form tied tiers.

Augmentation appends m' - m extra responses. In ``below`` and ``random`` mode the ranking orders the
m originals only and leaves the extras in the unordered bottom set, whatever their values — the
paper's approximation: ``below`` draws their integers strictly below every original's (with noise > 0
a cluster can still prefer one, rarely), ``random`` draws them like the originals (misspecified).
Either way the extras carry no information about the cluster in the data itself.
``top_m`` is the space of the paper's Proposition 2: all m' responses are drawn alike, ranked by the
cluster's noisy utilities, and only the top m places are observed (``ranked_prefix`` = m); which
responses reach the top varies with the cluster. It needs noise > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

from moplex_core.hashing import short_hash
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
    """m' - m extra responses (where they go: ``augment_mode``)."""
    augment_mode: Literal["below", "random", "top_m"] = "below"
    alpha: tuple[float, ...] | None = None
    """Cluster proportions; uniform when None."""
    seed: int = 0

    def __post_init__(self) -> None:
        # The pipeline's SyntheticOptions checks these for its settings; a library caller gets them here.
        low = {"n": 1, "k": 1, "m": 2, "n_values": 1, "n_generated": 0, "seed": 0}
        bad = [f"{name} = {getattr(self, name)} (at least {least})" for name, least in low.items()
               if getattr(self, name) < least]
        if not self.noise >= 0:
            bad.append(f"noise = {self.noise} (at least 0)")
        if bad:
            raise ValueError(f"SyntheticConfig: {', '.join(bad)}")


@dataclass
class SyntheticRankings:
    """n rankings over m' = m + n_generated responses. Arrays are numpy, row i is ranking i."""

    config: SyntheticConfig
    values: np.ndarray  # int64 [n, m', k]: the k integers of every response
    tiers: np.ndarray  # int64 [n, m']: tier codes of moplex_core.pl (generated = UNRANKED)
    labels: np.ndarray  # int64 [n]: true cluster of each ranking
    ranked_prefix: np.ndarray | None = None  # int64 [n]: observed tiers (top_m mode), else all

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
        prefix = None if self.ranked_prefix is None else self.ranked_prefix[idx]
        return SyntheticRankings(self.config, self.values[idx], self.tiers[idx], self.labels[idx], prefix)

    def to_frame(self, split: np.ndarray | None = None) -> pd.DataFrame:
        """The canonical `rankings` rows (DESIGN.md 3) with responses rendered as text.

        Generated responses go to a `generated` column (the `augmented` contract); `responses` holds
        the m originals only. In ``top_m`` mode every response is ranked, so all m' are `responses`.
        """
        m = self.n_slots if self.config.augment_mode == "top_m" else self.config.m
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
                    "example_id": short_hash(f"{SOURCE}:{self.config.seed}:{i}:{self.labels[i]}"),
                    "prompt_id": short_hash(prompt),
                    "prompt": prompt,
                    "responses": texts[:m],
                    "generated": texts[m:],
                    "ranking": ranking,
                    "ranked_prefix": len(ranking) if self.ranked_prefix is None else int(self.ranked_prefix[i]),
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
    elif config.augment_mode in ("random", "top_m"):
        extra = rng.integers(0, config.n_values, size=(n, g, k))
    else:
        raise ValueError(f"augment_mode must be 'below', 'random' or 'top_m', got {config.augment_mode!r}")
    if config.augment_mode == "top_m" and config.noise <= 0:
        raise ValueError("augment_mode='top_m' needs noise > 0 (the top m must be a strict PL draw)")
    values = np.concatenate([originals, extra], axis=1)

    ranked = m + g if config.augment_mode == "top_m" else m  # responses the ranking orders
    utility = values[np.arange(n), :ranked, labels].astype(np.float64)  # [n, ranked]
    if config.noise > 0:
        utility = utility + config.noise * rng.gumbel(size=(n, ranked))
    # Tier = number of distinct utilities strictly above (ties only possible when noise == 0).
    tiers_ranked = (utility[:, None, :] > utility[:, :, None]).sum(-1)  # [n, ranked] rank with gaps
    tiers_ranked = np.stack([np.unique(t, return_inverse=True)[1] for t in tiers_ranked])
    tiers = np.concatenate([tiers_ranked, np.full((n, m + g - ranked), UNRANKED)], axis=1).astype(np.int64)
    prefix = np.full(n, m, dtype=np.int64) if config.augment_mode == "top_m" else None
    return SyntheticRankings(config, values.astype(np.int64), tiers, labels.astype(np.int64), prefix)
