"""Baselines as presets of one engine, the comparison tables, and the compare flow end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moplex_core.artifacts import verify
from moplex_core.config import PipelineConfig, pipeline_preset, with_overrides
from moplex_core.experiments.compare import (all_variants_table, chance_level, em_start_table, per_cluster_shape,
                                             plan_runs, sampling_note, summary_shape)
from moplex_core.methods import METHODS, method_config
from moplex_core.report import markdown_table

TINY_BASE = PipelineConfig.model_validate({
    "ingest": {"dataset": "synthetic", "synthetic": {"n": 36, "k": 3, "m": 3},
               "split": {"fractions": [0.5, 0.25, 0.25]}},
    "tiny_model": {"pretrain_steps": 5, "hidden_size": 32},
    "augment": {"backend": "hf", "model": "tiny", "n_generated": 1, "max_new_tokens": 4,
                "on_shortfall": "keep_fewer"},
    "cache": {"model": "tiny"},
    "train": {"k": 3, "anchors": 1, "em_iterations": 1, "lora_r": 4, "lora_targets": ["q_proj", "v_proj"]},
    "stage_retries": 0,
})


def test_every_method_is_the_base_config_with_its_documented_differences():
    expected = {  # method: (k, likelihood, hard, augmented, anchors)
        "dpo": (1, "bt_pairs", False, False, None),
        "single_pl": (1, "pl", False, False, None),
        "mixture_bt": (3, "bt_pairs", False, False, None),
        "maxmin_bt": (3, "bt_pairs", True, False, None),
        "moplex": (3, "pl", False, True, 1),
        "no_pl": (3, "bt_pairs", False, True, 1),
        "no_aug": (3, "pl", False, False, 1),
        "k1": (1, "pl", False, True, 1),
        "full": (3, "pl", False, True, None),
        "guarded": (3, "pl", False, True, 1),
    }
    assert set(expected) == set(METHODS)
    for method, (k, likelihood, hard, augmented, anchors) in expected.items():
        config = method_config(TINY_BASE, method, seed=7)
        train = config.train
        assert (train.k, train.likelihood, train.hard, config.augment is not None, train.anchors) == \
            (k, likelihood, hard, augmented, anchors), method
        assert train.seed == 7 and config.evaluate.method == method
        # nothing else moves: the shared stages keep their versions
        assert (config.ingest, config.cache, config.tiny_model) == (TINY_BASE.ingest, TINY_BASE.cache, TINY_BASE.tiny_model)
        assert train.lr == TINY_BASE.train.lr and train.em_iterations == TINY_BASE.train.em_iterations
        assert train.exact_fallback == (0.5 if method == "guarded" else None)


def test_without_generated_responses_a_at_least_m_computes_every_response_exactly():
    persona = pipeline_preset("persona-paper")  # a = 6 of m' = 26; m = 2 originals
    assert persona.train.anchors == 6 and persona.responses_per_example() == 26
    assert method_config(persona, "no_aug", 0).train.anchors is None
    assert method_config(persona, "moplex", 0).train.anchors == 6
    assert method_config(with_overrides(TINY_BASE, ["ingest.synthetic.m=4", "train.anchors=2"]), "no_aug", 0
                         ).train.anchors == 2  # a < m: the anchors stay
    assert method_config(with_overrides(TINY_BASE, ["ingest.synthetic.m=4", "train.anchors=4"]), "no_aug", 0
                         ).train.anchors is None  # a = m: every response is an anchor, so exact


def test_a_base_that_is_not_moplex_and_unknown_methods_are_refused():
    with pytest.raises(ValueError, match="base config must be MoPLEx"):
        method_config(with_overrides(TINY_BASE, ["train.anchors=null"]), "moplex", 0)
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        method_config(TINY_BASE, "ppo", 0)
    with pytest.raises(ValueError, match="distinct"):
        plan_runs(TINY_BASE, ["moplex", "moplex"], [0])
    with pytest.raises(ValueError, match="fault.stage = 'train' would fail every retry"):
        plan_runs(with_overrides(TINY_BASE, ["fault.stage=train"]), ["moplex"], [0])
    runs = plan_runs(TINY_BASE, ["dpo", "moplex"], [0, 1])
    assert [(m, s) for m, s, _ in runs] == [("dpo", 0), ("dpo", 1), ("moplex", 0), ("moplex", 1)]


def test_the_shipped_compare_preset_is_a_moplex_base():
    base = pipeline_preset("synthetic-compare")
    assert [m for m, _, _ in plan_runs(base, list(METHODS), [0])] == list(METHODS)


def _metrics(rows):
    return pd.DataFrame(rows, columns=["method", "split", "metric", "cluster", "value", "seed"])


def test_tables_report_percent_mean_and_sample_std_over_seeds():
    rows = []
    for seed, (acc, rank_a, rank_b) in enumerate([(0.6, 0.7, 0.9), (0.8, 0.8, 0.7)]):
        rows += [("moplex", "test", "clustering_accuracy", "all", acc, seed),
                 ("moplex", "test", "ranking_accuracy_posterior", "a", rank_a, seed),
                 ("moplex", "test", "ranking_accuracy_posterior", "b", rank_b, seed),
                 # the all-rankings value is ignored where per-cluster rows exist (Average = mean of clusters)
                 ("moplex", "test", "ranking_accuracy_posterior", "all", 0.0, seed),
                 ("moplex", "validation", "clustering_accuracy", "all", 0.0, seed),
                 ("dpo", "test", "clustering_accuracy", "all", 1 / 3, seed),
                 ("dpo", "test", "ranking_accuracy_posterior", "a", 0.5, seed),
                 ("dpo", "test", "ranking_accuracy_posterior", "b", 0.5, seed),
                 ("dpo", "test", "ranking_accuracy_posterior", "all", 0.5, seed)]
    metrics = _metrics(rows)
    t2 = summary_shape(metrics, "toy")
    # clustering accuracy: mean 70.0, sample std of (0.6, 0.8) = 0.1414 -> 14.1; dpo (k = 1) has no clustering row
    assert "| MoPLEx (Alg. 2) (`moplex`) | 70.0 ± 14.1 |" in t2
    assert t2.count("`dpo`") == 1 and "| DPO (`dpo`) | 50.0 ± 0.0 |" in t2
    assert "| MoPLEx (Alg. 2) (`moplex`) | 77.5 ± 3.5 |" in t2  # ranking: (0.8, 0.75)
    metrics_with_diagnostics = pd.concat([metrics, _metrics([("moplex", "test", "generated_cv", "adapter c0", 0.1, 0)])])
    assert chance_level(metrics_with_diagnostics) is None  # no per-label clustering rows: labels unknown
    labelled = pd.concat([metrics_with_diagnostics, _metrics([("moplex", "test", "clustering_accuracy", c, 0.5, 0)
                                                               for c in "ab"])])
    assert chance_level(labelled) == 0.5
    t3 = per_cluster_shape(metrics)
    assert t3.splitlines()[0] == "| method | a | b | Average |"
    assert "| MoPLEx (Alg. 2) (`moplex`) | 75.0 ± 7.1 | 80.0 ± 14.1 | 77.5 ± 3.5 |" in t3
    # a label with no rankings in the split: evaluate writes NaN, the tables a dash (as its own report)
    empty = pd.concat([metrics, _metrics([("moplex", "test", "ranking_accuracy_posterior", "c", float("nan"), s)
                                          for s in (0, 1)])])
    assert "| MoPLEx (Alg. 2) (`moplex`) | 75.0 ± 7.1 | 80.0 ± 14.1 | - | 77.5 ± 3.5 |" in per_cluster_shape(empty)
    # a PERSONA profile's label holds "|": escaped, so the header keeps one cell per cluster
    assert np.isnan(all_variants_table(metrics).loc["dpo", "clustering_accuracy"])  # k = 1: nothing to cluster
    assert all_variants_table(metrics).loc["moplex", "clustering_accuracy"] == pytest.approx(0.7)
    persona = _metrics([("moplex", "test", "ranking_accuracy_posterior", "age=18-44|sex=Female", 0.5, 0)])
    header = per_cluster_shape(persona).splitlines()[0]
    assert header == "| method | age=18-44\\|sex=Female | Average |"
    assert markdown_table(pd.DataFrame({"v": [0.5]}, index=pd.Index(["a|b"], name="label"))).splitlines()[2] == \
        "| a\\|b | 0.5000 |"


def test_the_report_says_how_much_another_sample_of_test_rankings_would_move_a_value():
    counts = [("all", 60), ("c0", 15), ("c1", 25), ("c2", 20)]
    metrics = _metrics([(m, "test", "rankings", c, float(n), s) for m in ("moplex", "dpo") for s in (0, 1)
                        for c, n in counts])
    note = sampling_note(metrics)
    # 50 / sqrt(60) = 6.45; one cluster 10.0 (25) to 12.9 (15); the Average, however the clusters correlate:
    # the mean of their bounds, (12.91 + 10.0 + 11.18) / 3 = 11.4
    assert note.startswith("The test split holds 60 rankings (c0 15, c1 25, c2 20). The sampling of these rankings "
                           "gives a value a standard error of up to 6.5 points on all of them, 11.4 on the Average "
                           "over clusters, 10.0 to 12.9 on one cluster")
    assert sampling_note(metrics[metrics.cluster == "all"]).startswith("The test split holds 60 rankings. The")
    assert sampling_note(_metrics([("moplex", "test", "clustering_accuracy", "all", 0.5, 0)])) == ""  # not counted
    empty = sampling_note(_metrics([("moplex", "test", "rankings", c, float(n), 0)
                                    for c, n in [("all", 40), ("c0", 15), ("c1", 25), ("c2", 0)]]))
    assert "(c0 15, c1 25)" in empty and "inf" not in empty and "c2" not in empty  # a label with no test rankings


def test_the_em_start_table_shows_start_end_and_their_agreement_per_method():
    rows = []
    for seed, (start, end, ari) in enumerate([(0.8, 0.5, 0.2), (0.9, 0.7, 0.4)]):
        rows += [("moplex", "train_em", "clustering_accuracy_start", "all", start, seed),
                 ("moplex", "train_em", "clustering_accuracy_final", "all", end, seed),
                 ("moplex", "train_em", "start_final_ari", "all", ari, seed),
                 ("moplex", "train_em", "estimates_relative_error", "all", 1.0 + seed, seed),
                 ("moplex", "train_em", "estimates_same_cluster", "all", 0.5, seed),
                 ("moplex", "test", "clustering_accuracy", "all", 0.0, seed)]
    table = em_start_table(_metrics(rows))
    assert table.splitlines()[2] == ("| MoPLEx (Alg. 2) (`moplex`) | 85.0 ± 7.1 | 60.0 ± 14.1 | 0.30 ± 0.14 | "
                                     "1.50 ± 0.71 | 50.0 ± 0.0 | - |")
    unlabelled = em_start_table(_metrics([("no_aug", "train_em", "start_final_ari", "all", 1.0, 0)]))
    assert unlabelled.splitlines()[2] == "| w/o generated responses (`no_aug`) | - | - | 1.00 | - | - | - |"
    assert em_start_table(_metrics(rows[5:6])) == ""
    single = em_start_table(_metrics([("k1", "train_em", "estimates_relative_error", "all", 1.2, 0),
                                      ("k1", "train_em", "estimates_same_cluster", "all", 1.0, 0)]))
    assert single.splitlines()[2] == "| w/o mixture models (`k1`) | - | - | - | 1.20 | 100.0 | - |"
    guarded = [("guarded", "train_em", "clustering_accuracy_final", "all", 0.5, seed) for seed in range(3)]
    guarded += [("guarded", "train_em", "exact_fallback_iteration", "all", step, seed) for seed, step in [(2, 3), (0, 0)]]
    assert em_start_table(_metrics(guarded)).splitlines()[2] == ("| MoPLEx + exact fallback (not in the paper) "
                                                                 "(`guarded`) | - | 50.0 ± 0.0 | - | - | - | "
                                                                 "2 of 3 seeds, at E-step 0, 3 |")



@pytest.mark.filterwarnings("ignore:Tight layout not applied")  # one toy row: a narrow plot
def test_the_report_names_each_evaluation_under_the_root_so_two_roots_write_the_same_bytes(tmp_path):
    # It named each evaluate folder by its absolute path: the same comparison in two roots wrote two
    # report.md (found by running `moplex experiment compare` twice, 2026-11-25).
    from moplex_core.artifacts import ArtifactStore
    from moplex_core.evaluate import METRICS_FILE
    from moplex_core.experiments.compare import write_comparison

    reports = []
    for root in (tmp_path / "a", tmp_path / "elsewhere" / "b"):
        store = ArtifactStore(root)
        with store.writer("evaluate", "0123456789ab", config={}) as w:
            w.write_table(METRICS_FILE, _metrics([("dpo", "test", metric, cluster, 0.5, 0) for cluster in ("a", "b", "all")
                                                  for metric in ("ranking_accuracy_posterior", "clustering_accuracy")]))
        folder = write_comparison(store, "toy", [("dpo", 0, store.path("evaluate", "0123456789ab"))])
        reports.append((folder / "report.md").read_bytes())
    assert reports[0] == reports[1]
    assert b"| dpo | 0 | `evaluate/0123456789ab` |" in reports[0] and str(tmp_path).encode() not in reports[0]
    assert b"No cluster is matched to a label" in reports[0]  # no matched_adapter rows


@pytest.mark.parametrize("fit_split, said", [
    ("validation", "Cluster ids are matched to the true labels on validation; chance"),
    ("test", "Cluster ids are matched to the true labels on test (the test split itself, for a source without "
             "another: its clustering accuracy and oracle ranking accuracy are in-sample, upper bounds); chance")])
def test_the_report_names_the_split_the_matching_was_fitted_on(tmp_path, fit_split, said):
    # It said "on validation" whatever evaluate.fit_split was, also where the matching was fitted on the
    # very split it reports (a source without a validation split; review helper-167).
    from moplex_core.artifacts import ArtifactStore
    from moplex_core.evaluate import MATCHED_ADAPTER, METRICS_FILE
    from moplex_core.experiments.compare import write_comparison

    store = ArtifactStore(tmp_path)
    rows = [("moplex", "test", metric, cluster, 0.5, 0) for cluster in ("a", "b", "all")
            for metric in ("ranking_accuracy_posterior", "clustering_accuracy")]
    rows += [("moplex", fit_split, MATCHED_ADAPTER, cluster, float(c), 0) for c, cluster in enumerate("ab")]
    with store.writer("evaluate", "0123456789ab", config={}) as w:
        w.write_table(METRICS_FILE, _metrics(rows))
    report = (write_comparison(store, "toy", [("moplex", 0, store.path("evaluate", "0123456789ab"))])
              / "report.md").read_text()
    assert said in report


@pytest.mark.slow
def test_compare_flow_runs_methods_and_seeds_sharing_stages_and_reuses_them(prefect_env, tmp_path):
    from flows.compare import compare_flow

    base = with_overrides(TINY_BASE, [f"root={tmp_path}"])
    methods = ["moplex", "mixture_bt", "k1"]  # k1: one cluster, no EM start, but an estimation check
    folder = compare_flow(methods, seeds=2, config=base)
    verify(folder)
    comparison = pd.read_parquet(f"{folder}/comparison.parquet")
    assert sorted(set(zip(comparison.method, comparison.seed))) == sorted((m, s) for m in methods for s in (0, 1))
    report = Path(folder, "report.md").read_text()
    assert report.startswith(f"# moplex method comparison on `{base.ingest.dataset}`")
    assert "## Paper Table 3 shape" in report and "MaxMin" not in report and "EM-DPO (`mixture_bt`) |" in report
    assert "The test split holds " in report and "The ± here are over seeds on this one sample" in report
    kept = report.split("## What EM kept of its start")[1].split("\n## ")[0]
    assert "| MoPLEx (Alg. 2) (`moplex`) | " in kept and "| EM-DPO (`mixture_bt`) | " in kept
    assert "| w/o mixture models (`k1`) | - | - | - | " in kept
    # ingest, model and augment once; a cache with and one without generated responses; a train per run
    count = {stage: len([p for p in (tmp_path / stage).iterdir() if not p.name.startswith(".")])
             for stage in ("ingest", "model", "augment", "cache", "train", "evaluate")}
    assert count == {"ingest": 1, "model": 1, "augment": 1, "cache": 2, "train": 6, "evaluate": 6}
    manifests = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/manifest.json")}
    assert compare_flow(methods, seeds=2, config=base) == folder
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/manifest.json")} == manifests  # all reused
    # --set values on the base: their own comparison, named in its report (this one changes no stage's version)
    changed = compare_flow(methods, seeds=2, config=base, overrides=[f"root={tmp_path}", "train.score_batch_size=4"])
    assert changed != folder and "changed by `train.score_batch_size=4`;" in Path(changed, "report.md").read_text()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/manifest.json") if p.parts[-3] != "compare"} == \
        {p: t for p, t in manifests.items() if p.parts[-3] != "compare"}
