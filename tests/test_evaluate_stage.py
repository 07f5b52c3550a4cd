"""The evaluate stage on a real (tiny) trained mixture: metrics.parquet, report.md, plots; versioned."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moplex_core.artifacts import ArtifactStore, verify
from moplex_core.assign import ASSIGN_SCHEMA
from moplex_core.cache import load_policy_inputs, run_cache
from moplex_core.config import CacheConfig, EvaluateConfig, IngestConfig, TrainConfig
from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.em import likelihood_falls
from moplex_core.evaluate import (METRICS_COLUMNS, em_start_metrics, estimation_rows, mixture_table, plan_evaluate,
                                  run_evaluate)
from moplex_core.ingest import run_ingest
from moplex_core.inspect import inspect_path
from moplex_core.report import write_report
from moplex_core.train import load_posteriors, run_train
from lm_fixtures import tiny_model_dir  # noqa: F401  (fixture)
from stage_fixtures import tiny_trained_mixture


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(store, train folder, cache folder): synthetic k = 3 rankings, the pipeline's tiny model, one EM iteration."""
    store = ArtifactStore(tmp_path_factory.mktemp("artifacts"))
    _, cache, train = tiny_trained_mixture(store)
    return store, train, cache


def _mixture(train):
    """The report's mixture table of the train artifact at ``train``, with the alpha it trained."""
    return mixture_table(torch.tensor(json.loads((train / "result.json").read_text())["alpha"]),
                         load_posteriors(train)[2])


def test_evaluation_writes_labelled_metrics_a_report_and_plots(trained):
    store, train, cache = trained
    result = run_evaluate(EvaluateConfig(), train, cache, store)
    assert result.built
    verify(result.path)
    metrics = pd.read_parquet(result.path / "metrics.parquet")
    assert tuple(metrics.columns) == METRICS_COLUMNS
    schema = pq.read_schema(result.path / "metrics.parquet")  # the pandas version does not show
    assert schema.metadata is None and schema.types == [pa.string()] * 4 + [pa.float64(), pa.int64()]
    assert set(metrics.split) == {"validation", "test", "train_em"} and set(metrics.method) == {"moplex"}
    assert set(metrics.seed) == {0}
    overall = metrics[metrics.cluster == "all"].set_index(["split", "metric"]).value
    for split in ("validation", "test"):
        for metric in ("clustering_accuracy", "ranking_accuracy_posterior", "ranking_accuracy_oracle",
                       "ranking_accuracy_marginal"):
            assert 0.0 <= overall[split, metric] <= 1.0
        assert np.isfinite(overall[split, "heldout_log_likelihood"]) and overall[split, "heldout_log_likelihood"] < 0
    # train_em: the start EM kept in the train artifact against its final posteriors, no scoring
    _, start, final = load_posteriors(train)
    labels = np.array([int(c.removeprefix("c")) for c in load_policy_inputs(cache, "train")[1]])
    expected = em_start_metrics(start, final, labels).set_index("metric").value
    assert overall["train_em"].to_dict().keys() == expected.to_dict().keys()
    np.testing.assert_array_equal(overall["train_em"][expected.index].to_numpy(), expected.to_numpy())  # NaN too
    assert set(expected.index) == {"start_final_ari", "ari_start", "ari_final", "clustering_accuracy_start",
                                   "clustering_accuracy_final"}
    per_cluster = metrics[(metrics.metric == "clustering_accuracy") & (metrics.cluster != "all")]
    assert set(per_cluster.cluster) <= {"c0", "c1", "c2"}
    matched = metrics[metrics.metric == "matched_adapter"]
    assert set(matched.split) == {"validation"} and sorted(matched.cluster) == ["c0", "c1", "c2"]
    report = (result.path / "report.md").read_text()
    assert "posterior" in report and "oracle" in report and "marginal" in report
    assert "matched to the true labels (Hungarian) on `validation`" in report and "## Per cluster (test)" in report
    table = report.split("Which adapter serves which true label (the matching fitted on `validation`):")[1]
    assert "| true label | adapter |" in table
    assert all(f"| {row.cluster} | c{int(row.value)} |" in table for row in matched.itertuples())
    section = report.split("## EM's start and end (training rankings)")[1].split("\n## ")[0]
    assert "|  | start | final |" in section and "| clustering_accuracy |" in section
    for png in ("em_log_likelihood.png", "cluster_accuracy.png", "confusion_test.png"):
        assert f"plots/{png}" in report
        assert (result.path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shown = inspect_path(result.path, rows=1)
    assert "-- metrics.parquet:" in shown and "values over all rankings (metric x split):" in shown
    # the mixture: alpha as trained, each training ranking on its argmax-gamma adapter
    alpha = json.loads((train / "result.json").read_text())["alpha"]
    mixture = mixture_table(torch.tensor(alpha, dtype=torch.float64), final)
    assert mixture["training rankings"].tolist() == np.bincount(final.argmax(1).numpy(), minlength=3).tolist()
    held = final.max(1).values
    assert mixture["mean posterior"].tolist() == pytest.approx(
        [float(held[final.argmax(1) == c].mean()) for c in range(3)], nan_ok=True)
    section = report.split("## The mixture")[1].split("\n## ")[0]
    assert "| adapter | alpha | training rankings | mean posterior |" in section
    assert all(f"| c{c} | {a:.4f} | {n} |" in section for c, (a, n) in enumerate(zip(alpha, mixture["training rankings"])))


def test_the_stage_metrics_are_the_trained_mixtures_own(trained):
    """Recomputed here from the trained adapters, the cache and the labels: held-out log-likelihood,
    ARI and the clustering accuracy of the Hungarian matching fitted on validation, applied to test.
    A stage that scored with anything but the trained adapters and alpha gives other numbers."""
    from scipy.optimize import linear_sum_assignment
    from sklearn.metrics import adjusted_rand_score

    from moplex_core.em import mixture_posteriors
    from moplex_core.train import load_trained

    store, train, cache = trained
    evaluation = run_evaluate(EvaluateConfig(), train, cache, store).path
    metrics = pd.read_parquet(evaluation / "metrics.parquet")
    value = metrics[metrics.cluster == "all"].set_index(["split", "metric"]).value
    held_out = pd.read_parquet(evaluation / "assignments.parquet")  # one row per held-out ranking
    assert pq.read_schema(evaluation / "assignments.parquet") == ASSIGN_SCHEMA
    scorer, alpha, trained_result = load_trained(train)
    assigned, truth = {}, {}
    for split in ("validation", "test"):
        inputs, clusters = load_policy_inputs(cache, split)
        scores = scorer.exact_scores(inputs)  # [n, k, M]
        gamma, ll = mixture_posteriors(scores, inputs.rankings(trained_result.likelihood), alpha)
        assigned[split], truth[split] = gamma.argmax(1).numpy(), np.array([int(c.removeprefix("c")) for c in clusters])
        assert value[split, "heldout_log_likelihood"] == pytest.approx(float(ll.mean()), abs=1e-9)
        assert value[split, "ari"] == pytest.approx(adjusted_rand_score(truth[split], assigned[split]), abs=1e-12)
        rows = held_out[held_out.split == split]
        assert rows.example_id.tolist() == list(inputs.example_ids) and rows.cluster.tolist() == list(clusters)
        assert rows.assigned.tolist() == assigned[split].tolist()
        np.testing.assert_allclose(np.stack(rows.posterior.to_numpy()), gamma.numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(rows.log_likelihood.to_numpy(), ll.numpy(), rtol=0, atol=1e-9)
        for row_scores, row_scores_here, sequences in zip(rows.scores, scores, inputs.sequences):
            assert np.stack(row_scores).shape == (scorer.k, len(sequences))
            np.testing.assert_allclose(np.stack(row_scores), row_scores_here[:, :len(sequences)].numpy(), atol=1e-9)
    assert held_out.split.tolist() == ["validation"] * len(truth["validation"]) + ["test"] * len(truth["test"])
    counts = np.zeros((scorer.k, 3), dtype=np.int64)  # [cluster, label] on validation
    np.add.at(counts, (assigned["validation"], truth["validation"]), 1)
    rows, cols = linear_sum_assignment(-counts)
    label_of = dict(zip(rows.tolist(), cols.tolist()))
    for split in ("validation", "test"):
        expected = np.mean([label_of.get(c, -1) == t for c, t in zip(assigned[split], truth[split])])
        assert value[split, "clustering_accuracy"] == pytest.approx(expected, abs=1e-12)


def test_the_report_says_where_the_likelihood_fell_and_how_far_off_the_estimates_were(trained, tmp_path):
    store, train, cache = trained
    metrics = pd.read_parquet(run_evaluate(EvaluateConfig(), train, cache, store).path / "metrics.parquet")
    history = [-3.0, -2.9, -2.95, -2.97, -2.8, -2.8 - 1e-9]  # the last is rounding, not a fall
    check = {"examples": 60, "iteration": 5, "estimated_entries": 720, "mean_abs_error": 2.6, "score_spread": 0.32,
             "relative_error": 8.1, "same_cluster": 0.72, "log_likelihood_estimated": -6.9,
             "log_likelihood_exact": -3.3, "holds": False,
             "by_iteration": [{"iteration": t, "relative_error": e, "same_cluster": c, "holds": e <= 1 and c >= 0.9}
                              for t, (e, c) in enumerate([(0.4, 1.0), (0.8, 0.95), (1.7, 0.9), (3.0, 0.8), (6.2, 0.75),
                                                          (8.1, 0.72)])]}
    em_result = {"history": history, "step_halvings": [0, 0, 2, 2, 0, 1], "estimation_check": check}
    with ArtifactStore(tmp_path).writer("evaluate", "0123456789ab", config={}) as writer:
        write_report(writer, metrics, pd.DataFrame(), em_result, {}, {"train": "train/x"}, "pl", _mixture(train))
    section = (writer.path / "report.md").read_text().split("## EM training log-likelihood")[1].split("\n## ")[0]
    intro = (writer.path / "report.md").read_text().split("## Overall")[0]
    assert "log-likelihood per ranking under this run's Plackett-Luce model" in intro
    assert "6 iteration(s), numbered from 0 as the train log and `em/restart-RR/iter-NNNN` number them" in section
    assert "It fell at iteration(s) 2, 3. Soft EM" in section
    assert "half its learning rate (`train.backtracks`), at iteration(s) 2 (2x), 3 (2x), 5 (1x) (times halved)" in section
    estimates = (writer.path / "report.md").read_text().split("## The anchors' estimates at the end of training")[1]
    assert "(iteration 5)" in estimates and "on 60 training examples" in estimates
    assert "do not hold here" in estimates and "| relative_error | 8.1000 |" in estimates
    assert "| 1 | 0.8000 | 0.9500 | True |" in estimates and "| 2 | 1.7000 | 0.9000 | False |" in estimates
    assert likelihood_falls(history) == [2, 3]


def test_a_single_policy_with_anchors_has_an_estimation_check_and_no_em_start_section(trained, tmp_path):
    # k = 1 keeps no EM start (one partition), but its anchors' check still gives train_em rows
    store, train, cache = trained
    metrics = pd.read_parquet(run_evaluate(EvaluateConfig(), train, cache, store).path / "metrics.parquet")
    check = {"examples": 8, "iteration": 1, "estimated_entries": 16, "mean_abs_error": 0.2, "score_spread": 0.4,
             "relative_error": 0.5, "same_cluster": 1.0, "log_likelihood_estimated": -1.1,
             "log_likelihood_exact": -1.0, "holds": True}
    metrics = pd.concat([metrics[metrics.split != "train_em"],
                         estimation_rows(check).assign(method=metrics.method[0], seed=metrics.seed[0])])
    with ArtifactStore(tmp_path).writer("evaluate", "0123456789ab", config={}) as writer:
        write_report(writer, metrics, pd.DataFrame(), {"history": [-1.2, -1.1], "estimation_check": check}, {},
                     {"train": "train/x"}, "pl", _mixture(train))
    report = (writer.path / "report.md").read_text()
    assert "## The anchors' estimates at the end of training" in report and "EM's start and end" not in report

    fallback = {"iteration": 0, "relative_error": 1.78}  # train.exact_fallback at the first E-step: nothing measured
    with ArtifactStore(tmp_path).writer("evaluate", "ba9876543210", config={}) as writer:
        write_report(writer, metrics[metrics.split != "train_em"], pd.DataFrame(),
                     {"history": [-1.2, -1.1], "estimation_check": None, "fell_back": fallback}, {}, {"train": "train/x"},
                     "pl", _mixture(train))
    section = (writer.path / "report.md").read_text().split("## The anchors' estimates")[1]
    assert "At E-step 0 the estimates were off by 1.78 times the spread" in section and "redid" in section
    assert "the final partition rests on exact scores" in section
    measured = check | {"by_iteration": [{"iteration": 0, "relative_error": 0.4, "same_cluster": 1.0, "holds": True},
                                         {"iteration": 1, "relative_error": 1.78, "same_cluster": None, "holds": False}]}
    with ArtifactStore(tmp_path).writer("evaluate", "cba987654321", config={}) as writer:
        write_report(writer, metrics, pd.DataFrame(), {"history": [-1.2, -1.1], "estimation_check": measured,
                                                       "fell_back": fallback | {"iteration": 1}}, {}, {"train": "x"},
                     "pl", _mixture(train))
    section = (writer.path / "report.md").read_text().split("## The anchors' estimates until EM fell back")[1]
    assert "| 1 | 1.7800 | - | False |" in section and "At E-step 1 the estimates" in section


def test_the_same_evaluation_is_a_version_that_is_skipped(trained):
    store, train, cache = trained
    first = run_evaluate(EvaluateConfig(), train, cache, store)
    again = run_evaluate(EvaluateConfig(device="cpu", score_batch_size=4), train, cache, store)
    assert again.ref == first.ref and not again.built
    pd.testing.assert_frame_equal(again.metrics, first.metrics)
    assert plan_evaluate(EvaluateConfig(method="k3"), train, cache, store).ref != first.ref


def test_a_train_artifact_is_evaluated_only_with_its_own_cache(trained, tmp_path):
    store, train, cache = trained
    other = run_ingest(IngestConfig(dataset="synthetic", synthetic={"n": 12, "k": 3, "m": 3}), store).path
    with pytest.raises(ValueError, match="was trained on cache/"):
        plan_evaluate(EvaluateConfig(), train, other, store)


def test_the_estimation_check_becomes_train_em_rows_for_the_comparison():
    assert estimation_rows(None).empty  # every response exact: nothing was estimated
    rows = estimation_rows({"relative_error": None, "same_cluster": 0.75}).set_index("metric")
    assert set(rows.split) == {"train_em"} and set(rows.cluster) == {"all"}
    assert np.isnan(rows.value["estimates_relative_error"]) and rows.value["estimates_same_cluster"] == 0.75
    assert "exact_fallback_iteration" not in rows.index
    fell_back = estimation_rows(None, {"iteration": 0, "relative_error": 1.1})  # nothing measured before E-step 0
    assert fell_back.metric.tolist() == ["exact_fallback_iteration"] and fell_back.value.tolist() == [0.0]


def test_rankings_without_cluster_labels_are_evaluated_without_the_metrics_that_need_them(tiny_model_dir, tmp_path):  # noqa: F811
    """Data with no ground-truth groups (HelpSteer2's preference pairs, a generic source without a
    cluster column) still trains and evaluates: likelihood, the posterior and marginal ranking
    accuracies and the EM start rows, and nothing that needs a label (no matching, no oracle)."""
    store = ArtifactStore(tmp_path)
    data = generate_synthetic(SyntheticConfig(n=16, k=2, m=3, seed=0))
    frame = data.to_frame(np.array(["train"] * 8 + ["validation"] * 4 + ["test"] * 4)).drop(columns=["generated"])
    frame["cluster"] = None
    version = store.version("ingest", {"unlabelled": 16})
    with store.writer("ingest", version, config={}) as writer:
        writer.write_shard(0, pa.Table.from_pandas(frame, preserve_index=False))
    cache = run_cache(CacheConfig(model=str(tiny_model_dir)), store.path("ingest", version), store, progress=False).path
    train = run_train(TrainConfig(k=2, lora_r=4, lora_targets=("q_proj", "v_proj"), anchors=None, em_iterations=1,
                                  init="dirichlet", dtype="float32", device="cpu"), cache, store, progress=False).path
    result = run_evaluate(EvaluateConfig(), train, cache, store)
    metrics = pd.read_parquet(result.path / "metrics.parquet")
    assert set(metrics.cluster) == {"all"}
    overall = metrics.set_index(["split", "metric"]).value
    for split in ("validation", "test"):
        assert np.isfinite(overall[split, "heldout_log_likelihood"])
        for metric in ("ranking_accuracy_posterior", "ranking_accuracy_marginal"):
            assert 0.0 <= overall[split, metric] <= 1.0
    assert not metrics.metric.str.contains(r"clustering_accuracy|^ari$|^nmi$|oracle|matched").any(), set(metrics.metric)
    assert set(metrics[metrics.split == "train_em"].metric) == {"start_final_ari"}  # the start against the end
    assert "The rankings carry no cluster labels: no clustering accuracy and no oracle routing" in \
        (result.path / "report.md").read_text()


@pytest.mark.filterwarnings("ignore:Glyph:UserWarning")  # the plots draw the labels' control characters as boxes
def test_a_label_from_a_dataset_shows_in_the_whole_report_as_its_text(trained, tmp_path):
    # The Prefect UI renders report.md and `make demo` prints it: a true label is any text a dataset holds, and
    # it reaches the report's tables and its "Rankings per true cluster" line (which once took it raw), and the
    # plots, where "$\frac$" was TeX that matplotlib failed to parse.
    from markdown_it import MarkdownIt

    store, train, cache = trained
    metrics = pd.read_parquet(run_evaluate(EvaluateConfig(), train, cache, store).path / "metrics.parquet")
    labels = {"c0": "[click](javascript:alert(1))", "c1": "<img src=x onerror=alert(1)>",
              "c2": "\x1b]8;;x\x07a\nb $\\frac$"}
    metrics["cluster"] = metrics.cluster.replace(labels)
    with ArtifactStore(tmp_path).writer("evaluate", "0123456789ab", config={}) as writer:
        confusion = pd.DataFrame([[0.7, 0.3]] * 3, index=list(labels.values()), columns=["c0", "c1"])
        write_report(writer, metrics, pd.DataFrame(), {"history": [-1.2, -1.1]}, {"test": confusion},
                     {"train": "train/x"}, "pl", _mixture(train))
    report = (writer.path / "report.md").read_text()
    assert "Rankings per true cluster: \\[click\\](javascript:alert(1)) " in report and "\x1b" not in report
    parser = MarkdownIt("commonmark").enable("table")
    parser.validateLink = lambda url: True  # as the UI's parser (marked), which keeps javascript: links
    tokens = [child for token in parser.parse(report) if token.type == "inline" for child in token.children]
    assert not [token for token in tokens if token.type in ("link_open", "html_inline")]
    assert {token.attrGet("src") for token in tokens if token.type == "image"} == {
        "plots/em_log_likelihood.png", "plots/cluster_accuracy.png", "plots/confusion_test.png"}
    assert not [token for token in parser.parse(report) if token.type == "html_block"]
