"""evaluate_mixture on a mixture whose truth is known exactly (noise-free synthetic rankings)."""

import warnings

import numpy as np
import pandas as pd
import pytest
from markdown_it import MarkdownIt
import torch

from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.em import Rankings
from moplex_core.evaluate import EvalSplit, em_start_metrics, evaluate_mixture
from moplex_core.display import markdown_cell
from moplex_core.report import headline_table, markdown_table, per_cluster_table
from moplex_core.scorers.linear import LinearScorer


@pytest.fixture
def noise_free():
    data = generate_synthetic(SyntheticConfig(n=400, k=2, m=6, noise=0.0, seed=3))
    rankings = Rankings(torch.as_tensor(data.tiers))
    x = data.features()
    val, test = np.arange(200), np.arange(200, 400)
    splits = {name: EvalSplit(x[idx], rankings.subset(idx), data.labels[idx]) for name, idx in (("validation", val), ("test", test))}
    return data, splits


def test_true_scorer_with_permuted_ids_is_matched_and_ranks_perfectly(noise_free):
    data, splits = noise_free
    scorer = LinearScorer(2, 2)
    scorer.theta = torch.tensor([[0.0, 3.0], [3.0, 0.0]], dtype=torch.float64)  # cluster ids swapped
    metrics = evaluate_mixture(scorer, torch.tensor([0.5, 0.5], dtype=torch.float64), splits, label_names=["c0", "c1"])
    test = metrics[metrics.split == "test"].set_index(["metric", "cluster"]).value
    assert test["clustering_accuracy", "all"] > 0.95
    assert test["ari", "all"] > 0.8
    # routed by the true label through the matching, the true scorer orders every untied pair right
    assert test["ranking_accuracy_oracle", "all"] == 1.0
    assert test["ranking_accuracy_oracle", "c0"] == 1.0 and test["ranking_accuracy_oracle", "c1"] == 1.0
    assert test["ranking_accuracy_posterior", "all"] > 0.95
    # the 50/50 blend of two orthogonal criteria is much worse than routing
    assert test["ranking_accuracy_marginal", "all"] < 0.85
    assert np.isfinite(test["heldout_log_likelihood", "all"])
    # a merge's float ids, which the metrics take, give the same rows (np.bincount refused them: a TypeError)
    floats = {name: EvalSplit(split.inputs, split.rankings, split.labels.astype(float)) for name, split in splits.items()}
    again = evaluate_mixture(scorer, torch.tensor([0.5, 0.5], dtype=torch.float64), floats, label_names=["c0", "c1"])
    pd.testing.assert_frame_equal(again, metrics)


def test_one_cluster_serves_every_label_in_the_oracle_routing(noise_free):
    # k = 1 (DPO, LiPO, the w/o-mixture ablation): routing by the true label has one place to go,
    # so the oracle variant exists and equals the posterior and marginal ones
    _, splits = noise_free
    scorer = LinearScorer(1, 2)
    scorer.theta = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    metrics = evaluate_mixture(scorer, torch.ones(1, dtype=torch.float64), splits, label_names=["c0", "c1"])
    test = metrics[metrics.split == "test"].set_index(["metric", "cluster"]).value
    for cluster in ("all", "c0", "c1"):
        oracle = test["ranking_accuracy_oracle", cluster]
        assert oracle == test["ranking_accuracy_posterior", cluster] == test["ranking_accuracy_marginal", cluster]
    assert test["ranking_accuracy_oracle", "c0"] != test["ranking_accuracy_oracle", "c1"]


def test_more_labels_than_clusters_without_label_names_still_match(noise_free):
    # as a library call with integer labels: k = 1 against 2 labels (it raised an IndexError)
    _, splits = noise_free
    scorer = LinearScorer(1, 2)
    scorer.theta = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    test = evaluate_mixture(scorer, torch.ones(1, dtype=torch.float64), splits)
    test = test[test.split == "test"].set_index(["metric", "cluster"]).value
    # one cluster holds every ranking: no clustering rows (an accuracy there would be the largest label's
    # share), and the oracle routes every label to it
    assert not {"clustering_accuracy", "ari", "nmi"} & {metric for metric, _ in test.index}
    assert test["ranking_accuracy_oracle", "all"] == test["ranking_accuracy_posterior", "all"]
    assert {"0", "1"} <= {cluster for _, cluster in test.index}  # per-label rows, named by number
    labels = splits["test"].labels  # the rankings each label's values rest on, and the split's
    assert (test["rankings", "0"], test["rankings", "1"], test["rankings", "all"]) == (
        (labels == 0).sum(), (labels == 1).sum(), len(labels))
    # and fewer: k = 3 against the same 2 labels names no third label
    more = evaluate_mixture(LinearScorer(3, 2), torch.ones(3, dtype=torch.float64) / 3, splits)
    assert set(more[more.metric.isin(["clustering_accuracy", "matched_adapter"])].cluster) == {"all", "0", "1"}


def test_more_clusters_than_labels_add_the_many_to_one_accuracy(noise_free):
    data, splits = noise_free
    scorer = LinearScorer(4, 2)  # two clusters per true criterion, each pair alike: split by the posterior's ties
    scorer.theta = torch.tensor([[3.0, 0.0], [0.0, 3.0], [3.0, 0.1], [0.1, 3.0]], dtype=torch.float64)
    metrics = evaluate_mixture(scorer, torch.full((4,), 0.25, dtype=torch.float64), splits)
    test = metrics[(metrics.split == "test") & (metrics.cluster == "all")].set_index("metric").value
    # every cluster's rankings share its majority label; one-to-one drops the two clusters left over
    assert test["clustering_accuracy_many_to_one"] == 1.0 > test["clustering_accuracy"]
    two = evaluate_mixture(LinearScorer(2, 2), torch.tensor([0.5, 0.5], dtype=torch.float64), splits)
    assert "clustering_accuracy_many_to_one" not in set(two.metric)  # k = labels: one-to-one is the number


def test_without_labels_only_label_free_metrics_are_reported(noise_free):
    _, splits = noise_free
    unlabeled = {"test": EvalSplit(splits["test"].inputs, splits["test"].rankings)}
    metrics = evaluate_mixture(LinearScorer(2, 2), torch.tensor([0.5, 0.5], dtype=torch.float64), unlabeled)
    assert set(metrics.metric) == {"heldout_log_likelihood", "ranking_accuracy_posterior",
                                   "ranking_accuracy_leave_pair_out", "ranking_accuracy_marginal", "rankings"}
    counts = metrics[metrics.metric == "rankings"]  # the split's whole count only: no labels to count by
    assert list(counts.cluster) == ["all"] and counts.value.item() == len(splits["test"].rankings.tiers)
    # a zero scorer ties every pair: half credit each
    values = metrics.set_index("metric").value
    assert values["ranking_accuracy_marginal"] == pytest.approx(0.5)


def test_a_top_l_ranking_scores_its_top_items_against_each_other_and_against_those_below():
    from moplex_core.pl import UNRANKED

    tiers = torch.tensor([[0, 1, 2, 3]])
    top2 = Rankings(tiers, torch.tensor([2]))
    assert top2.observed_tiers.tolist() == [[0, 1, UNRANKED, UNRANKED]]
    scorer = LinearScorer(1, 1)
    scorer.theta = torch.tensor([[1.0]], dtype=torch.float64)

    def accuracy(x, rankings):
        x = torch.tensor([[[v] for v in x]], dtype=torch.float64)
        metrics = evaluate_mixture(scorer, torch.ones(1, dtype=torch.float64), {"test": EvalSplit(x, rankings)})
        return metrics.set_index("metric").value["ranking_accuracy_marginal"]

    # known pairs: 0>1, 0>2, 0>3, 1>2, 1>3; not 2 against 3 (their order below the top 2 is unknown)
    assert accuracy([4.0, 3.0, 1.0, 2.0], top2) == 1.0
    assert accuracy([4.0, 3.0, 5.0, 6.0], top2) == pytest.approx(1 / 5)
    top1 = Rankings(torch.tensor([[1, 0, 2, 3]]), torch.tensor([1]))  # item 1 best, the rest unordered
    assert accuracy([1.0, 2.0, 0.0, 3.0], top1) == pytest.approx(2 / 3)


def test_heldout_log_likelihood_is_the_hand_computed_mean_under_the_rankings_model():
    import math

    scorer = LinearScorer(1, 1)
    scorer.theta = torch.tensor([[1.0]], dtype=torch.float64)
    x = torch.tensor([[[2.0], [1.0], [0.0]], [[0.0], [1.0], [2.0]]], dtype=torch.float64)  # scores = x
    tiers = torch.tensor([[0, 1, 2], [0, 1, 2]])
    one = torch.ones(1, dtype=torch.float64)

    def ll(model):
        split = EvalSplit(x, Rankings(tiers, model=model))
        return evaluate_mixture(scorer, one, {"test": split}).set_index("metric").value["heldout_log_likelihood"]

    def log_pl(a, b, c):  # P(a > b > c) = e^a / (e^a + e^b + e^c) * e^b / (e^b + e^c)
        return a - math.log(math.exp(a) + math.exp(b) + math.exp(c)) + b - math.log(math.exp(b) + math.exp(c))

    def log_pairs(a, b, c):
        return sum(-math.log1p(math.exp(-(u - v))) for u, v in ((a, b), (a, c), (b, c)))

    assert ll("pl") == pytest.approx((log_pl(2, 1, 0) + log_pl(0, 1, 2)) / 2, rel=1e-12)
    assert ll("bt_pairs") == pytest.approx((log_pairs(2, 1, 0) + log_pairs(0, 1, 2)) / 2, rel=1e-12)


def test_em_start_metrics_compare_the_start_and_the_end_each_under_its_own_matching():
    labels = np.repeat(np.arange(3), 4)  # 12 rankings, 4 per true cluster
    start = torch.nn.functional.one_hot(torch.as_tensor(labels), 3).double() * 0.8 + 0.2 / 3
    final = start[:, [2, 0, 1]]  # the same partition under other cluster ids
    moved = final.clone()
    moved[[0, 4, 8]] = final[[4, 8, 0]]  # three rankings change cluster
    same = em_start_metrics(start, final, labels).set_index("metric").value
    assert same.to_dict() == pytest.approx({"start_final_ari": 1.0, "ari_start": 1.0, "clustering_accuracy_start": 1.0,
                                            "ari_final": 1.0, "clustering_accuracy_final": 1.0})
    after = em_start_metrics(start, moved, labels).set_index("metric").value
    assert after["clustering_accuracy_start"] == 1.0 and after["clustering_accuracy_final"] == pytest.approx(9 / 12)
    assert after["start_final_ari"] == after["ari_final"] < 1.0
    unlabelled = em_start_metrics(start, moved)
    assert unlabelled.metric.tolist() == ["start_final_ari"] and set(unlabelled.split) == {"train_em"}
    assert em_start_metrics(torch.ones(12, 1, dtype=torch.float64), torch.ones(12, 1, dtype=torch.float64), labels).empty


def test_the_reports_tables_keep_a_metric_or_label_that_is_nan_as_a_dash():
    # evaluate writes NaN for a label with no rankings in a split; the report says so, not nothing
    metrics = pd.DataFrame([("test", "clustering_accuracy", "a", 0.5), ("test", "clustering_accuracy", "b", np.nan),
                            ("test", "clustering_accuracy", "all", 0.5),
                            ("test", "heldout_log_likelihood", "all", np.nan)],
                           columns=["split", "metric", "cluster", "value"])
    assert markdown_table(per_cluster_table(metrics, "test")).splitlines()[2:] == ["| a | 0.5000 |", "| b | - |"]
    assert "| heldout_log_likelihood | - |" in markdown_table(headline_table(metrics))


def test_a_label_from_a_dataset_shows_in_the_reports_tables_as_its_text_not_as_markdown_or_html():
    # The Prefect UI renders report.md (the moplex-report artifact), and a label is any text a dataset holds.
    labels = ["[click](javascript:alert(1))", "<img src=x onerror=alert(1)>", "![t](https://example.com/t.png)",
              "a\n# b", "age=18-44|sex=Female", "a \\[b](c)"]
    table = markdown_table(pd.DataFrame({"value": [0.5] * len(labels)}, index=pd.Index(labels, name="true label")))
    parser = MarkdownIt("commonmark").enable("table")
    parser.validateLink = lambda url: True  # as the UI's parser (marked), which keeps javascript: links
    cells = [token.children for token in parser.parse(table) if token.type == "inline"]
    assert {child.type for children in cells for child in children} == {"text"}
    shown = ["".join(child.content for child in children) for children in cells]
    assert shown == ["true label", "value", *(text for label in labels for text in (label.replace("\n", " "), "0.5000"))]


def test_a_labels_terminal_escapes_and_bidi_controls_show_as_escapes_in_a_table_cell():
    # `make demo` and `moplex assign` print report tables to a terminal: ESC [2J would clear it, U+202E reverse text
    assert markdown_cell("c\x1b[2J\u202e1") == "c\\x1b\\[2J\\u202e1"
    assert markdown_cell("tab\there") == "tab\there"


def test_the_report_tables_leave_out_counts_and_diagnostics_rows():
    columns = ["split", "metric", "cluster", "value"]
    counted = pd.DataFrame([("test", "clustering_accuracy", "all", 0.7), ("test", "rankings", "all", 60.0),
                            ("test", "rankings", "c0", 30.0)], columns=columns)
    assert list(headline_table(counted).index) == ["clustering_accuracy"]  # counts are said apart
    diagnosed = pd.DataFrame([("test", "clustering_accuracy", "c0", 0.7), ("test", "clustering_accuracy", "c1", 0.6),
                              ("test", "generated_cv", "adapter c0", 0.1)], columns=columns)
    assert list(per_cluster_table(diagnosed, "test").index) == ["c0", "c1"]  # an adapter is no true cluster


class FixedScores:
    """A Scorer whose scores are given: float64 [n, k, M]."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores, self.k = scores, scores.shape[1]

    def score(self, inputs, iteration=0):
        return self.scores


def _ranking_metric(scores, tiers, alpha, metric):
    metrics = evaluate_mixture(FixedScores(scores), alpha, {"test": EvalSplit(None, Rankings(tiers))})
    return metrics.set_index("metric").value[metric]


def test_leave_pair_out_routing_does_not_reward_clusters_that_know_nothing_and_the_posterior_does():
    # Adapters with random scores on random 4-item rankings: any routing orders half the pairs. The
    # posterior picks, for each ranking, the adapter that fits it best (more to pick from with k), the
    # leave-pair-out routing picks without the pair it predicts.
    generator = torch.Generator().manual_seed(0)
    n, m = 2000, 4
    tiers = torch.stack([torch.randperm(m, generator=generator) for _ in range(n)])
    posterior, held_out = [], []
    for k in (1, 4, 12):
        scores = torch.randn(n, k, m, generator=generator, dtype=torch.float64)
        alpha = torch.full((k,), 1 / k, dtype=torch.float64)
        posterior.append(_ranking_metric(scores, tiers, alpha, "ranking_accuracy_posterior"))
        held_out.append(_ranking_metric(scores, tiers, alpha, "ranking_accuracy_leave_pair_out"))
    assert posterior[0] == pytest.approx(held_out[0]) and posterior[0] == pytest.approx(0.5, abs=0.02)
    assert posterior[1] > 0.65 and posterior[2] > posterior[1] + 0.05  # the optimism grows with k
    assert held_out == pytest.approx([0.5] * 3, abs=0.02)


def test_leave_pair_out_routes_each_pair_by_the_rest_of_its_ranking():
    # Two adapters ordering 4 items oppositely; a ranking that follows adapter 1 on the first three
    # items: every pair is predicted by adapter 1, the one the other items point to.
    scores = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]], dtype=torch.float64)
    tiers = torch.tensor([[3, 2, 1, 0]])  # item 3 best
    half = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert _ranking_metric(scores, tiers, half, "ranking_accuracy_leave_pair_out") == 1.0
    # two items: nothing left to route by, so the larger cluster (alpha) predicts the pair
    two = scores[:, :, :2]
    assert _ranking_metric(two, torch.tensor([[1, 0]]), torch.tensor([0.3, 0.7], dtype=torch.float64),
                           "ranking_accuracy_leave_pair_out") == 1.0
    assert _ranking_metric(two, torch.tensor([[1, 0]]), torch.tensor([0.7, 0.3], dtype=torch.float64),
                           "ranking_accuracy_leave_pair_out") == 0.0


def test_the_marginal_is_the_mixtures_pairwise_probability_not_a_pool_of_scores():
    # alpha (0.3, 0.7), score gaps +10 and -2 for item 0 over item 1: the pool 0.3 * 10 - 0.7 * 2 > 0
    # puts item 0 first, the mixture puts it first with probability 0.3 sigmoid(10) + 0.7 sigmoid(-2) = 0.38.
    scores = torch.tensor([[[10.0, 0.0], [0.0, 2.0]]], dtype=torch.float64)
    alpha = torch.tensor([0.3, 0.7], dtype=torch.float64)
    assert _ranking_metric(scores, torch.tensor([[1, 0]]), alpha, "ranking_accuracy_marginal") == 1.0  # item 1 best
    assert _ranking_metric(scores, torch.tensor([[1, 0]]), alpha.flip(0), "ranking_accuracy_marginal") == 0.0


def test_scores_that_are_not_finite_are_refused_not_routed_to_cluster_0():
    scores = torch.tensor([[[float("nan"), 0.0], [1.0, 0.0]]], dtype=torch.float64)
    with pytest.raises(FloatingPointError, match=r"evaluation: 1 score\(s\) of cluster\(s\) \[0\] are inf or NaN"):
        _ranking_metric(scores, torch.tensor([[0, 1]]), torch.tensor([0.5, 0.5], dtype=torch.float64),
                        "ranking_accuracy_posterior")


def test_a_split_without_rankings_is_refused_not_scored_ari_one():
    empty = EvalSplit(None, Rankings(torch.zeros((0, 2), dtype=torch.long)), np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match=r"split\(s\) \['test'\] hold no rankings"):
        evaluate_mixture(FixedScores(torch.zeros((0, 2, 2), dtype=torch.float64)), torch.tensor([0.5, 0.5], dtype=torch.float64),
                         {"test": empty})


def test_rankings_without_a_known_pair_give_nan_accuracy_without_numpys_warning():
    scores = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]] * 2, dtype=torch.float64)  # [n=2, k=2, M=2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = _ranking_metric(scores, torch.zeros((2, 2), dtype=torch.long), torch.tensor([0.5, 0.5], dtype=torch.float64),
                                "ranking_accuracy_posterior")
    assert np.isnan(value)


def test_synthetic_rankings_are_plackett_luce_draws_of_value_over_noise():
    # appendix B.1: Gumbel noise of scale `noise` on the values makes each ranking an exact PL draw
    # with scores value / noise: a response of value 1 among two of value 0 is first with e / (e + 2)
    data = generate_synthetic(SyntheticConfig(n=40000, k=1, m=3, n_values=2, noise=1.0, seed=5))
    values = data.values[:, :, 0]
    one_high = values.sum(1) == 1
    top = data.tiers[one_high].argmin(1)
    assert abs((values[one_high][np.arange(one_high.sum()), top] == 1).mean() - np.e / (np.e + 2)) < 0.015
    noisy = generate_synthetic(SyntheticConfig(n=5, k=2, m=3, noise=2.0, seed=0))
    assert torch.equal(noisy.true_scores(), torch.as_tensor(noisy.values, dtype=torch.float64).permute(0, 2, 1) / 2.0)
    below = generate_synthetic(SyntheticConfig(n=3000, k=2, m=3, n_generated=3, n_values=4, augment_mode="below"))
    assert (below.values[:, 3:, :].max(1) < below.values[:, :3, :].min(1)).all()  # strictly below every original
