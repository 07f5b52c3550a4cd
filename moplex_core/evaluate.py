"""Evaluation of a fitted mixture on held-out splits (DESIGN.md 7), for any Scorer.

Always exact scores. The Hungarian matching from EM's cluster ids to the true labels is fitted on
the `validation` split and applied to `test`. Ranking accuracy is reported three ways, labelled:

    posterior  each ranking routed to argmax_c gamma_ic, gamma computed from that same ranking
               (the paper's number; optimistic, the ranking chooses its own scorer)
    oracle     routed by the true label through the matching (needs labels)
    marginal   the alpha-weighted mixture of the k scorers, no label and no ranking used

Output rows: (split, metric, cluster, value); cluster is "all" for averages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from moplex_core.em import Rankings, Scorer, mixture_posteriors
from moplex_core.metrics import (
    ClusterMatching,
    adjusted_rand_index,
    clustering_accuracy,
    fit_matching,
    normalized_mutual_information,
    pairwise_ranking_accuracy,
    per_cluster_accuracy,
)


@dataclass(frozen=True)
class EvalSplit:
    inputs: Any
    rankings: Rankings
    labels: np.ndarray | None = None  # int64 [n] true cluster ids, or None when unknown


def evaluate_mixture(
    scorer: Scorer,
    alpha: torch.Tensor,
    splits: dict[str, EvalSplit],
    label_names: list[str] | None = None,
    fit_split: str = "validation",
) -> pd.DataFrame:
    """Metrics of the mixture (scorer, alpha) on every split; the matching is fitted on ``fit_split``."""
    k = scorer.k
    outputs = {name: _posterior_outputs(scorer, alpha, split) for name, split in splits.items()}
    k_true = len(label_names) if label_names else k
    matching = None
    if fit_split in splits and splits[fit_split].labels is not None:
        matching = fit_matching(outputs[fit_split]["assigned"], splits[fit_split].labels, k, k_true)

    rows: list[tuple[str, str, str, float]] = []
    for name, split in splits.items():
        out = outputs[name]
        rows.append((name, "heldout_log_likelihood", "all", float(out["ll"].mean())))
        rows += _ranking_rows(name, out, split, alpha, matching, k_true, label_names)
        if split.labels is None:
            continue
        rows.append((name, "ari", "all", adjusted_rand_index(out["assigned"], split.labels)))
        rows.append((name, "nmi", "all", normalized_mutual_information(out["assigned"], split.labels)))
        if matching is not None:
            rows.append((name, "clustering_accuracy", "all", clustering_accuracy(out["assigned"], split.labels, matching)))
            recall = per_cluster_accuracy(out["assigned"], split.labels, matching, k_true)
            rows += [(name, "clustering_accuracy", _name(c, label_names), float(v)) for c, v in enumerate(recall)]
    return pd.DataFrame(rows, columns=["split", "metric", "cluster", "value"])


def _posterior_outputs(scorer: Scorer, alpha: torch.Tensor, split: EvalSplit) -> dict[str, Any]:
    scores = scorer.score(split.inputs, 0)  # [n, k, M]
    gamma, ll = mixture_posteriors(scores, split.rankings, alpha)
    return {"scores": scores, "assigned": gamma.argmax(1).numpy(), "ll": ll}


def _ranking_rows(
    split_name: str,
    out: dict[str, Any],
    split: EvalSplit,
    alpha: torch.Tensor,
    matching: ClusterMatching | None,
    k_true: int,
    label_names: list[str] | None,
) -> list[tuple[str, str, str, float]]:
    scores, tiers = out["scores"], split.rankings.tiers
    n = scores.shape[0]
    routed = {
        "posterior": scores[torch.arange(n), torch.as_tensor(out["assigned"])],
        "marginal": torch.einsum("k,nkm->nm", alpha.to(scores.dtype), scores),
    }
    if matching is not None and split.labels is not None:
        true_to_pred = np.full(k_true, -1)
        true_to_pred[matching.mapping[matching.mapping >= 0]] = np.flatnonzero(matching.mapping >= 0)
        predicted = true_to_pred[split.labels]
        if (predicted >= 0).all():
            routed["oracle"] = scores[torch.arange(n), torch.as_tensor(predicted)]
    rows = []
    for variant, routed_scores in routed.items():
        acc = pairwise_ranking_accuracy(routed_scores, tiers).numpy()
        metric = f"ranking_accuracy_{variant}"
        rows.append((split_name, metric, "all", float(np.nanmean(acc))))
        if split.labels is not None:
            for c in range(k_true):
                members = split.labels == c
                if members.any():
                    rows.append((split_name, metric, _name(c, label_names), float(np.nanmean(acc[members]))))
    return rows


def _name(c: int, label_names: list[str] | None) -> str:
    return label_names[c] if label_names else str(c)
