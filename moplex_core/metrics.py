"""Clustering, ranking and likelihood metrics (DESIGN.md 7).

Cluster ids found by EM are arbitrary; every clustering metric that compares them with true labels
goes through a Hungarian matching fitted on one split (evaluate's fit_split, default validation) and
applied to the others, so that the test set never chooses its own label permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from moplex_core.pl import PAD, UNRANKED


@dataclass(frozen=True)
class ClusterMatching:
    """Predicted cluster ids <-> true label ids, fitted on one split.

    mapping: predicted cluster id -> true label id, one-to-one (Hungarian); ids with no partner map
             to -1. Every clustering accuracy uses this.
    routing: true label id -> the predicted cluster that serves it: its partner, or, for a label
             left without one (fewer clusters than labels, e.g. k = 1) or whose partner holds none of
             its members, the cluster that holds most of its members on the fitted split. Oracle
             routing of rankings uses this.
    majority: predicted cluster id -> the true label most of its members have on the fitted split
              (-1 for a cluster with none), many-to-one: with more clusters than labels (the paper's
              k = 16 for 12 PERSONA profiles) the one-to-one mapping leaves clusters without a label,
              whose members then always count as wrong; `many_to_one_accuracy` counts by this.
    """

    mapping: np.ndarray  # int64 [k_pred]
    routing: np.ndarray  # int64 [k_true]
    majority: np.ndarray  # int64 [k_pred]

    def apply(self, predicted: np.ndarray) -> np.ndarray:
        return self.mapping[cluster_ids(predicted, "predicted")]


def cluster_ids(values: Any, name: str = "labels") -> np.ndarray:
    """``values`` (numpy, a list, a pandas Series, a tensor) as int64 ids 0, 1, ...: the clustering
    metrics' labels. Strings are refused (compared with the matching's integer ids they would count
    every ranking wrong, silently): ``pd.factorize(labels, sort=True)[0]`` turns ``c0``, ``c1``, ... into ids."""
    array = np.asarray(values)
    if array.dtype.kind in "iu" or (array.dtype.kind == "f" and np.isfinite(array).all()
                                    and (array == np.round(array)).all()):
        ids = array.astype(np.int64, copy=False)
        if ids.size and ids.min() < 0:  # indexing would wrap it to the last cluster, counted as a hit
            raise ValueError(f"{name} must be cluster ids 0, 1, ...; got {int(ids.min())} (pd.factorize codes a "
                             "missing label as -1: leave out the rankings without one)")
        return ids
    raise TypeError(f"{name} must be integer cluster ids 0, 1, ...; got {array.dtype} values such as "
                    f"{array.ravel()[:3].tolist()} (pd.factorize(labels, sort=True)[0] gives ids for string labels; "
                    "NaN: a ranking without one)")


def fit_matching(predicted: np.ndarray, true: np.ndarray, k_pred: int, k_true: int) -> ClusterMatching:
    """Hungarian matching maximising agreement between predicted and true labels."""
    counts = np.zeros((k_pred, k_true), dtype=np.int64)
    np.add.at(counts, (cluster_ids(predicted, "predicted"), cluster_ids(true, "true")), 1)
    rows, cols = linear_sum_assignment(-counts)
    mapping = np.full(k_pred, -1, dtype=np.int64)
    mapping[rows] = cols
    # A label with no members on this split goes to the largest cluster (argmax of a zero column is 0).
    routing = np.where(counts.sum(0) > 0, counts.argmax(0), counts.sum(1).argmax())
    partnered = counts[rows, cols] > 0  # a partner with none of the label's members (an empty cluster) serves none
    routing[cols[partnered]] = rows[partnered]
    majority = np.where(counts.sum(1) > 0, counts.argmax(1), -1)  # ties: the lowest label id
    return ClusterMatching(mapping, routing.astype(np.int64), majority.astype(np.int64))


def clustering_accuracy(predicted: np.ndarray, true: np.ndarray, matching: ClusterMatching) -> float:
    return float(np.mean(matching.apply(predicted) == cluster_ids(true, "true")))


def many_to_one_accuracy(predicted: np.ndarray, true: np.ndarray, matching: ClusterMatching) -> float:
    """The fraction whose cluster's majority label (`ClusterMatching.majority`, fitted on another
    split) is their own: every cluster counts, however many share a label."""
    return float(np.mean(matching.majority[cluster_ids(predicted, "predicted")] == cluster_ids(true, "true")))


def per_cluster_accuracy(
    predicted: np.ndarray, true: np.ndarray, matching: ClusterMatching, k_true: int
) -> np.ndarray:
    """Recall of each true cluster after matching, float [k_true] (NaN where a cluster is absent)."""
    mapped, true = matching.apply(predicted), cluster_ids(true, "true")
    out = np.full(k_true, np.nan)
    for c in range(k_true):
        members = true == c
        if members.any():
            out[c] = float(np.mean(mapped[members] == c))
    return out


def _agreement(score: Any, predicted: np.ndarray, true: np.ndarray) -> float:
    """``score(true, predicted)``, or NaN where ``true`` holds fewer than 2 rankings or one label:
    there is no partition to agree with, and sklearn reads such a case as perfect agreement, 1.0."""
    true = cluster_ids(true)
    if len(true) < 2 or len(np.unique(true)) < 2:
        return float("nan")
    return float(score(true, cluster_ids(predicted, "predicted")))


def adjusted_rand_index(predicted: np.ndarray, true: np.ndarray) -> float:
    return _agreement(adjusted_rand_score, predicted, true)


def normalized_mutual_information(predicted: np.ndarray, true: np.ndarray) -> float:
    return _agreement(normalized_mutual_info_score, predicted, true)


def score_credit(scores: torch.Tensor) -> torch.Tensor:
    """float64 [n, M, M]: the credit of ordering item i above item j by the scores [n, M]
    (`score_order`), for `pair_accuracy`."""
    return score_order(scores.unsqueeze(2), scores.unsqueeze(1))


def score_order(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """float64 credit of predicting "first above second" from scores: 1 when first > second, 0.5 when
    equal, else 0 (compared, not subtracted: -inf ties -inf)."""
    return torch.where(first > second, 1.0, torch.where(first == second, 0.5, 0.0)).to(torch.float64)


def pair_accuracy(credit: torch.Tensor, tiers: torch.Tensor, ranked_prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Per ranking, the mean credit of its known pairs; float64 [n].

    credit: float64 [n, M, M], the credit of predicting item i above item j (1 right, 0.5 a tie, 0
    wrong, when i is truly above j). tiers: int64 [n, M] (moplex_core.pl codes); ranked_prefix:
    int64 [n] or None. A pair is known when both items are ranked and in different tiers; with a
    top-l prefix, also a ranked item of the top l against one below it (its order among those below
    is unknown). Unranked slots (generated responses) and padding never count. Rankings with no
    known pair give NaN.
    """
    ranked = (tiers != PAD) & (tiers != UNRANKED)  # [n, M]
    shown = ranked if ranked_prefix is None else ranked & (tiers < ranked_prefix.unsqueeze(1))  # in the top l
    pairs = (tiers.unsqueeze(2) < tiers.unsqueeze(1)) & shown.unsqueeze(2) & ranked.unsqueeze(1)  # [n, M, M]: i above j
    n_pairs = pairs.sum((1, 2)).to(torch.float64)
    correct = (credit * pairs).sum((1, 2))
    return torch.where(n_pairs > 0, correct / n_pairs.clamp_min(1), float("nan"))
