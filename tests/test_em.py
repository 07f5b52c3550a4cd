"""The mixture-EM engine on synthetic data with the CPU scorers (an M-step that lowers the likelihood: test_em_falls)."""

import dataclasses
import gc
import json
import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
import weakref

import numpy as np
import pytest
import torch

from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.em import (EMConfig, EMState, Rankings, fit_mixture, initial_responsibilities, load_last_checkpoint,
                            posteriors, read_posteriors, save_checkpoint, soft_one_hot)
from moplex_core.metrics import clustering_accuracy, fit_matching
from moplex_core.scorers.item import ItemScorer
from moplex_core.scorers.linear import LinearScorer
from moplex_core.pl import UNRANKED, score_gradient_at_zero

from em_fixtures import synthetic


def test_em_recovers_clusters_from_long_rankings():
    data, rankings, x = synthetic(k=3, m=8, n=1200)
    train, test = np.arange(900), np.arange(900, 1200)
    result, scorer = fit_mixture(lambda: LinearScorer(3, 3), x[train], rankings.subset(train), EMConfig(k=3, seed=1))
    gamma_train, _ = posteriors(scorer, x[train], rankings.subset(train), result.best.alpha)
    matching = fit_matching(gamma_train.argmax(1).numpy(), data.labels[train], 3, 3)
    gamma_test, _ = posteriors(scorer, x[test], rankings.subset(test), result.best.alpha)
    assert clustering_accuracy(gamma_test.argmax(1).numpy(), data.labels[test], matching) > 0.95
    # the learned weights put cluster c on integer c (up to the permutation), as the truth does
    w = scorer.theta[np.argsort(matching.mapping)]
    assert (w.argmax(1) == torch.arange(3)).all()


@pytest.mark.parametrize("init", ["kmeans", "dirichlet"])
def test_log_likelihood_never_decreases(init):
    _, rankings, x = synthetic(k=2, m=4, n=400, seed=3)
    # exact M-steps (no ridge, no skipping): EM's likelihood is then non-decreasing
    result, _ = fit_mixture(
        lambda: LinearScorer(2, 2, l2=0.0), x, rankings, EMConfig(k=2, init=init, max_iter=15, tol=0, gamma_min=0.0, seed=2)
    )
    history = np.array(result.best.history)
    assert len(history) == 15
    assert (np.diff(history) >= -1e-7).all(), history


def test_initialisations_are_seeded_and_break_symmetry():
    _, rankings, x = synthetic(k=3, m=4, n=300)
    for init in ("kmeans", "dirichlet"):
        config = EMConfig(k=3, init=init)
        a = initial_responsibilities(config, LinearScorer(3, 3), x, rankings, seed=5)
        b = initial_responsibilities(config, LinearScorer(3, 3), x, rankings, seed=5)
        assert torch.equal(a, b)
        assert torch.allclose(a.sum(1), torch.ones(300, dtype=torch.float64))
        assert a.std(0).min() > 0.05  # not uniform


class FeatureScorer(LinearScorer):
    """A linear scorer that also offers its inputs as response features (as the LM scorer does)."""

    def response_features(self, inputs):
        return inputs


def test_linearized_start_finds_the_clusters_from_the_ranked_responses_only():
    # m = 4 with 3 generated responses below (UNRANKED); k-means on single rankings is near chance here.
    data, rankings, x = synthetic(k=3, m=4, n=600, seed=2, n_generated=3)
    noisy = x.clone()
    noisy[:, 4:] = 50 * torch.randn(600, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    config = EMConfig(k=3, init="linearized")
    gamma = initial_responsibilities(config, FeatureScorer(3, 3), noisy, rankings, seed=5)
    assert torch.equal(gamma, initial_responsibilities(config, FeatureScorer(3, 3), noisy, rankings, seed=5))
    assert torch.allclose(gamma.sum(1), torch.ones(600, dtype=torch.float64))
    labels = gamma.argmax(1).numpy()
    assert clustering_accuracy(labels, data.labels, fit_matching(labels, data.labels, 3, 3)) > 0.8
    kmeans = initial_responsibilities(EMConfig(k=3), FeatureScorer(3, 3), x, rankings, seed=5).argmax(1).numpy()
    assert clustering_accuracy(kmeans, data.labels, fit_matching(kmeans, data.labels, 3, 3)) < 0.7


def test_the_linearized_starts_own_likelihood_falls_are_not_warned_about(monkeypatch):
    # Its ridge M-step may lower the likelihood alone; the warning's advice is about the LoRA adapters.
    from moplex_core.em import fit

    _, rankings, x = synthetic(k=2, m=4, n=50)
    real = fit.fit_mixture

    def falling(*args, **kwargs):
        fit._warn_if_the_likelihood_fell([-1.0, -1.1], 19)
        return real(*args, **kwargs)

    monkeypatch.setattr(fit, "fit_mixture", falling)  # where the start looks it up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        initial_responsibilities(EMConfig(k=2, init="linearized"), FeatureScorer(2, 2), x, rankings, seed=0)
        with pytest.raises(RuntimeWarning, match="EM iteration 19: the log-likelihood per ranking fell"):
            falling(lambda: FeatureScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=1))  # elsewhere: warned


def test_the_linearized_start_says_its_own_rankings_are_tied_where_only_the_generated_responses_are_below():
    _, rankings, x = synthetic(k=2, m=4, n=50, n_generated=2)
    tiers = rankings.tiers.clone()  # [50, 6]: 4 ranked, then 2 UNRANKED
    tiers[:30, :4] = 0  # 30 rankings tie their four ranked responses, above the generated ones
    with pytest.warns(RuntimeWarning) as caught:
        initial_responsibilities(EMConfig(k=2, init="linearized"), FeatureScorer(2, 2), x, Rankings(tiers), seed=0)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith("init='linearized': 30 of 50 rankings order none")


def test_linearized_start_needs_response_features():
    _, rankings, x = synthetic(k=2, m=4, n=50)
    with pytest.raises(ValueError, match="init='linearized' needs a scorer with response features.*LinearScorer"):
        initial_responsibilities(EMConfig(k=2, init="linearized"), LinearScorer(2, 2), x, rankings, seed=0)


def test_restarts_keep_the_best_log_likelihood():
    _, rankings, x = synthetic(k=3, m=3, n=300, seed=4)
    result, _ = fit_mixture(lambda: LinearScorer(3, 3), x, rankings, EMConfig(k=3, init="dirichlet", restarts=3, max_iter=10))
    finals = [s.log_likelihood for s in result.restarts]
    assert len(set(finals)) > 1
    assert result.best.log_likelihood == max(finals)


def test_a_new_restarts_scorer_is_made_with_no_other_alive_and_the_last_takes_the_best_state():
    # on a GPU each LoRA scorer holds a model: two alive would need memory for two models
    _, rankings, x = synthetic(k=3, m=3, n=300, seed=4)
    made, alive_at_make = [], []

    def make_scorer() -> LinearScorer:
        gc.collect()
        alive_at_make.append(sum(ref() is not None for ref in made))
        scorer = LinearScorer(3, 3)
        made.append(weakref.ref(scorer))
        return scorer

    result, best = fit_mixture(make_scorer, x, rankings, EMConfig(k=3, init="dirichlet", restarts=4, max_iter=3))
    assert alive_at_make == [0, 0, 0, 0]
    assert best is made[-1]() and result.best.restart != 3  # this data and seed: an earlier restart wins
    assert torch.equal(best.state_dict()["theta"], result.best.scorer_state["theta"])


def test_only_the_best_restarts_scorer_state_is_kept_and_a_repeated_start_is_warned_about(caplog):
    _, rankings, x = synthetic(k=2, m=3, n=200, seed=4)
    start = soft_one_hot(np.arange(200) % 2, 2)
    result, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, restarts=3, max_iter=2),
                            warm_start=start)
    assert [bool(s.scorer_state) for s in result.restarts] == [s is result.best for s in result.restarts]
    assert "restart 1 starts from the partition restart 0 started from" in caplog.text


def test_a_kmeans_start_that_repeats_an_earlier_one_is_replaced_by_a_dirichlet_draw(caplog):
    # clear clusters: k-means finds the same partition from every seed, so restart 1 would repeat restart 0
    _, rankings, x = synthetic(k=2, m=6, n=300, seed=4)
    caplog.set_level(logging.INFO, logger="moplex_core.em")
    result, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, restarts=2, max_iter=2))
    assert "restart 1: k-means found restart 0's partition again; starting from a Dirichlet draw" in caplog.text
    kmeans = initial_responsibilities(EMConfig(k=2), LinearScorer(2, 2), x, rankings, seed=1000, restart=1)
    dirichlet = initial_responsibilities(EMConfig(k=2, init="dirichlet"), LinearScorer(2, 2), x, rankings, seed=1000,
                                         restart=1)
    assert not torch.equal(kmeans, dirichlet) and result.restarts[1].history != result.restarts[0].history


def test_a_run_resumed_in_restart_0_still_replaces_restart_1s_repeated_kmeans_start(tmp_path):
    _, rankings, x = synthetic(k=2, m=6, n=300, seed=4)
    config = EMConfig(k=2, restarts=2, max_iter=3, tol=0)
    whole, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "whole")

    def killed(state: EMState) -> None:
        if state.restart == 0 and state.iteration == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "killed",
                    on_iteration=killed)
    resumed, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "killed")
    start = [read_posteriors(tmp_path / run / "restart-01" / "start.parquet") for run in ("whole", "killed")]
    assert torch.equal(start[0], start[1])  # the Dirichlet draw, not k-means' repeat of restart 0
    assert [r.history for r in resumed.restarts] == [r.history for r in whole.restarts]


def test_the_last_checkpoint_is_found_by_iteration_number_past_9999(tmp_path):
    _, rankings, x = synthetic(k=2, m=3, n=50)
    result, scorer = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=1))
    for iteration in (9999, 10000):
        save_checkpoint(tmp_path, dataclasses.replace(result.best, iteration=iteration), rankings.example_ids)
    assert load_last_checkpoint(tmp_path).iteration == 10000
    assert [p.parent.name for p in tmp_path.glob("iter-*/state.pt")] == ["iter-10000"]  # only the last is kept


class _OpensAFileWhenUnpickled:
    """A pickle gadget: unpickling it calls open(path, "w"), so the file appears if it ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_checkpoint_state_that_runs_code_when_unpickled_is_refused_unrun(tmp_path):
    # An artifact root copied from someone else: its state.pt may be any pickle.
    _, rankings, x = synthetic(k=2, m=3, n=50)
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2, tol=0), checkpoint_dir=tmp_path)
    state_file = tmp_path / "restart-00" / "iter-0001" / "state.pt"
    planted = torch.load(state_file, weights_only=True)
    ran = tmp_path / "the-pickle-ran"
    planted["scorer"]["gadget"] = _OpensAFileWhenUnpickled(ran)
    torch.save(planted, state_file)
    with pytest.raises(ValueError, match=r"state\.pt.*not only tensors.*delete") as refused:
        load_last_checkpoint(tmp_path / "restart-00")
    assert str(state_file) in str(refused.value)
    assert not ran.exists()


def test_a_resume_deletes_a_state_a_kill_left_before_it_was_pruned(tmp_path):
    _, rankings, x = synthetic(k=2, m=3, n=50)
    config = EMConfig(k=2, max_iter=2, tol=0)
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path)
    restart = tmp_path / "restart-00"
    shutil.copy(restart / "iter-0001" / "state.pt", restart / "iter-0000" / "state.pt")  # killed before the unlink
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path)  # finished: nothing to redo
    assert [p.parent.name for p in restart.glob("iter-*/state.pt")] == ["iter-0001"]


def test_m_step_skips_pairs_below_gamma_min():
    seen = []

    class Recording(LinearScorer):
        def fit(self, inputs, rankings, weights, iteration=0):
            seen.append(weights.clone())
            super().fit(inputs, rankings, weights, iteration)

    _, rankings, x = synthetic(k=2, m=8, n=300)
    fit_mixture(lambda: Recording(2, 2), x, rankings, EMConfig(k=2, gamma_min=0.05, max_iter=4, tol=0))
    later = torch.stack(seen[1:])
    assert ((later == 0) | (later >= 0.05)).all()
    assert (later == 0).any()  # with well-separated clusters some pairs are skipped


def test_item_scorer_k1_recovers_true_utilities():
    rng = np.random.default_rng(0)
    utilities = rng.normal(size=20)
    n, m = 4000, 5
    items = np.stack([rng.choice(20, m, replace=False) for _ in range(n)])
    noisy = utilities[items] + rng.gumbel(size=(n, m))
    tiers = np.argsort(np.argsort(-noisy, 1), 1)
    scorer = ItemScorer(1, 20, l2=1e-8)
    fit_mixture(lambda: scorer, torch.as_tensor(items), Rankings(torch.as_tensor(tiers)), EMConfig(k=1, max_iter=1))
    learned = scorer.theta[0].numpy()
    assert np.corrcoef(learned, utilities)[0, 1] > 0.98
    assert abs((learned - learned.mean()) - (utilities - utilities.mean())).max() < 0.2


def test_item_scorer_kmeans_features_put_each_slots_fisher_score_on_its_item_and_find_two_groups():
    """The classical PL mixture's k-means start: a ranking's feature is the Fisher score of each slot
    added at that slot's item id (padding adds nothing), so two groups that order the same items in
    opposite directions start in different clusters."""
    items = torch.tensor([[0, 1, 2], [2, 1, 0], [3, 0, -1]])
    rankings = Rankings(torch.tensor([[0, 1, 2], [0, 1, 2], [1, 0, -1]]))  # -1: a PAD slot
    features = ItemScorer(2, 4).ranking_features(items, rankings)
    slot = score_gradient_at_zero(rankings.index)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(3):
            if items[i, j] >= 0:
                expected[i, items[i, j]] += slot[i, j]
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    assert features[0, 0] > 0 > features[0, 2] and features[1, 2] > 0 > features[1, 0]
    assert features[2, 0] > 0 > features[2, 3] and features[2, 1:3].abs().sum() == 0  # items 1, 2 absent; the pad adds nothing
    rng = np.random.default_rng(0)
    up = np.stack([rng.permutation(6) for _ in range(40)])  # group 0 ranks low item ids first, group 1 high ones
    tiers = np.argsort(np.argsort(np.where(np.arange(40)[:, None] < 20, up, -up), 1), 1)
    start = initial_responsibilities(EMConfig(k=2, init="kmeans"), ItemScorer(2, 6), torch.as_tensor(up),
                                     Rankings(torch.as_tensor(tiers)), seed=0)
    labels = start.argmax(1)
    assert set(start.max(1).values.tolist()) == {0.9}
    assert len(set(labels[:20].tolist())) == len(set(labels[20:].tolist())) == 1 and labels[0] != labels[20]


def test_hard_em_gives_one_hot_posteriors():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    result, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, hard=True, max_iter=3))
    assert set(result.best.gamma.unique().tolist()) <= {0.0, 1.0}


def test_uniform_mixing_assigns_each_ranking_by_the_likelihood_alone():
    # MaxMin-RLHF's assignment: the cluster whose model gives the ranking the highest likelihood. Learned
    # weights tip borderline rankings to the large cluster (a lopsided start makes one).
    _, rankings, x = synthetic(k=2, m=4, n=200)
    start = torch.zeros(200, 2, dtype=torch.float64)
    start[:170, 0] = start[170:, 1] = 1.0
    fits = {mixing: fit_mixture(lambda: LinearScorer(2, 2), x, rankings,
                                EMConfig(k=2, hard=True, mixing=mixing, max_iter=2, tol=0), warm_start=start)
            for mixing in ("learned", "uniform")}
    result, scorer = fits["uniform"]
    assert result.best.alpha.tolist() == [0.5, 0.5]
    likelihood = rankings.log_likelihood(scorer.score(x, result.best.iteration))  # [n, k]
    assert torch.equal(result.best.gamma, torch.nn.functional.one_hot(likelihood.argmax(1), 2).to(torch.float64))
    learned, scorer = fits["learned"]
    joint = learned.best.alpha.log() + rankings.log_likelihood(scorer.score(x, learned.best.iteration))
    assert torch.equal(learned.best.gamma, torch.nn.functional.one_hot(joint.argmax(1), 2).to(torch.float64))
    assert not torch.equal(joint.argmax(1), (joint - learned.best.alpha.log()).argmax(1))  # the prior tipped some


def test_an_emptied_cluster_warns_and_stays_finite():
    _, rankings, x = synthetic(k=2, m=6, n=200)
    gamma0 = torch.zeros(200, 3, dtype=torch.float64)
    gamma0[:, :2] = torch.tensor([0.5, 0.5], dtype=torch.float64)
    gamma0[:100, 0], gamma0[:100, 1] = 0.9, 0.1
    gamma0[100:, 0], gamma0[100:, 1] = 0.1, 0.9
    with pytest.warns(RuntimeWarning, match="cluster"):
        result, _ = fit_mixture(
            lambda: LinearScorer(3, 2), x, rankings, EMConfig(k=3, max_iter=3, tol=0), warm_start=gamma0
        )
    assert torch.isfinite(result.best.gamma).all() and np.isfinite(result.best.history).all()
    assert result.best.gamma[:, 2].max() < 1e-6


RUN_EM = textwrap.dedent(
    """
    import os, signal, sys, torch
    from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
    from moplex_core.em import EMConfig, Rankings, fit_mixture
    from moplex_core.scorers.linear import LinearScorer
    torch.set_num_threads(1)  # bit for bit, as `moplex run --threads 1`: a loaded machine's BLAS threads need not be
    data = generate_synthetic(SyntheticConfig(n=400, k=3, m=4, seed=7))
    rankings = Rankings(torch.as_tensor(data.tiers))
    kill_after = int(sys.argv[2])
    def on_iteration(state):
        if state.iteration == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    fit_mixture(lambda: LinearScorer(3, 3), data.features(), rankings,
                EMConfig(k=3, max_iter=8, tol=0, init="dirichlet", restarts=2, seed=3),
                checkpoint_dir=sys.argv[1], on_iteration=on_iteration)
    """
)


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    def run(directory, kill_after):
        return subprocess.run([sys.executable, "-c", RUN_EM, str(directory), str(kill_after)], capture_output=True)

    assert run(tmp_path / "whole", -1).returncode == 0
    killed = run(tmp_path / "killed", 4)
    assert killed.returncode == -signal.SIGKILL
    assert load_last_checkpoint(tmp_path / "killed" / "restart-00").iteration == 4
    assert not (tmp_path / "killed" / "restart-01").exists()
    assert run(tmp_path / "killed", -1).returncode == 0
    for restart in ("restart-00", "restart-01"):
        whole = load_last_checkpoint(tmp_path / "whole" / restart)
        resumed = load_last_checkpoint(tmp_path / "killed" / restart)
        assert resumed.iteration == whole.iteration == 7
        assert torch.equal(resumed.gamma, whole.gamma)
        assert resumed.history == whole.history
        for it in range(8):
            a = (tmp_path / "whole" / restart / f"iter-{it:04d}" / "posteriors.parquet").read_bytes()
            b = (tmp_path / "killed" / restart / f"iter-{it:04d}" / "posteriors.parquet").read_bytes()
            assert a == b


def test_pairwise_observation_model_runs_the_same_engine():
    data, rankings, x = synthetic(k=2, m=6, n=400)
    pairs = Rankings(rankings.tiers, model="bt_pairs")
    result, scorer = fit_mixture(lambda: LinearScorer(2, 2), x, pairs, EMConfig(k=2, max_iter=10))
    gamma, _ = posteriors(scorer, x, pairs, result.best.alpha)
    matching = fit_matching(gamma.argmax(1).numpy(), data.labels, 2, 2)
    assert clustering_accuracy(gamma.argmax(1).numpy(), data.labels, matching) > 0.9
    with pytest.raises(ValueError, match="unknown ranking model"):
        Rankings(rankings.tiers, model="mallows")


def test_top_m_synthetic_rankings_are_partial_and_fit():
    data = generate_synthetic(SyntheticConfig(n=300, k=2, m=2, n_generated=2, augment_mode="top_m", seed=1))
    assert data.ranked_prefix.tolist() == [2] * 300
    rankings = Rankings(torch.as_tensor(data.tiers), torch.as_tensor(data.ranked_prefix))
    assert (rankings.observed_tiers == UNRANKED).sum(1).eq(2).all()
    frame = data.to_frame()
    assert frame.responses.map(len).eq(4).all() and frame.ranked_prefix.eq(2).all()
    result, _ = fit_mixture(lambda: LinearScorer(2, 2), data.features(), rankings, EMConfig(k=2, max_iter=5))
    assert np.isfinite(result.best.log_likelihood)


def test_a_checkpoint_dir_refuses_to_resume_another_run(tmp_path):
    _, rankings, x = synthetic(k=2, m=4, n=100)
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2), checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="another run .*config"):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2, gamma_min=0.2), checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="rankings_sha256"):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings.subset(range(50)), EMConfig(k=2, max_iter=2), checkpoint_dir=tmp_path)
    warm = torch.full((100, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="warm_start_sha256"):  # the saved start would silently win
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2), checkpoint_dir=tmp_path,
                    warm_start=warm)
    with pytest.raises(ValueError, match="another run .*config"):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2, mixing="uniform"),
                    checkpoint_dir=tmp_path)


def test_a_checkpoint_dir_resumes_a_run_recorded_before_mixing_and_one_whose_gamma_min_changes_nothing(tmp_path):
    # The train version stays the same across both, so its checkpoints must be resumed, not refused.
    _, rankings, x = synthetic(k=2, m=4, n=100)
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2), checkpoint_dir=tmp_path)
    run = tmp_path / "run.json"
    record = json.loads(run.read_text())
    assert "mixing" not in record["config"]  # as a run of before the setting recorded it
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2), checkpoint_dir=tmp_path)
    hard = tmp_path / "hard"
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2, hard=True, gamma_min=0.3),
                checkpoint_dir=hard)
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2, hard=True), checkpoint_dir=hard)


def test_a_restart_keeps_its_start_and_a_rerun_reads_it_back(tmp_path):
    calls = []

    class Counting(FeatureScorer):
        def response_features(self, inputs):
            calls.append(1)
            return inputs

    _, rankings, x = synthetic(k=3, m=4, n=200, seed=6)
    config = EMConfig(k=3, init="linearized", max_iter=2, tol=0, restarts=2, seed=4)
    first, _ = fit_mixture(lambda: Counting(3, 3), x, rankings, config, checkpoint_dir=tmp_path)
    assert len(calls) == 2  # one start per restart
    start = read_posteriors(tmp_path / "restart-00" / "start.parquet", rankings.example_ids)
    assert torch.equal(start, initial_responsibilities(config, FeatureScorer(3, 3), x, rankings, seed=4))
    # killed after the starts were written, before any iteration finished: the rerun reads them back
    for it_dir in tmp_path.glob("restart-*/iter-*"):
        shutil.rmtree(it_dir)
    again, _ = fit_mixture(lambda: Counting(3, 3), x, rankings, config, checkpoint_dir=tmp_path)
    assert len(calls) == 2
    assert torch.equal(again.best.gamma, first.best.gamma) and again.best.history == first.best.history


def test_each_iterations_state_keeps_its_own_history():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    states = []
    fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=3, tol=0), on_iteration=states.append)
    assert [len(s.history) for s in states] == [1, 2, 3] and [len(s.halvings) for s in states] == [1, 2, 3]


def test_em_on_identical_rankings_converges_although_its_likelihood_nears_zero():
    # The LL per ranking tends to 0 (every ranking certain), where a purely relative tolerance never stops.
    tiers = torch.arange(4).expand(30, 4).clone()  # [30, 4], one order
    result, _ = fit_mixture(lambda: ItemScorer(3, 4), torch.arange(4).expand(30, 4).clone(), Rankings(tiers),
                            EMConfig(k=3, init="dirichlet", max_iter=50))
    assert result.best.converged and len(result.best.history) < 50 and result.best.history[-1] > -0.01


def test_a_restart_that_converged_before_a_kill_is_not_iterated_further_on_resume(tmp_path):
    _, rankings, x = synthetic(k=2, m=6, n=300, seed=4)
    config = EMConfig(k=2, restarts=2, max_iter=40, tol=1e-4, init="dirichlet", seed=3)
    whole, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "whole")
    assert whole.restarts[0].converged and len(whole.restarts[0].history) < config.max_iter

    def killed(state: EMState) -> None:
        if state.restart == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "killed",
                    on_iteration=killed)
    resumed, _ = fit_mixture(lambda: LinearScorer(2, 2), x, rankings, config, checkpoint_dir=tmp_path / "killed")
    assert [r.history for r in resumed.restarts] == [r.history for r in whole.restarts]


class Recording(LinearScorer):
    """A linear scorer that keeps the weights of every M-step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights = []

    def fit(self, inputs, rankings, weights, iteration=0):
        self.weights.append(weights.clone())
        return super().fit(inputs, rankings, weights, iteration)


def test_hard_em_fits_its_first_m_step_on_the_starts_one_hot_assignment():
    _, rankings, x = synthetic(k=2, m=4, n=200)
    config = EMConfig(k=2, hard=True, max_iter=1, init="dirichlet", seed=7)
    scorers = []
    fit_mixture(lambda: scorers.append(Recording(2, 2)) or scorers[-1], x, rankings, config)
    start = initial_responsibilities(config, LinearScorer(2, 2), x, rankings, seed=7)
    one_hot = torch.nn.functional.one_hot(start.argmax(1), 2).to(torch.float64)
    assert torch.equal(scorers[0].weights[0], one_hot)


def test_each_restarts_linearized_start_draws_from_seeds_no_other_restart_uses(monkeypatch):
    # The start is an EM of its own (3 Dirichlet restarts, 1000 seeds apart): restart r's must use
    # none of the seeds restart r - 1's used, or two restarts would start from one partition.
    from moplex_core.em import fit

    _, rankings, x = synthetic(k=2, m=4, n=60)
    inner, real = [], fit.fit_mixture

    def recording(make_scorer, inputs, data, config, *args, **kwargs):
        inner.append({config.seed + 1000 * r for r in range(config.restarts)})
        return real(make_scorer, inputs, data, config, *args, **kwargs)

    monkeypatch.setattr(fit, "fit_mixture", recording)  # where the start looks it up
    real(lambda: FeatureScorer(2, 2), x, rankings, EMConfig(k=2, init="linearized", restarts=2, max_iter=1, seed=4))
    assert len(inner) == 2 and not inner[0] & inner[1]


def test_a_coarser_or_finer_partition_is_not_a_repeated_start():
    from moplex_core.em.start import _repeated_start

    old = soft_one_hot(np.array([0, 1, 2, 0, 1, 2]), 3)
    merged = soft_one_hot(np.array([0, 0, 1, 0, 0, 1]), 3)  # old's clusters 0 and 1 as one
    relabelled = soft_one_hot(np.array([2, 0, 1, 2, 0, 1]), 3)
    assert _repeated_start(merged, [old]) is None and _repeated_start(old, [merged]) is None
    assert _repeated_start(relabelled, [merged, old]) == 1


def test_posteriors_are_alpha_times_each_clusters_eq5_probability_normalised():
    """gamma_ic = alpha_c P_c(sigma_i) / sum_c' alpha_c' P_c'(sigma_i) and the mixture log-likelihood
    log sum_c alpha_c P_c, with P_c written out (eq. 5: the originals in order above the generated set)."""
    import math

    from moplex_core.em import mixture_posteriors
    from moplex_core.pl import encode_tiers

    generator = torch.Generator().manual_seed(3)
    orders = [[2, 0, 1], [0, 1, 2], [1, 2, 0], [2, 1, 0]]  # originals 0..2; 3 and 4 generated
    scores = 2 * torch.randn(len(orders), 3, 5, generator=generator, dtype=torch.float64)  # [n, k, M]
    alpha = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    tiers = torch.tensor([encode_tiers([[j] for j in order], 5) for order in orders])
    gamma, ll = mixture_posteriors(scores, Rankings(tiers), alpha)
    for i, order in enumerate(orders):
        weighted = []
        for c in range(3):
            r = scores[i, c].tolist()
            p = 1.0
            for t in range(3):
                p *= math.exp(r[order[t]]) / (sum(math.exp(r[j]) for j in order[t:]) + math.exp(r[3]) + math.exp(r[4]))
            weighted.append(alpha[c].item() * p)
        assert ll[i].item() == pytest.approx(math.log(sum(weighted)), rel=1e-12)
        assert gamma[i].tolist() == pytest.approx([w / sum(weighted) for w in weighted], rel=1e-10)

