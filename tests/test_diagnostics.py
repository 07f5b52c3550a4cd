"""Generated-response diagnostics on hand-computed scores (paper section 4.1, Proposition 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moplex_core.diagnostics import generated_score_diagnostics

NAN = float("nan")
# 3 rankings, k = 2 clusters, m = 2 originals + 3 generated. scores[i, c, j].
SCORES = torch.tensor([
    [[5.0, 4.0, 1.0, 2.0, 4.5], [0.0, 1.0, -1.0, -1.0, -2.0]],
    [[3.0, 2.0, 1.0, 1.0, NAN], [2.0, 2.0, 4.0, 1.0, 0.0]],
    [[1.0, 0.0, -1.0, -2.0, -3.0], [6.0, 5.0, 1.0, 2.0, 3.0]],
], dtype=torch.float64)


def test_every_ranking_counts_for_every_cluster_without_an_assignment():
    table = generated_score_diagnostics(SCORES, m=2, cluster_names=["helpful", "honest"]).set_index("cluster")
    c0 = table.loc["helpful"]
    # Cluster 0, generated scores: row 0 [1, 2, 4.5] vs min original 4 -> 2 below; row 1 [1, 1] vs 2 -> 2;
    # row 2 [-1, -2, -3] vs 0 -> 3. 7 of 8 below.
    assert c0["rankings"] == 3 and c0["generated"] == 8 and c0["below_all_originals"] == pytest.approx(7 / 8)
    assert c0["distinct_generated"] == 3 + 1 + 3 and c0["all_distinct_fraction"] == pytest.approx(2 / 3)
    values = np.array([1, 2, 4.5, 1, 1, -1, -2, -3])
    assert c0["mean"] == pytest.approx(values.mean()) and c0["cv"] == pytest.approx(values.std() / abs(values.mean()))
    c1 = table.loc["honest"]
    # Cluster 1: row 0 [-1, -1, -2] vs 0 -> 3 (two equal); row 1 [4, 1, 0] vs 2 -> 2; row 2 [1, 2, 3] vs 5 -> 3.
    assert c1["generated"] == 9 and c1["below_all_originals"] == pytest.approx(8 / 9)
    assert c1["distinct_generated"] == 2 + 3 + 3 and c1["all_distinct_fraction"] == pytest.approx(2 / 3)


def test_an_assignment_restricts_each_cluster_to_its_rankings_and_tol_merges_close_scores():
    table = generated_score_diagnostics(SCORES.numpy(), m=2, assigned=[1, 0, 1], tol=1.0)
    c0, c1 = table.iloc[0], table.iloc[1]
    assert c0["rankings"] == 1 and c0["generated"] == 2 and c0["below_all_originals"] == 1.0
    assert c0["distinct_generated"] == 1 and c0["all_distinct_fraction"] == 0.0 and c0["cv"] == 0.0
    # Cluster 1 on rows 0 and 2: [-1, -1, -2] -> one group within tol 1; [1, 2, 3] -> one chained group.
    assert c1["rankings"] == 2 and c1["below_all_originals"] == 1.0 and c1["distinct_generated"] == 2
    values = np.array([-1, -1, -2, 1, 2, 3])
    assert c1["cv"] == pytest.approx(values.std() / abs(values.mean()))


def test_a_cluster_without_generated_scores_has_no_fractions():
    only_originals = torch.ones(2, 2, 3)
    only_originals[:, :, 2] = NAN
    table = generated_score_diagnostics(only_originals, m=2, assigned=torch.tensor([0, 0]))
    assert table["generated"].tolist() == [0, 0] and table["rankings"].tolist() == [2, 0]
    assert all(math.isnan(v) for v in table[["below_all_originals", "all_distinct_fraction", "cv"]].to_numpy().ravel())


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"\[n, k, m'\]"):
        generated_score_diagnostics(torch.zeros(3, 5), m=2)
    with pytest.raises(ValueError, match="must not be NaN"):
        generated_score_diagnostics(torch.full((1, 1, 3), NAN), m=2)
    with pytest.raises(ValueError, match="cluster indices in 0..1"):
        generated_score_diagnostics(SCORES, m=2, assigned=[0, 2, 1])
    with pytest.raises(ValueError, match="do not fit"):
        generated_score_diagnostics(SCORES, m=6)
