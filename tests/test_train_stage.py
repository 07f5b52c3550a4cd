"""The train stage: EM over k LoRA adapters, per-iteration artifacts, exact resume after SIGKILL."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from lm_fixtures import tiny_model_dir  # noqa: F401  (fixture)
from stage_fixtures import write_synthetic

from moplex_core.artifacts import ArtifactStore, read_manifest
from moplex_core.cache import cache_model, load_policy_inputs, run_cache
from moplex_core.config import CacheConfig, EvaluateConfig, TrainConfig, prompts_shared
from moplex_core.em import (EMConfig, Rankings, initial_responsibilities, likelihood_falls, posteriors_table,
                            read_posteriors)
from moplex_core.evaluate import run_evaluate
from moplex_core.ingest import check_labels_fit
from moplex_core.pl import PAD
from moplex_core.train import (BY_ITERATION, ESTIMATES, REFERENCE_GAP_WARNING, check_reference_gap, load_posteriors,
                               load_trained, make_scorer, plan_train, run_train)

CONFIG = TrainConfig(k=2, anchors=2, lora_r=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj"), lr=1e-2,
                     batch_size=4, em_iterations=3, tol=0.0, init="dirichlet", dtype="float32", device="cpu")

# Run the train stage in a fresh process; SIGKILL it right after EM iteration `kill_after` is saved.
RUN_TRAIN = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    import moplex_core.em.fit as em  # where the EM loop looks save_checkpoint up
    from moplex_core.artifacts import ArtifactStore
    from moplex_core.config import TrainConfig
    from moplex_core.train import run_train

    root, cache, config, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    save = em.save_checkpoint

    def save_then_maybe_die(restart_dir, state, example_ids, extra_files=None):
        path = save(restart_dir, state, example_ids, extra_files)
        if state.iteration == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    em.save_checkpoint = save_then_maybe_die
    run_train(TrainConfig.model_validate_json(config), cache, ArtifactStore(root), progress=False)
""")


@pytest.fixture(scope="module")
def cache_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    store = ArtifactStore(tmp_path_factory.mktemp("train-cache"))
    augmented = write_synthetic(store, n=10, m=3, n_generated=2)
    return run_cache(CacheConfig(model=str(tiny_model_dir)), augmented, store, progress=False).path


def test_train_writes_every_iteration_and_the_final_adapters(cache_dir, tmp_path):
    result = run_train(CONFIG, cache_dir, ArtifactStore(tmp_path), progress=False)
    assert result.built and result.iterations == 3
    for t in range(3):
        it_dir = result.path / "em" / "restart-00" / f"iter-{t:04d}"
        assert json.loads((it_dir / "state.json").read_text())["iteration"] == t
        assert (it_dir / "state.pt").is_file() == (t == 2)  # a resume needs the last iteration's only
        assert sorted(p.name for p in (it_dir / "adapters").iterdir() if p.is_dir()) == ["c0", "c1"]
        scores = pq.read_table(it_dir / "scores.parquet").to_pandas()
        n = scores.example_id.nunique()
        assert len(scores) == n * 2 * 5
        assert (scores.groupby(["example_id", "cluster"]).is_anchor.sum() == 2).all()
        assert (scores.estimated == ~scores.is_anchor).all()
    scorer, alpha, _ = load_trained(result.path)
    assert alpha.sum().item() == pytest.approx(1.0)
    manifest = read_manifest(result.path)
    assert manifest["config"]["resolved_dtype"] == "float32"
    assert 0 <= manifest["summary"]["reference_gap"] < 1e-4  # the cache's dtype and model: rounding only
    ids, start, final = load_posteriors(result.path)
    rankings = load_policy_inputs(cache_dir, "train")[0].rankings()
    assert ids == rankings.example_ids and final.shape == start.shape == (len(ids), 2)
    em_config = EMConfig(k=2, init="dirichlet", seed=CONFIG.seed)
    assert torch.equal(start, initial_responsibilities(em_config, None, None, rankings, seed=CONFIG.seed))
    assert torch.equal(start, read_posteriors(result.path / "em" / "restart-00" / "start.parquet", ids))
    assert run_train(CONFIG, cache_dir, ArtifactStore(tmp_path), progress=False).built is False


def test_backtracking_records_its_halvings_and_keeps_every_iteration_it_could_mend(cache_dir, tmp_path, caplog):
    config = CONFIG.model_copy(update={"backtracks": 2})
    caplog.set_level(logging.INFO, logger="moplex_core.scorers.lora_policy")
    result = json.loads((run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False).path
                         / "result.json").read_text())
    history, halvings = result["history"], result["step_halvings"]
    assert len(halvings) == 3 and halvings[0] == 0 and sum(halvings) > 0  # it falls at iteration 2 here
    assert not [t for t in likelihood_falls(history) if halvings[t] < 2]  # a fall only where halvings ran out
    # the look before each M-step (this iteration's anchors, the adapters before it) leaves the E-step's
    # estimates as they were: no M-step pays an input-gradient pass of its own
    assert "no E-step of these inputs" not in caplog.text


def test_the_last_e_steps_estimates_are_checked_against_exact_scores(cache_dir, tmp_path):
    result = run_train(CONFIG, cache_dir, ArtifactStore(tmp_path), progress=False)
    check = json.loads((result.path / "result.json").read_text())["estimation_check"]
    assert read_manifest(result.path)["summary"]["estimation_check"] == check
    scorer, _, _ = load_trained(result.path)
    inputs, _ = load_policy_inputs(cache_dir, "train")
    exact = scorer.exact_scores(inputs)  # every training example (fewer than estimation_check = 64)
    last = pq.read_table(result.path / "em" / "restart-00" / "iter-0002" / "scores.parquet").to_pandas()
    row = {example_id: i for i, example_id in enumerate(inputs.example_ids)}
    errors = [abs(r.score - exact[row[r.example_id], r.cluster, r.response_idx].item())
              for r in last[last.estimated].itertuples()]
    assert check["examples"] == len(inputs) and check["iteration"] == 2 and check["estimated_entries"] == len(errors)
    assert check["mean_abs_error"] == pytest.approx(np.mean(errors), rel=1e-4) and check["mean_abs_error"] > 0
    relative = check["relative_error"]
    assert check["holds"] == (relative is not None and relative <= 1.0 and check["same_cluster"] >= 0.9)
    # every iteration's E-step is measured the same way, under that iteration's adapters
    assert [m["iteration"] for m in check["by_iteration"]] == [0, 1, 2]
    assert {k: check[k] for k in BY_ITERATION} == check["by_iteration"][-1]
    first = json.loads((result.path / "em" / "restart-00" / "iter-0000" / ESTIMATES).read_text())
    scorer.load_adapters(result.path / "em" / "restart-00" / "iter-0000" / "adapters")
    exact = scorer.exact_scores(inputs)
    scores = pq.read_table(result.path / "em" / "restart-00" / "iter-0000" / "scores.parquet").to_pandas()
    errors = [abs(r.score - exact[row[r.example_id], r.cluster, r.response_idx].item())
              for r in scores[scores.estimated].itertuples()]
    assert first["mean_abs_error"] == pytest.approx(np.mean(errors), rel=1e-4)
    assert check["by_iteration"][0] == {k: first[k] for k in BY_ITERATION}
    full = run_train(CONFIG.model_copy(update={"anchors": None, "em_iterations": 1}), cache_dir,
                     ArtifactStore(tmp_path), progress=False)
    assert json.loads((full.path / "result.json").read_text())["estimation_check"] is None  # nothing estimated


def test_estimates_that_fail_the_check_make_em_exact_from_that_e_step_on(cache_dir, tmp_path):
    config = CONFIG.model_copy(update={"exact_fallback": 0.01})  # an error bound no estimate here meets
    result = run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False)
    summary = json.loads((result.path / "result.json").read_text())
    fell_back = summary["fell_back"]
    assert fell_back is not None and fell_back["relative_error"] > 0.01
    for t in range(3):
        it_dir = result.path / "em" / "restart-00" / f"iter-{t:04d}"
        scores = pq.read_table(it_dir / "scores.parquet").to_pandas()
        assert scores.estimated.any() == (t < fell_back["iteration"])  # exact from that E-step on
        assert (it_dir / ESTIMATES).is_file() == (t < fell_back["iteration"])
    assert summary["estimation_check"] is None and fell_back["iteration"] == 0  # they fail at once
    assert read_manifest(result.path)["summary"]["fell_back"] == fell_back
    metrics = run_evaluate(EvaluateConfig(device="cpu"), result.path, cache_dir, ArtifactStore(tmp_path)).metrics
    rows = metrics[metrics.split == "train_em"].set_index("metric").value
    assert rows["exact_fallback_iteration"] == 0 and "estimates_relative_error" not in rows  # the comparison's marker

    def trained(config):
        return json.loads((run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False).path
                           / "result.json").read_text())

    # falling back at E-step 0 redoes M-step 0 too: the run is the exact one
    assert trained(CONFIG.model_copy(update={"anchors": None}))["history"] == summary["history"]
    plain, guarded = trained(CONFIG), trained(CONFIG.model_copy(update={"exact_fallback": 1e6}))
    assert guarded["fell_back"] is None and guarded["history"] == plain["history"]  # a check that never fails
    # the fallback measured what the plain run's check measured at that E-step (same examples, adapters)
    assert plain["estimation_check"]["by_iteration"][0]["relative_error"] == \
        pytest.approx(fell_back["relative_error"], rel=1e-9)
    for wrong in ({"anchors": None}, {"estimation_check": 0}):
        with pytest.raises(ValueError, match="exact_fallback .* needs train.anchors"):
            TrainConfig(exact_fallback=0.5, **wrong)


def test_a_training_dtype_unlike_the_caches_is_measured_and_warned_about(cache_dir, caplog):
    inputs, _ = load_policy_inputs(cache_dir, "train")
    model = read_manifest(cache_dir)["config"]["model"]
    bf16 = CONFIG.model_copy(update={"dtype": "bfloat16"})
    with caplog.at_level("INFO", logger="moplex_core.train"):
        same = check_reference_gap(make_scorer(CONFIG, model), inputs, cache_dir)
        other = check_reference_gap(make_scorer(bf16, model), inputs, cache_dir)
    assert same < 1e-4 < REFERENCE_GAP_WARNING < other
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "(cache in float32, training in bfloat16)" in warning and "cache.dtype=bfloat16" in warning


def test_the_start_kept_is_the_best_restarts(cache_dir, tmp_path):
    config = CONFIG.model_copy(update={"restarts": 2, "em_iterations": 1, "seed": 11})
    result = run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False)
    summary = json.loads((result.path / "result.json").read_text())
    best = summary["restart"]
    assert best == 1  # this data and seed: the second restart wins, so the copy cannot be restart 0's by chance
    # Each restart's estimated LL comes from its own anchors: restarts are ranked with every response
    # exact. Here the estimates would have picked restart 0.
    estimated, exact = ([r[key] for r in summary["restarts"]] for key in ("log_likelihood", "exact_log_likelihood"))
    assert exact[1] > exact[0] and estimated[0] > estimated[1]
    ids, start, final = load_posteriors(result.path)
    starts = [read_posteriors(result.path / "em" / f"restart-{r:02d}" / "start.parquet", ids) for r in (0, 1)]
    assert not torch.equal(starts[0], starts[1]) and torch.equal(start, starts[best])
    finals = [read_posteriors(result.path / "em" / f"restart-{r:02d}" / "iter-0000" / "posteriors.parquet", ids)
              for r in (0, 1)]
    assert not torch.equal(finals[0], finals[1]) and torch.equal(final, finals[best])  # the best restart's end


def test_restarts_of_the_default_start_are_different_runs(cache_dir, tmp_path):
    config = CONFIG.model_copy(update={"restarts": 2, "em_iterations": 1, "init": "linearized"})
    result = run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False)
    ids = load_posteriors(result.path)[0]
    finals = [read_posteriors(result.path / "em" / f"restart-{r:02d}" / "iter-0000" / "posteriors.parquet", ids)
              for r in (0, 1)]
    assert not torch.equal(finals[0], finals[1])  # each restart's scorer has its own seed


def test_a_kmeans_start_clusters_the_lm_scorers_ranking_features(cache_dir, tmp_path):
    """train.init = kmeans: k-means over the LoRA scorer's Fisher-score features of each ranking (its
    responses' input embeddings weighted by d log P / d r at r = 0), seeded, as soft one-hot starts."""
    config = CONFIG.model_copy(update={"init": "kmeans", "em_iterations": 1})
    result = run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False)
    ids, start, _ = load_posteriors(result.path)
    assert sorted(set(start.flatten().tolist())) == [0.1, 0.9] and set(start.argmax(1).tolist()) == {0, 1}
    inputs, _ = load_policy_inputs(cache_dir, "train")
    rankings = inputs.rankings()
    scorer = make_scorer(config, cache_model(cache_dir))
    features = scorer.ranking_features(inputs, rankings)
    assert features.shape == (len(ids), 256) and features.isfinite().all()
    assert len({tuple(f) for f in features.tolist()}) == len(ids)  # each ranking its own point
    # Linear in d log P / d r: a pair ranked one way (+1/2, -1/2 at r = 0) and the other way are opposite points.
    pair = torch.full_like(rankings.tiers, PAD)
    pair[:, :2] = torch.tensor([0, 1])
    one_way = scorer.ranking_features(inputs, Rankings(pair))
    other_way = scorer.ranking_features(inputs, Rankings(pair[:, [1, 0, *range(2, pair.shape[1])]]))
    assert one_way.abs().min() > 0
    torch.testing.assert_close(other_way, -one_way)
    again = initial_responsibilities(EMConfig(k=2, init="kmeans"), scorer, inputs, rankings, seed=config.seed)
    torch.testing.assert_close(again, start, rtol=0, atol=0)  # what train wrote is that k-means, seeded alike


def test_loading_adapters_from_a_folder_without_one_per_cluster_names_the_missing_one(cache_dir, tmp_path):
    scorer = make_scorer(CONFIG, cache_model(cache_dir))
    scorer.save_adapters(tmp_path / "adapters")
    shutil.rmtree(tmp_path / "adapters" / "c1")
    with pytest.raises(FileNotFoundError, match=r"adapters/c1 does not exist; expected one PEFT adapter folder per "
                                                r"cluster c0\.\.c1 as save_adapters writes"):
        scorer.load_adapters(tmp_path / "adapters")


def test_configs_that_would_waste_restarts_or_train_nothing_are_refused():
    with pytest.raises(ValidationError, match="train.k = 1 starts every restart from the same responsibilities"):
        TrainConfig(k=1, restarts=2)
    with pytest.raises(ValidationError, match=r"train.gamma_min = 0.5 is above 1/k = 0.3333"):
        TrainConfig(k=3, gamma_min=0.5)
    TrainConfig(k=3, gamma_min=0.5, hard=True)


def test_score_batch_size_and_the_device_enter_the_version_only_with_lora_dropout(cache_dir, tmp_path):
    store = ArtifactStore(tmp_path)
    version = lambda **update: plan_train(CONFIG.model_copy(update=update), cache_dir, store).ref.version  # noqa: E731
    assert version(score_batch_size=8) == version(score_batch_size=16)
    assert version(gradient_checkpointing=True) == version()  # the same bits (tests/test_checkpointing.py)
    assert version(lora_dropout=0.1, score_batch_size=8) != version(lora_dropout=0.1, score_batch_size=16)
    assert version(lora_dropout=0.1, device="cpu", share_prompts=True) != version(lora_dropout=0.1, device="meta",
                                                                                 share_prompts=True)
    assert version(device="cpu", share_prompts=True) == version(device="meta", share_prompts=True)
    assert version(anchor_weighting="nearest") != version()
    assert version(anchor_weighting="nearest", anchors=None) == version(anchors=None)  # nothing to weigh
    assert version(anchor_draw="by_length") != version() == version(anchor_draw="uniform")  # as versions before it
    assert version(anchor_draw="by_length", anchors=1) == version(anchors=1)  # one stratum: the uniform draw


def test_shared_prompts_auto_means_on_the_cpu_only_and_is_versioned_as_it_resolves(cache_dir, tmp_path):
    """``auto`` shares prompts on the CPU (faster there) and runs the prompt per row on a GPU (faster
    on the H200, docs/gpu-efficiency.md); its version is that of the setting it resolves to."""
    auto = TrainConfig()
    assert auto.share_prompts == "auto"
    assert [prompts_shared(auto.share_prompts, device) for device in ("cpu", "cuda", "cuda:1", "mps")] == \
        [True, False, False, False]
    assert prompts_shared(False, "cpu") is False and prompts_shared(True, "cuda:0") is True
    assert make_scorer(CONFIG.model_copy(update={"share_prompts": "auto"}), cache_model(cache_dir)).share_prompts
    store = ArtifactStore(tmp_path)
    version = lambda setting: plan_train(CONFIG.model_copy(update={"share_prompts": setting, "device": "cpu"}),  # noqa: E731
                                         cache_dir, store).ref.version
    assert version("auto") == version(True) != version(False)


def test_em_can_start_from_the_rankings_own_labels(cache_dir, tmp_path):
    _, labels = load_policy_inputs(cache_dir, "train")
    names = sorted(set(labels))
    k = len(names)
    config = CONFIG.model_copy(update={"k": k, "init": "labels", "em_iterations": 1})
    result = run_train(config, cache_dir, ArtifactStore(tmp_path), progress=False)
    ids, start, final = load_posteriors(result.path)
    inputs, labels = load_policy_inputs(cache_dir, "train")
    assert ids == inputs.example_ids
    expected = torch.full((len(ids), k), 0.1 / (k - 1), dtype=torch.float64)
    expected[torch.arange(len(ids)), torch.tensor([names.index(label) for label in labels])] = 0.9
    torch.testing.assert_close(start, expected, rtol=0, atol=0)  # label i (sorted) on cluster c<i>
    assert not torch.equal(final, start)
    with pytest.raises(ValueError, match=rf"carry {k} label\(s\) \({', '.join(names)}\) and train.k = {k + 1}"):
        run_train(config.model_copy(update={"k": k + 1}), cache_dir, ArtifactStore(tmp_path / "other"), progress=False)
    assert not (tmp_path / "other" / "train").exists()
    with pytest.raises(ValueError, match="2 of the 3 in the cache at X have none"):
        check_labels_fit(["c0", None, None], ["a", "b", "c"], 1, "the cache at X")
    with pytest.raises(ValidationError, match="restarts = 2 would differ only by their adapters' random"):
        TrainConfig(init="labels", restarts=2)
    with pytest.raises(ValueError, match="give them to fit_mixture as warm_start"):
        initial_responsibilities(EMConfig(k=k, init="labels"), None, inputs, inputs.rankings(), seed=0)


def test_pairwise_hard_em_trains_on_bt_pairs_with_one_hot_posteriors(cache_dir, tmp_path):
    """The maxmin_bt baseline's settings reach EM: its log-likelihood is Bradley-Terry over pairs
    (it differs from the PL run's from the same start; EM hands the M-step the same Rankings) and
    every posterior is one-hot."""
    runs = {}
    for likelihood, hard in (("pl", False), ("bt_pairs", True)):
        config = CONFIG.model_copy(update={"likelihood": likelihood, "hard": hard, "em_iterations": 1})
        runs[likelihood] = run_train(config, cache_dir, ArtifactStore(tmp_path / likelihood), progress=False)
    gamma = pq.read_table(runs["bt_pairs"].path / "posteriors.parquet").column("gamma").to_pylist()
    assert all(sorted(g) == [0.0, 1.0] for g in gamma)
    assert runs["bt_pairs"].log_likelihood != pytest.approx(runs["pl"].log_likelihood)
    assert runs["bt_pairs"].path.name != runs["pl"].path.name  # the likelihood is part of the version


def versions(root):
    return [p for p in (root / "train").iterdir() if not p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIG, CONFIG.model_copy(update={"exact_fallback": 1.0})],
                         ids=["anchors", "exact-fallback"])  # the latter is exact from E-step 0 on
def test_resume_after_sigkill_between_iterations_reproduces_the_uninterrupted_run(cache_dir, tmp_path, config):
    def run(root, kill_after):
        return subprocess.run([sys.executable, "-c", RUN_TRAIN, str(root), str(cache_dir),
                               config.model_dump_json(), str(kill_after)], capture_output=True, text=True)

    run_train(config, cache_dir, ArtifactStore(tmp_path / "whole"), progress=False)  # here: one process start fewer
    killed = run(tmp_path / "killed", 1)
    assert killed.returncode == -signal.SIGKILL
    (version_dir,) = versions(tmp_path / "killed")
    assert not (version_dir / "manifest.json").exists()
    assert not (version_dir / "em" / "restart-00" / "iter-0002").exists()
    resumed = run(tmp_path / "killed", -1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def final(root, name):
        (path,) = versions(root)
        return pq.read_table(path / name).to_pandas()

    expected, got = final(tmp_path / "whole", "posteriors.parquet"), final(tmp_path / "killed", "posteriors.parquet")
    assert expected.example_id.tolist() == got.example_id.tolist()
    assert [list(g) for g in expected.gamma] == [list(g) for g in got.gamma]


def test_a_train_artifact_from_before_train_5_has_no_start(tmp_path):
    gamma = torch.tensor([[0.7, 0.3], [0.2, 0.8]], dtype=torch.float64)
    pq.write_table(posteriors_table(("a", "b"), gamma), tmp_path / "posteriors.parquet")
    ids, start, final = load_posteriors(tmp_path)
    assert ids == ("a", "b") and start is None and torch.equal(final, gamma)
