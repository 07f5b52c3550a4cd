"""`moplex experiment approximation` (paper Table 1): single-anchor errors of both estimation modes,
binned by embedding distance, on a real (tiny) cache."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from moplex_core.artifacts import ArtifactStore
from moplex_core.cache import load_policy_inputs, run_cache
from moplex_core.cli import main
from moplex_core.config import CacheConfig, IngestConfig, SplitConfig, TinyModelConfig, TrainConfig
from moplex_core.estimate import ESTIMATION_MODES
from moplex_core.experiments.approximation import (
    MODES,
    approximation_markdown,
    relative_errors,
    sample_examples,
    summarise,
)
from moplex_core.ingest import run_ingest
from moplex_core.tiny_model import run_tiny_model
from moplex_core.train import run_train


def test_examples_are_drawn_at_random_once_per_distinct_set_of_responses(caches):
    cache, _ = caches
    inputs, _ = load_policy_inputs(cache, "train")
    doubled = inputs.subset(list(range(len(inputs))) * 2)  # every row twice, as UltraFeedback's criteria share
    draws = [sample_examples(doubled, len(inputs), seed) for seed in (0, 1)]
    assert draws[0] == list(range(len(inputs)))  # all distinct ones, each once, the first of its copies
    assert sample_examples(doubled, 4, 0) != sample_examples(doubled, 4, 1)
    assert sample_examples(doubled, 4, 0) == sample_examples(doubled, 4, 0)


def test_summarise_takes_each_seeds_bin_mean_then_mean_and_std_over_seeds():
    rows = [  # seed, mode, distance, (eps/r)^2
        (0, "delta", 0.01, 0.1), (0, "delta", 0.04, 0.3), (1, "delta", 0.02, 0.6),  # bin 0: seeds 0.2, 0.6
        (0, "delta", 0.07, 1.0),  # bin 1, one seed
        (0, "delta", 0.90, 5.0), (1, "delta", 0.51, 7.0),  # beyond max_distance 0.5: the last bin (10)
        (1, "delta", 0.03, np.nan),  # r = 0: no relative error, left out
        (0, "logpi", 0.01, 2.0),
    ]
    errors = pd.DataFrame([(seed, "e", 0, 1, mode, d, err, 1.0 if mode == "delta" else 3.0, 2.0 + 2 * seed)
                           for seed, mode, d, err in rows],  # |eps| 1 (delta) or 3; slate spread 2 (seed 0) or 4
                          columns=["seed", "example_id", "cluster", "response_idx", "mode", "distance",
                                   "relative_squared_error", "abs_error", "slate_spread"])
    table = summarise(errors).set_index(["mode", "bin"])
    assert table.loc[("delta", 0), "mean"] == pytest.approx(40.0)  # (0.2 + 0.6) / 2, in percent
    assert table.loc[("delta", 0), "std"] == pytest.approx(100 * np.std([0.2, 0.6], ddof=1))
    assert table.loc[("delta", 0), "pairs"] == 3
    assert table.loc[("delta", 1), ["mean", "seeds", "pairs"]].tolist() == pytest.approx([100.0, 1, 1])
    assert np.isnan(table.loc[("delta", 1), "std"])  # one seed has no spread, not a spread of 0
    assert table.loc[("delta", 10), "mean"] == pytest.approx(600.0) and table.loc[("delta", 10), "distance"] == ">= 50%"
    assert table.loc[("logpi", 0), "distance"] == "0%-5%"
    relative = relative_errors(errors)  # mean |eps| over the mean spread of the (seed, example, cluster) slates
    assert relative == pytest.approx({"delta": 1.0 / 3.0, "logpi": 3.0 / 2.0})
    lines = approximation_markdown(summarise(errors), relative).splitlines()
    assert lines[0] == "| distance | delta (eps/r)^2 | logpi (eps/r)^2 | pairs |"
    assert lines[2] == "| 0%-5% | 40.0 ± 28.3% | 200.0% (one seed) | 1 |"
    assert lines[3] == "| 5%-10% | 100.0% (one seed) | - | 1 |"
    assert lines[-1].endswith("error does): delta 0.33, logpi 1.50")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """(a cache with the reference contractions, one without) of 36 synthetic rankings, m = 3."""
    store = ArtifactStore(tmp_path_factory.mktemp("artifacts"))
    rankings = run_ingest(IngestConfig(dataset="synthetic", synthetic={"n": 36, "k": 3, "m": 3},
                                       split=SplitConfig(fractions=(0.5, 0.25, 0.25))), store).path
    model = str(run_tiny_model(TinyModelConfig(pretrain_steps=5, hidden_size=32), rankings, store))
    return tuple(run_cache(CacheConfig(model=model, contractions=contractions), rankings, store, progress=False).path
                 for contractions in (True, False))


def test_the_command_measures_both_modes_for_every_non_anchor_response(caches, tmp_path, capsys):
    cache, _ = caches
    out = cache.parents[1] / "experiments" / "approximation"  # without --out: in the cache's own root
    argv = ["experiment", "approximation", "--cache", str(cache), "--k", "2", "--seeds", "2", "--examples", "4",
            "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"errors: {out / 'errors.parquet'}" in printed
    assert printed.startswith("| distance | delta (eps/r)^2 | logpi (eps/r)^2 | delta (input term only) (eps/r)^2 | "
                              "logpi (input term only) (eps/r)^2 | pairs |")
    errors = pd.read_parquet(out / "errors.parquet")
    # 2 seeds x 4 examples x 2 adapters x (m - 1 = 2 responses besides the anchor) x 4 modes
    assert len(errors) == 2 * 4 * 2 * 2 * len(MODES) and set(errors["mode"]) == set(MODES)
    assert set(MODES) > set(ESTIMATION_MODES)
    inputs, _ = load_policy_inputs(cache, "train")
    for seed in (0, 1):  # each seed's own random draw of 4 examples
        picked = {inputs.example_ids[i] for i in sample_examples(inputs, 4, seed)}
        assert set(errors.example_id[errors.seed == seed]) == picked
    anchors = errors.groupby(["seed", "example_id"]).response_idx.unique()
    assert all(len(others) == 2 for others in anchors)  # one anchor per example and seed, the same for every adapter
    assert (errors.distance > 0).all() and np.isfinite(errors.relative_squared_error).all()
    assert np.isfinite(errors.abs_error).all() and (errors.slate_spread > 0).all()
    assert (out / "table.md").read_text().strip() == approximation_markdown(pd.read_parquet(out / "table.parquet"),
                                                                             relative_errors(errors))
    assert "Relative error, mean |r_hat - r| over the mean spread" in printed
    assert main(argv) == 0 and pd.read_parquet(out / "errors.parquet").equals(errors)  # seeded: the same again


def test_what_is_not_a_usable_cache_is_refused_by_name(caches, tmp_path, capsys):
    cache, forward_only = caches
    root = cache.parent.parent

    def refused(target: str, *extra: str) -> str:
        assert main(["experiment", "approximation", "--cache", target, "--out", str(tmp_path / "x"), "--seeds", "1",
                     "--examples", "2", "--quiet", *extra]) == 1
        assert not (tmp_path / "x").exists()
        return capsys.readouterr().err

    assert "this cache has none (cache.contractions = false)" in refused(str(forward_only))
    ingest = next(p for p in (root / "ingest").iterdir() if p.is_dir() and not p.name.startswith("."))  # no lock
    assert "was written by the 'ingest' stage; give cache/<version>" in refused(str(ingest))
    assert "no artifact cache/ffffffff" in refused("cache/ffffffff", "--root", str(root))
    assert "Traceback" not in refused(str(tmp_path / "nowhere"))
    unmatched = refused(str(cache), "--lora-targets", "c_attn")  # GPT-2's names on a Qwen3
    assert "['c_attn'] match no linear layer of Qwen3ForCausalLM" in unmatched
    assert "(moplex experiment approximation: --lora-targets down_proj,gate_proj,k_proj," in unmatched
    older = tmp_path / "older" / "cache" / cache.name  # a cache built before s_ref had its target terms
    shutil.copytree(cache, older)
    manifest = json.loads((older / "manifest.json").read_text())
    (older / "manifest.json").write_text(json.dumps({**manifest, "code_version": "cache-5"}))
    assert "was built by cache-5, whose reference contractions s_ref leave out the target terms" in refused(str(older))
    with pytest.raises(ValueError, match="rerun the cache stage"):
        run_train(TrainConfig(k=2, anchors=1), older, ArtifactStore(tmp_path / "trained"), progress=False)
    assert not (tmp_path / "trained" / "train").exists()


def test_a_cache_is_found_by_a_version_prefix_under_the_root(caches, tmp_path):
    cache, _ = caches
    argv = ["experiment", "approximation", "--cache", f"cache/{cache.name[:6]}", "--root", str(cache.parent.parent),
            "--out", str(tmp_path / "out"), "--k", "2", "--seeds", "1", "--examples", "2", "--quiet"]
    assert main(argv) == 0 and (tmp_path / "out" / "errors.parquet").is_file()
    errors = pd.read_parquet(tmp_path / "out" / "errors.parquet")
    assert main([*argv, "--lora-targets", "q_proj,v_proj"]) == 0  # other adapters: other errors
    assert not pd.read_parquet(tmp_path / "out" / "errors.parquet").equals(errors)
