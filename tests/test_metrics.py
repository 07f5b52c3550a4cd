"""Metrics pinned on hand-computed cases."""

import numpy as np
import pytest
import torch

from moplex_core.metrics import (
    adjusted_rand_index,
    clustering_accuracy,
    fit_matching,
    many_to_one_accuracy,
    normalized_mutual_information,
    pair_accuracy,
    score_credit,
    per_cluster_accuracy,
)
from moplex_core.pl import PAD, UNRANKED


def test_hungarian_matching_undoes_a_label_permutation_fitted_on_another_split():
    true_val = np.array([0, 0, 1, 1, 2, 2])
    pred_val = np.array([2, 2, 0, 0, 1, 1])  # EM's ids are a permutation of the truth
    matching = fit_matching(pred_val, true_val, 3, 3)
    assert matching.mapping.tolist() == [1, 2, 0]
    true_test = np.array([0, 1, 2, 2])
    pred_test = np.array([2, 0, 1, 0])  # last one wrong
    assert clustering_accuracy(pred_test, true_test, matching) == pytest.approx(0.75)
    assert per_cluster_accuracy(pred_test, true_test, matching, 3).tolist() == [1.0, 1.0, 0.5]


def test_labels_without_a_partner_are_routed_to_the_cluster_holding_most_of_them():
    # 2 clusters for 3 labels: labels 0 and 2 get partners; label 1 sits mostly in cluster 1
    true_val = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    pred_val = np.array([0, 0, 0, 1, 1, 0, 1, 1, 1])
    matching = fit_matching(pred_val, true_val, 2, 3)
    assert matching.mapping.tolist() == [0, 2]
    assert matching.routing.tolist() == [0, 1, 1]
    # k = 1: every label is served by the one cluster
    assert fit_matching(np.zeros(4, dtype=int), np.array([0, 1, 2, 2]), 1, 3).routing.tolist() == [0, 0, 0]
    # a label absent from the fitted split goes to the largest cluster
    assert fit_matching(np.array([1, 1, 0]), np.array([0, 0, 1]), 2, 3).routing.tolist() == [1, 0, 1]
    # a label whose partner is an empty cluster goes where its members are
    empty = fit_matching(np.array([0] * 50 + [1] * 50), np.array([0] * 50 + [1] * 30 + [2] * 20), 3, 3)
    assert empty.mapping.tolist() == [0, 1, 2] and empty.routing.tolist() == [0, 1, 1]


def test_more_clusters_than_labels_count_every_cluster_by_its_majority_label():
    # 4 clusters split 2 labels perfectly: one-to-one leaves two clusters without a label (always wrong)
    true_val = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    pred_val = np.array([0, 0, 2, 2, 1, 1, 3, 3])
    matching = fit_matching(pred_val, true_val, 5, 2)  # cluster 4 holds nobody
    assert matching.majority.tolist() == [0, 1, 0, 1, -1]
    true_test, pred_test = np.array([0, 0, 1, 1, 1]), np.array([2, 0, 3, 1, 0])  # the last one wrong
    assert clustering_accuracy(pred_test, true_test, matching) == pytest.approx(2 / 5)
    assert many_to_one_accuracy(pred_test, true_test, matching) == pytest.approx(4 / 5)


def test_matching_is_not_refitted_on_the_test_split():
    matching = fit_matching(np.array([0, 1]), np.array([0, 1]), 2, 2)
    # on test the labels are swapped: a matching fitted on test would score 1.0
    assert clustering_accuracy(np.array([1, 0]), np.array([0, 1]), matching) == 0.0


def test_ari_and_nmi_are_permutation_invariant():
    true = np.array([0, 0, 1, 1])
    assert adjusted_rand_index(np.array([1, 1, 0, 0]), true) == pytest.approx(1.0)
    assert normalized_mutual_information(np.array([1, 1, 0, 0]), true) == pytest.approx(1.0)
    assert adjusted_rand_index(np.array([0, 1, 0, 1]), true) == pytest.approx(-0.5)


def test_ari_and_nmi_are_nan_without_a_partition_to_agree_with():
    # sklearn reads one ranking, or one true label, as perfect agreement (1.0): evaluate reported it so
    # beside a clustering accuracy of 0 on a one-ranking split (review helper-167)
    for predicted, true in (([1], [0]), ([0, 1, 2], [1, 1, 1]), ([0, 0], [2, 2])):
        assert np.isnan(adjusted_rand_index(np.array(predicted), np.array(true)))
        assert np.isnan(normalized_mutual_information(np.array(predicted), np.array(true)))
    assert adjusted_rand_index(np.array([0, 0]), np.array([0, 1])) == pytest.approx(0.0)


def test_negative_ids_are_refused_not_wrapped_to_the_last_cluster():
    # pd.factorize codes a missing label as -1; indexing took it for the last label, a hit wherever a
    # ranking sat in an unmatched cluster (labels [0, 0, 1, 1, -1, -1] with k = 3 scored 1.0)
    true = np.array([0, 0, 1, 1, -1, -1])
    with pytest.raises(ValueError, match=r"true must be cluster ids 0, 1, ...; got -1 \(pd.factorize codes"):
        fit_matching(np.array([0, 0, 1, 1, 2, 2]), true, 3, 2)
    matching = fit_matching(np.array([0, 1]), np.array([0, 1]), 2, 2)
    with pytest.raises(ValueError, match="predicted must be cluster ids"):
        clustering_accuracy(np.array([-1, 0]), np.array([1, 0]), matching)


def test_pairwise_accuracy_excludes_ground_truth_ties_unranked_and_padding():
    # tiers: item0 best, items 1 and 2 tied, item3 generated (unranked), slot 4 padding
    tiers = torch.tensor([[0, 1, 1, UNRANKED, PAD]])
    scores = torch.tensor([[0.0, 1.0, -1.0, 9.0, 9.0]])
    # comparable pairs: (0,1) wrong, (0,2) right; the tie (1,2) is excluded
    assert pair_accuracy(score_credit(scores), tiers).tolist() == [0.5]
    assert pair_accuracy(score_credit(torch.tensor([[2.0, 1.0, 1.0, 0, 0]])), tiers).tolist() == [1.0]
    # a tie in the scores earns half a pair
    assert pair_accuracy(score_credit(torch.tensor([[1.0, 1.0, 0.0, 0, 0]])), tiers).tolist() == [0.75]
    all_tied = torch.tensor([[0, 0, PAD, PAD, PAD]])
    assert np.isnan(pair_accuracy(score_credit(scores), all_tied).item())
    # so does a tie at -inf (a response no adapter can produce), which a difference would make NaN
    inf = float("-inf")
    assert pair_accuracy(score_credit(torch.tensor([[inf, inf, 0.0, 0, 0]])), tiers).tolist() == [0.25]


def test_nmi_of_a_merged_cluster_matches_the_hand_computed_value():
    # true {0,0,1,1}, predicted {0,0,0,1}: H(true) = ln 2, H(pred) = H(3/4, 1/4) = 0.562335,
    # I = 1/2 ln(4/3) + 1/4 ln(2/3) + 1/4 ln 2 = 0.215761; arithmetic-mean normalisation
    assert normalized_mutual_information(np.array([0, 0, 0, 1]), np.array([0, 0, 1, 1])) == \
        pytest.approx(0.215761 / ((0.693147 + 0.562335) / 2), abs=1e-5)
    # ARI by hand: index = sum_ij C(n_ij, 2) = C(2, 2) = 1; true pairs a = 2 C(2, 2) = 2, predicted pairs
    # b = C(3, 2) = 3; expected index = a b / C(4, 2) = 1; max = (a + b) / 2 = 2.5; ARI = (1 - 1) / (2.5 - 1)
    assert adjusted_rand_index(np.array([0, 0, 0, 1]), np.array([0, 0, 1, 1])) == pytest.approx(0.0)


def test_string_labels_are_refused_not_counted_all_wrong_and_a_series_or_list_of_ids_is_taken():
    """An artifact's `cluster` column holds strings (c0, c1); compared with the matching's integer ids
    they made every ranking wrong: clustering_accuracy said 0.0 without a word."""
    import pandas as pd

    true = pd.Series(["c0", "c0", "c1", "c1"])
    predicted = pd.Series([1, 1, 0, 0], dtype="int32")
    matching = fit_matching(predicted, pd.factorize(true, sort=True)[0], 2, 2)
    assert clustering_accuracy(predicted, [0, 0, 1, 1], matching) == 1.0
    assert clustering_accuracy(predicted.astype(float), np.array([0.0, 0, 1, 1]), matching) == 1.0  # a merge's floats
    for metric in (clustering_accuracy, many_to_one_accuracy):
        with pytest.raises(TypeError, match=r"true must be integer cluster ids 0, 1, ...; got object values such as "
                                             r"\['c0', 'c0', 'c1'\] \(pd.factorize"):
            metric(predicted, true, matching)
    with pytest.raises(TypeError, match="true must be integer cluster ids"):
        per_cluster_accuracy(predicted, true, matching, 2)
    with pytest.raises(TypeError, match="true must be integer cluster ids"):
        fit_matching(predicted, true, 2, 2)
    with pytest.raises(TypeError, match=r"predicted must be integer cluster ids.*float64 values such as \[1.0, nan"):
        clustering_accuracy(np.array([1.0, np.nan]), [0, 1], matching)  # NaN: a ranking without a posterior
