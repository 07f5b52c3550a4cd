"""`moplex assign` on a real (tiny) trained mixture: new rankings routed to the trained clusters."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from moplex_core.artifacts import ArtifactStore, load_table, verify
from moplex_core.assign import ASSIGN_SCHEMA, plan_assign, run_assign
from moplex_core.cli import main
from moplex_core.config import CacheConfig, IngestConfig, SplitConfig, TinyModelConfig, TrainConfig
from moplex_core.cache import run_cache
from moplex_core.ingest import run_ingest
from moplex_core.tiny_model import run_tiny_model
from moplex_core.train import load_posteriors, run_train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(store, train folder, the rankings it was trained on, 6 other rankings): synthetic k = 3, m = 3, two
    exact EM iterations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        store = ArtifactStore(tmp_path_factory.mktemp("artifacts"))
        rankings = run_ingest(IngestConfig(dataset="synthetic", synthetic={"n": 36, "k": 3, "m": 3},
                                           split=SplitConfig(fractions=(0.5, 0.25, 0.25))), store).path
        model = run_tiny_model(TinyModelConfig(pretrain_steps=5, hidden_size=32), rankings, store)
        cache = run_cache(CacheConfig(model=str(model)), rankings, store, progress=False).path
        train = run_train(TrainConfig(k=3, lora_r=4, em_iterations=2, anchors=None, lora_targets=("q_proj", "v_proj")),
                          cache, store, progress=False).path
        other = run_ingest(IngestConfig(dataset="synthetic", seed=11, synthetic={"n": 6, "k": 3, "m": 3}), store).path
        yield store, train, rankings, other
    finally:
        torch.set_num_threads(threads)


def test_the_training_rankings_get_the_posteriors_em_ended_with(trained):
    # EM's last E-step scored exactly (anchors=None) with the final adapters and the alpha in result.json,
    # so assigning the rankings it trained on must give its final posteriors back.
    store, train, rankings, _ = trained
    result = run_assign(train, rankings, store, device="cpu", progress=False)
    assert result.built and result.rows == 36
    assert plan_assign(train, rankings, store, device="cpu").cache_dir.parent.name == "cache"
    assert store.list("cache") and len(store.list("cache")) == 1  # the training cache, reused
    table = load_table(result.path)
    assert table.schema.equals(ASSIGN_SCHEMA)
    rows = table.to_pydict()
    ids, _, final = load_posteriors(train)
    where = {example: i for i, example in enumerate(rows["example_id"])}
    posterior = torch.tensor([rows["posterior"][where[example]] for example in ids], dtype=torch.float64)
    torch.testing.assert_close(posterior, final, atol=1e-6, rtol=0)
    assert {rows["split"][where[example]] for example in ids} == {"train"}


def test_new_rankings_get_a_posterior_an_adapter_and_every_score(trained, capsys):
    store, train, _, _ = trained
    new = run_ingest(IngestConfig(dataset="synthetic", seed=7, synthetic={"n": 12, "k": 3, "m": 3}), store).path
    assert main(["assign", str(train), str(new), "--root", str(store.root), "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wrote 12 rankings" in out and "| cluster (adapter) | rankings | mean posterior |" in out
    assert "| true label |" in out
    plan = plan_assign(train, new, store, device="cpu")
    assert plan.complete
    verify(plan.path)
    rows = pq.read_table(plan.path / "part-00000.parquet").to_pydict()
    posterior = torch.tensor(rows["posterior"], dtype=torch.float64)  # [12, 3]
    torch.testing.assert_close(posterior.sum(1), torch.ones(12, dtype=torch.float64))
    assert rows["assigned"] == posterior.argmax(1).tolist()
    assert all(len(s) == 3 and all(len(per) == 3 for per in s) for s in rows["scores"])  # [k][m]
    assert all(ll < 0 for ll in rows["log_likelihood"])
    summary = store.manifest("assign", plan.ref.version)["summary"]
    assert sum(summary["assigned"].values()) == 12
    assert sum(sum(row.values()) for row in summary["labels_by_assigned"].values()) == 12
    assert main(["assign", str(train), str(new), "--root", str(store.root), "--device", "cpu", "--quiet"]) == 0
    assert "already complete" in capsys.readouterr().out


def test_only_a_train_artifact_can_be_assigned_to(trained, capsys):
    store, _, rankings, _ = trained
    assert main(["assign", str(rankings), str(rankings), "--root", str(store.root)]) == 1
    assert "holds an ingest artifact, not a train artifact" in capsys.readouterr().err


def test_assign_flow_on_the_local_prefect_server(prefect_env, trained):
    from flows.assign import assign_flow

    store, train, _, rankings = trained
    assert not plan_assign(train, rankings, store, device="cpu").complete
    folder = assign_flow(str(train), str(rankings), str(store.root), device="cpu")
    assert folder == str(plan_assign(train, rankings, store, device="cpu").path)
    assert load_table(folder).num_rows == 6
    finished = store.manifest("assign", Path(folder).name)["finished"]
    assert assign_flow(str(train), str(rankings), str(store.root), device="cpu") == folder
    assert store.manifest("assign", Path(folder).name)["finished"] == finished  # found, not redone
    verify(folder)
