"""What the EM engine takes from a caller (numpy, lists, tensors) and what it refuses, naming it,
before any iteration: settings, starts, rankings, scorers of another k; and the README's example."""

import numpy as np
import pytest
import torch

from moplex_core.data.synthetic import SyntheticConfig
from moplex_core.em import EMConfig, Rankings, fit_mixture, posteriors, soft_one_hot
from moplex_core.scorers.item import ItemScorer
from moplex_core.scorers.linear import LinearScorer

from em_fixtures import synthetic


def test_gamma_min_above_one_over_k_is_refused_for_soft_em():
    with pytest.raises(ValueError, match=r"gamma_min = 0.5 is above 1/k = 0.3333"):
        EMConfig(k=3, gamma_min=0.5)
    EMConfig(k=3, gamma_min=0.5, hard=True)  # one-hot responsibilities: every ranking keeps its cluster
    EMConfig(k=3, gamma_min=1 / 3)


@pytest.mark.parametrize(("settings", "message"), [
    ({"k": 0}, "EM needs k >= 1 clusters, got k=0"),
    ({"max_iter": 0}, "max_iter and restarts must be >= 1"),
    ({"restarts": 0}, "max_iter and restarts must be >= 1"),
    ({"gamma_min": 1.0, "hard": True}, r"gamma_min must be in \[0, 1\), got 1.0"),
    ({"gamma_min": -0.1}, r"gamma_min must be in \[0, 1\), got -0.1"),
])
def test_em_settings_that_cannot_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EMConfig(**{"k": 2, **settings})


@pytest.mark.parametrize("bad, message", [
    (torch.full((40, 2), float("nan"), dtype=torch.float64), r"row\(s\) \[0, 1, .*\(40 of 40\)"),
    (torch.tensor([[0.5, 0.5]] * 39 + [[2.0, -1.0]], dtype=torch.float64), r"row\(s\) \[39\] \(1 of 40\).*\[2.0, -1.0\]"),
    (torch.tensor([[5.0, 5.0]] * 40, dtype=torch.float64), r"summing to 1"),
    (torch.full((40, 3), 1 / 3, dtype=torch.float64), r"must be \[n, k\] = \[40, 2\].*got \[40, 3\]"),
])
def test_a_warm_start_that_is_not_a_distribution_per_ranking_is_refused_naming_its_rows(bad, message):
    _, rankings, x = synthetic(k=2, m=4, n=40)
    with pytest.raises(ValueError, match=message):
        fit_mixture(lambda: LinearScorer(2, 2), x, rankings, EMConfig(k=2, max_iter=2), warm_start=bad)


def test_a_synthetic_config_no_draw_could_honour_is_refused_naming_each_setting():
    with pytest.raises(ValueError, match=r"SyntheticConfig: m = 1 \(at least 2\), n_values = 0 \(at least 1\), "
                                         r"noise = -1 \(at least 0\)"):
        SyntheticConfig(m=1, n_values=0, noise=-1)
    assert SyntheticConfig(noise=0).noise == 0  # deterministic rankings are a real setting


def test_rankings_take_numpy_and_lists_and_one_prefix_for_all_and_refuse_tiers_that_are_not_integer_codes():
    """A notebook's rankings: numpy or lists become int64 tensors (before, numpy tiers failed deep in
    torch.where, and an int prefix in `observed_tiers`); a fractional tier, a 1-D row or a code below
    PAD is refused, naming what is wrong."""
    tiers = np.array([[0, 1, 2], [2, 0, 1], [1, 2, -1]], dtype=np.int32)
    as_tensor = Rankings(torch.as_tensor(tiers, dtype=torch.int64), torch.tensor([2, 2, 2]))
    for given in (Rankings(tiers, 2), Rankings(tiers.tolist(), np.full(3, 2)), Rankings(tiers.astype(float), [2, 2, 2])):
        assert given.tiers.dtype == given.ranked_prefix.dtype == torch.int64
        assert torch.equal(given.tiers, as_tensor.tiers) and torch.equal(given.ranked_prefix, as_tensor.ranked_prefix)
        scores = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        assert torch.equal(given.log_likelihood(scores), as_tensor.log_likelihood(scores))
        assert torch.equal(given.observed_tiers, as_tensor.observed_tiers)
    assert Rankings(tiers, example_ids=["a", "b", "c"]).example_ids == ("a", "b", "c")
    with pytest.raises(TypeError, match="tiers must be integers"):
        Rankings(np.array([[0, 0.5, 1]]))
    with pytest.raises(ValueError, match=r"tiers must be \[n, M\].*got shape \(3,\)"):
        Rankings(np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"codes below PAD = -1 \(rankings \[1\]\)"):
        Rankings(np.array([[0, 1], [-2, 0]]))
    with pytest.raises(ValueError, match=r"ranked_prefix must be one int or \[n\] = \[3\], got shape \(2,\)"):
        Rankings(tiers, [2, 2])
    with pytest.raises(ValueError, match="2 example_ids for 3 rankings"):
        Rankings(tiers, example_ids=("a", "b"))


def test_a_scorer_with_another_k_than_the_config_and_posteriors_of_mismatched_shapes_are_refused_by_name():
    """Before, torch's own broadcast error (\"size of tensor a (2) must match ... (3)\") named neither."""
    data, rankings, x = synthetic(k=2, m=4, n=40)
    with pytest.raises(ValueError, match=r"made a scorer of k = 3 clusters for EMConfig\(k=2\)"):
        fit_mixture(lambda: LinearScorer(3, x.shape[-1]), x, rankings, EMConfig(k=2))
    result, scorer = fit_mixture(lambda: LinearScorer(2, x.shape[-1]), x, rankings, EMConfig(k=2, max_iter=3))
    gamma, ll = posteriors(scorer, x, rankings, result.best.alpha)
    for alpha in (result.best.alpha.numpy(), result.best.alpha.tolist()):  # a notebook's alpha
        assert torch.equal(posteriors(scorer, x, rankings, alpha)[0], gamma)
    with pytest.raises(ValueError, match=r"scores must be \[n, k, M\] = \[40, k, 4\].*got scores \(40, 2, 4\) and "
                                         r"alpha \(3,\)"):
        posteriors(scorer, x, rankings, [0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match=r"= \[10, k, 4\] for 10 rankings of 4 slots.*got scores \(40, 2, 4\)"):
        posteriors(scorer, x, rankings.subset(np.arange(10)), result.best.alpha)


def test_the_readmes_python_example_runs_as_written_and_finds_the_two_groups(capsys):
    """README "From Python": every line of its example, exactly as the README shows it."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("### From Python: a mixture of your own rankings"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(example, "README.md example", "exec"), {})
    alpha, *_, ari_line = capsys.readouterr().out.strip().splitlines()
    assert ari_line.split()[0] == "1.0"  # "ARI 1.0 here", as the README says


def test_a_warm_start_from_numpy_is_taken_as_the_same_tensor_would_be():
    data, rankings, x = synthetic(k=2, m=4, n=60)
    start = soft_one_hot(data.labels, 2)
    config = EMConfig(k=2, init="labels", max_iter=3)
    from_tensor, _ = fit_mixture(lambda: LinearScorer(2, x.shape[-1]), x, rankings, config, warm_start=start)
    from_numpy, _ = fit_mixture(lambda: LinearScorer(2, x.shape[-1]), x, rankings, config, warm_start=start.numpy())
    assert torch.equal(from_numpy.best.gamma, from_tensor.best.gamma)  # 'numpy.ndarray' has no attribute 'to' before


def test_the_scorers_take_numpy_and_lists_as_the_tensors_would_be_and_refuse_ids_that_are_no_items():
    """A notebook's inputs: numpy item ids (int32 too) and float32 features fit as the float64/int64
    tensors do (before, 'numpy.ndarray' has no attribute 'clamp_min' and a float32/float64 einsum
    error); an item id with a fraction or outside the pool is refused, naming the rankings."""
    data, rankings, x = synthetic(k=2, m=4, n=60)
    config = EMConfig(k=2, max_iter=3)
    features = x.to(torch.float32).to(torch.float64)  # exactly what float32 numpy features become
    from_tensor, _ = fit_mixture(lambda: LinearScorer(2, x.shape[-1]), features, rankings, config)
    from_numpy, _ = fit_mixture(lambda: LinearScorer(2, x.shape[-1]), features.numpy().astype(np.float32), rankings,
                                config)
    assert torch.equal(from_numpy.best.gamma, from_tensor.best.gamma)
    items = torch.arange(4).repeat(60, 1)  # [n, M]: slot j holds item j
    from_tensor, _ = fit_mixture(lambda: ItemScorer(2, 4), items, rankings, config)
    for given in (items.numpy().astype(np.int32), items.tolist()):
        from_numpy, scorer = fit_mixture(lambda: ItemScorer(2, 4), given, rankings, config)
        assert torch.equal(from_numpy.best.gamma, from_tensor.best.gamma)
    assert torch.equal(scorer.score(items.numpy()), scorer.score(items))
    with pytest.raises(TypeError, match=r"ItemScorer's inputs \(item ids\) must be integers"):
        scorer.score(items.numpy() + 0.5)
    bad = items.clone()
    bad[7, 2] = 4
    with pytest.raises(ValueError, match=r"item ids must be in 0\.\.3 \(-1 at padding\); rankings \[7\] hold \[4\]"):
        scorer.score(bad)
