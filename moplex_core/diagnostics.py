"""Checks on generated responses once every response has a score (paper section 4.1).

The paper treats generated responses as ranked below every original (eq. 5) and reports that over
81% of them score below the originals under each criterion's ranking model; its Proposition 2
(identifiability with augmented responses) assumes the generated responses have distinct scores in
every cluster, which it checks by finding no equal scores at temperature 2 and a coefficient of
variation (std / mean) of the scores above 73%. `generated_score_diagnostics` measures both on our
scores; the evaluate stage reports them (DESIGN.md 7).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

COLUMNS = ("cluster", "rankings", "generated", "below_all_originals", "distinct_generated",
           "all_distinct_fraction", "mean", "std", "cv")


def generated_score_diagnostics(
    scores: torch.Tensor | np.ndarray,
    m: int,
    assigned: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    cluster_names: Sequence[str] | None = None,
    tol: float = 0.0,
) -> pd.DataFrame:
    """One row per cluster c, computed from cluster c's scores of the rankings assigned to c.

    scores:   [n, k, m'] score of every response of every ranking under every cluster's scorer;
              responses 0..m-1 are the originals, m..m'-1 the generated ones. NaN marks a missing
              generated response (a ranking kept with fewer, on_shortfall="keep_fewer").
    m:        number of original responses (the same for every ranking).
    assigned: [n] cluster index of every ranking (true label, or argmax of gamma); None uses every
              ranking for every cluster.
    tol:      two scores closer than or equal to ``tol`` count as equal (0: exact equality).

    Columns:
      rankings              rankings assigned to c
      generated             generated responses among them (non-NaN)
      below_all_originals   fraction of those scored strictly below every original of their ranking
      distinct_generated    sum over rankings of the number of distinct generated scores
      all_distinct_fraction fraction of rankings (with >= 1 generated) whose generated scores are
                            pairwise distinct (Proposition 2's assumption, per ranking)
      mean, std, cv         over all those generated scores; cv = std / |mean| (population std),
                            NaN when there are none or the mean is 0
    """
    values = scores.detach().cpu().double().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores, float)
    if values.ndim != 3:
        raise ValueError(f"scores must be [n, k, m'], got shape {values.shape}")
    n, k, slots = values.shape
    if not 1 <= m <= slots:
        raise ValueError(f"m = {m} original responses do not fit in m' = {slots} score columns")
    if np.isnan(values[:, :, :m]).any():
        raise ValueError("scores of original responses (columns 0..m-1) must not be NaN; NaN marks a missing "
                         "generated response only")
    if assigned is None:
        members = [np.arange(n)] * k
    else:
        labels = np.asarray(assigned.cpu() if isinstance(assigned, torch.Tensor) else assigned, dtype=np.int64)
        if labels.shape != (n,) or (labels < 0).any() or (labels >= k).any():
            raise ValueError(f"assigned must be {n} cluster indices in 0..{k - 1}")
        members = [np.flatnonzero(labels == c) for c in range(k)]
    names = list(cluster_names) if cluster_names is not None else [str(c) for c in range(k)]
    if len(names) != k:
        raise ValueError(f"{len(names)} cluster names for k = {k} clusters")

    rows = []
    for c in range(k):
        originals = values[members[c], c, :m]  # [n_c, m]
        generated = values[members[c], c, m:]  # [n_c, m' - m], NaN where missing
        present = ~np.isnan(generated)
        below = generated < originals.min(axis=1, keepdims=True)  # NaN compares False
        flat = generated[present]
        distinct = [_count_distinct(row[~np.isnan(row)], tol) for row in generated]
        with_generated = [(d, int(p.sum())) for d, p in zip(distinct, present, strict=True) if p.any()]
        mean = flat.mean() if flat.size else np.nan
        std = flat.std() if flat.size else np.nan
        rows.append({
            "cluster": names[c],
            "rankings": len(members[c]),
            "generated": int(flat.size),
            "below_all_originals": below[present].mean() if flat.size else np.nan,
            "distinct_generated": int(sum(distinct)),
            "all_distinct_fraction": np.mean([d == g for d, g in with_generated]) if with_generated else np.nan,
            "mean": mean,
            "std": std,
            "cv": std / abs(mean) if flat.size and mean != 0 else np.nan,
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _count_distinct(values: np.ndarray, tol: float) -> int:
    """Number of groups of sorted values whose neighbours are within ``tol`` of each other."""
    if values.size == 0:
        return 0
    return 1 + int((np.diff(np.sort(values)) > tol).sum())
