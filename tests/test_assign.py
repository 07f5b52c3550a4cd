"""`moplex assign` on a real (tiny) trained mixture: new rankings routed to the trained clusters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from moplex_core.artifacts import (DEFAULT_ROOT, ArtifactCorruptError, ArtifactStore, default_root, load_table,
                                   shard_paths, verify)
from moplex_core.assign import ASSIGN_SCHEMA, plan_assign, run_assign
from moplex_core.cache import load_policy_inputs
from moplex_core.cli import main
from moplex_core.config import IngestConfig, TrainConfig
from moplex_core.em import mixture_posteriors
from moplex_core.ingest import run_ingest
from moplex_core.train import load_posteriors, run_train
from stage_fixtures import tiny_trained_mixture

# Not the defaults, so that a new cache built with any other settings is another version (and
# shards of 5 rows, so that rows are matched across shards).
CACHE_SETTINGS = {"use_chat_template": False, "max_response_tokens": 48, "shard_rows": 5}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(store, train folder, the rankings it was trained on, 6 other rankings with m = 4): two exact EM
    iterations on the tiny synthetic mixture."""
    store = ArtifactStore(tmp_path_factory.mktemp("artifacts"))
    rankings, _, train = tiny_trained_mixture(store, em_iterations=2, **CACHE_SETTINGS)
    other = run_ingest(IngestConfig(dataset="synthetic", seed=11, synthetic={"n": 6, "k": 3, "m": 4}), store).path
    return store, train, rankings, other


def test_the_training_rankings_get_the_posteriors_em_ended_with(trained):
    # EM's last E-step scored exactly (anchors=None) with the final adapters and the alpha in result.json,
    # so assigning the rankings it trained on must give its final posteriors back.
    store, train, rankings, _ = trained
    result = run_assign(train, rankings, store, device="cpu", progress=False)
    assert result.built and result.rows == 36
    caches = [info.manifest["config"]["contractions"] for info in store.list("cache")
              if Path(rankings).name in json.dumps(info.manifest["inputs"])]  # not the other tests' rankings
    assert sorted(caches) == [False, True]  # training's cache, and assign's: the same settings, forward passes only
    table = load_table(result.path)
    assert table.schema.equals(ASSIGN_SCHEMA)
    rows = table.to_pydict()
    ids, _, final = load_posteriors(train)
    where = {example: i for i, example in enumerate(rows["example_id"])}
    posterior = torch.tensor([rows["posterior"][where[example]] for example in ids], dtype=torch.float64)
    torch.testing.assert_close(posterior, final, atol=1e-6, rtol=0)
    assert {rows["split"][where[example]] for example in ids} == {"train"}


def test_two_mixtures_trained_on_one_cache_assign_to_two_versions(trained):
    # the assign version hashes the train artifact: another mixture must never reuse this one's posteriors
    store, train, _, other = trained
    cache = store.path("cache", json.loads((train / "manifest.json").read_text())["inputs"]["cache"].split("/")[1])
    another = run_train(TrainConfig(k=3, lora_r=4, em_iterations=1, anchors=None, seed=5,
                                    lora_targets=("q_proj", "v_proj")), cache, store, progress=False).path
    first, second = (plan_assign(t, other, store, device="cpu") for t in (train, another))
    assert first.cache.ref == second.cache.ref and first.ref != second.ref


def test_a_killed_assign_resumes_at_the_first_missing_shard(trained):
    store, train, rankings, _ = trained
    first = run_assign(train, rankings, store, device="cpu", progress=False)
    plan = plan_assign(train, rankings, store, device="cpu")
    shards = shard_paths(first.path)
    assert [p.name for p in shards] == [p.name for p in shard_paths(plan.cache.path)]  # 36 rankings, 5 per shard
    assert [load_table(first.path).slice(5 * s, 5).column("example_id") for s in range(8)] == [
        load_table(plan.cache.path).slice(5 * s, 5).column("example_id") for s in range(8)]
    whole, summary = load_table(first.path), store.manifest("assign", first.ref.version)["summary"]
    # What a kill while scoring shard 3 leaves: shards 0-2 written, no manifest.
    (first.path / "manifest.json").unlink()
    for path in shards[3:]:
        path.unlink()
    kept = {path.name: path.stat().st_mtime_ns for path in shards[:3]}
    again = run_assign(train, rankings, store, device="cpu", progress=False)
    assert again.built and again.path == first.path and again.rows == 36
    assert {path.name: path.stat().st_mtime_ns for path in shards[:3]} == kept  # not scored again
    assert load_table(again.path).equals(whole)
    assert store.manifest("assign", again.ref.version)["summary"] == summary
    verify(again.path)


def test_assign_refuses_damaged_artifacts_naming_the_file(trained, tmp_path):
    # A shard missing from the new rankings' cache, from a finished assign version, or a truncated adapter:
    # each is named, and nothing is scored from the rest or called "already complete".
    store, train, rankings, _ = trained
    first = run_assign(train, rankings, store, device="cpu", progress=False)
    cache = plan_assign(train, rankings, store, device="cpu").cache.path
    for damaged in (first.path / "part-00002.parquet", cache / "part-00001.parquet",
                    train / "adapters" / "c1" / "adapter_model.safetensors"):
        original = damaged.read_bytes()
        try:
            damaged.write_bytes(original[:1000])
            with pytest.raises(ArtifactCorruptError, match=f"{damaged.name} missing or not the size"):
                run_assign(train, rankings, store, device="cpu", progress=False)
        finally:
            damaged.write_bytes(original)
        if damaged.parent == first.path:  # then: no assign version, so the cache and train are read
            first.path.rename(tmp_path / "assign")
    shard = cache / "part-00001.parquet"
    original = shard.read_bytes()
    try:  # one byte changed in place (a damaged disk): the size is right, the sha256 is not
        shard.write_bytes(original[:500] + bytes([original[500] ^ 0xFF]) + original[501:])
        with pytest.raises(ArtifactCorruptError, match="part-00001.parquet missing or not the size or sha256"):
            run_assign(train, rankings, store, device="cpu", progress=False)
    finally:
        shard.write_bytes(original)
    shutil.rmtree(first.path, ignore_errors=True)  # what the refused runs began
    (tmp_path / "assign").rename(first.path)
    verify(first.path)


def test_new_rankings_get_a_posterior_an_adapter_and_every_score(trained, capsys, monkeypatch, tmp_path):
    store, train, _, new = trained
    assert main(["assign", str(train), str(new), "--root", str(store.root), "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wrote 6 rankings" in out and "| cluster (adapter) | rankings | mean posterior |" in out
    assert "| true label | adapter c0 | adapter c1 | adapter c2 |" in out
    plan = plan_assign(train, new, store, device="cpu")
    assert plan.complete
    verify(plan.path)
    manifest = store.manifest("assign", plan.ref.version)
    assert manifest["config"]["resolved_dtype"] == "float32" and manifest["config"]["rankings"] == str(new)
    assert {k: v for k, v in store.manifest("cache", plan.cache.ref.version)["config"].items()
            if k in CACHE_SETTINGS} == CACHE_SETTINGS  # cached as training's cache was
    assert store.manifest("cache", plan.cache.ref.version)["config"]["contractions"] is False  # exact scores only
    rows = load_table(plan.path).to_pydict()
    source = load_table(new).to_pydict()
    assert sorted(rows["example_id"]) == sorted(source["example_id"])
    label = dict(zip(source["example_id"], source["cluster"], strict=True))
    assert rows["cluster"] == [label[example] for example in rows["example_id"]]

    scores = torch.tensor(rows["scores"], dtype=torch.float64)
    assert scores.shape == (6, 3, 4)  # [n, k, m]
    inputs, _ = load_policy_inputs(plan.cache.path, split=None)
    assert list(inputs.example_ids) == rows["example_id"]
    alpha = torch.tensor(json.loads((train / "result.json").read_text())["alpha"], dtype=torch.float64)
    posterior, log_likelihood = mixture_posteriors(scores, inputs.rankings(), alpha)
    torch.testing.assert_close(torch.tensor(rows["posterior"], dtype=torch.float64), posterior)
    torch.testing.assert_close(torch.tensor(rows["log_likelihood"], dtype=torch.float64), log_likelihood)
    assert rows["assigned"] == posterior.argmax(1).tolist()
    summary = manifest["summary"]
    assert sum(summary["assigned"].values()) == 6
    assert sum(sum(row.values()) for row in summary["labels_by_assigned"].values()) == 6
    counts = np.array([list(row.values()) for row in summary["labels_by_assigned"].values()])  # [labels, k]
    rows_, cols = linear_sum_assignment(-counts)
    assert summary["agreement_with_labels"]["accuracy_best_matching"] == round(counts[rows_, cols].sum() / 6, 4)
    assert "agreement with the labels:" in out
    monkeypatch.chdir(tmp_path)  # without --root: the train folder's own root, not ./data/artifacts
    assert main(["assign", str(train), str(new), "--device", "cpu", "--quiet"]) == 0
    assert "already complete" in capsys.readouterr().out and not (tmp_path / "data").exists()
    prefix = f"{train.parent}/{train.name[:4]}"  # ROOT/train/<version prefix>: the same root
    assert main(["assign", prefix, str(new), "--device", "cpu", "--quiet"]) == 0
    assert "already complete" in capsys.readouterr().out and not (tmp_path / "data").exists()
    monkeypatch.chdir(train)  # typed relative to where the user is
    assert default_root(".") == default_root(f"../{train.name}/") == str(store.root.resolve())
    assert default_root("train/abc") == DEFAULT_ROOT  # a ref, not a folder: resolved under --root's default


def test_assign_refuses_what_it_cannot_use_before_writing_anything(trained, capsys, tmp_path, fixtures_dir):
    store, train, rankings, _ = trained
    root = ["--root", str(tmp_path / "elsewhere")]
    cache = store.list("cache")[0].path
    for args, message in [
        ([str(rankings), str(rankings)], "was written by the 'ingest' stage; give train/<version>"),
        ([str(train), str(cache)], "was written by the 'cache' stage; give ingest/<version> or augment/<version>"),
        ([str(train), str(rankings), "--device", "gpu"], "device 'gpu' is not a torch device"),
        (["train//x", str(rankings)], "an artifact reference is 'stage/version'"),
        ([str(train), str(fixtures_dir / "generic.jsonl")], "is a file; assign takes a rankings artifact. Ingest the "
                                                         "file first: `moplex ingest --dataset generic --path"),
    ]:
        assert main(["assign", *args, *root]) == 1
        assert message in capsys.readouterr().err
    model = Path(store.manifest("cache", cache.name)["config"]["model"])
    original = (model / "generation_config.json").read_bytes()
    try:  # the base model's files changed since training: the adapters would meet another model
        (model / "generation_config.json").write_bytes(original + b"\n")
        assert main(["assign", str(train), str(rankings), *root]) == 1
        assert "is not the one" in capsys.readouterr().err
    finally:
        (model / "generation_config.json").write_bytes(original)
    assert not (tmp_path / "elsewhere").exists()


def test_assign_takes_a_moved_model_with_the_same_files(trained, tmp_path, capsys):
    store, train, _, new = trained
    cache = next(info.path for info in store.list("cache") if info.manifest["config"]["contractions"])
    model = Path(store.manifest("cache", cache.name)["config"]["model"])
    moved = tmp_path / "moved-model"
    root = ["--root", str(tmp_path / "artifacts"), "--quiet"]
    model.rename(moved)
    try:
        assert main(["assign", str(train), str(new), *root]) == 1
        assert f"the folder {model}, is not there now" in capsys.readouterr().err
        assert main(["assign", str(train), str(new), "--model", str(tmp_path / "nowhere"), *root]) == 1
        assert f"the base model given, {tmp_path / 'nowhere'}, is not a folder" in capsys.readouterr().err
        assert main(["assign", str(train), str(new), "--model", str(moved), *root]) == 0
    finally:
        moved.rename(model)
    assigned = ArtifactStore(tmp_path / "artifacts").list("assign")[0]
    assert assigned.manifest["config"]["model"] == str(moved)
    assert load_table(assigned.path).num_rows == 6


def test_assign_flow_on_the_local_prefect_server(prefect_env, trained, tmp_path):
    from flows.assign import assign_flow

    store, train, _, new = trained
    root = tmp_path / "artifacts"  # another root than the train artifact's
    assert not plan_assign(train, new, ArtifactStore(root), device="cpu").complete
    folder = assign_flow(str(train), str(new), str(root), device="cpu", score_batch_size=5)
    assert folder == str(plan_assign(train, new, ArtifactStore(root), device="cpu").path)
    assert ArtifactStore(root).manifest("assign", Path(folder).name)["config"]["score_batch_size"] == 5
    assert load_table(folder).num_rows == 6
    finished = ArtifactStore(root).manifest("assign", Path(folder).name)["finished"]
    assert assign_flow(str(train), str(new), str(root), device="cpu") == folder
    assert ArtifactStore(root).manifest("assign", Path(folder).name)["finished"] == finished  # found, not redone
    verify(folder)
    # without a root: the train artifact's own (found there if the CLI's test wrote it first)
    assert assign_flow(str(train), str(new), device="cpu") == str(plan_assign(train, new, store, device="cpu").path)


def test_rankings_that_order_nothing_are_warned_about(trained, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moplex_core.assign import _assigned_rows
    from moplex_core.train import load_trained

    store, train, _, new = trained
    run_assign(train, new, store, device="cpu", progress=False)
    plan = plan_assign(train, new, store, device="cpu")
    part = pq.read_table(shard_paths(plan.cache.path)[0])
    m = len(part.column("ranking")[0].as_py())
    rankings = [[list(range(m))], *part.column("ranking").to_pylist()[1:]]  # the first: all in one tier
    part = part.set_column(part.schema.get_field_index("ranking"), "ranking",
                           pa.array(rankings, type=part.schema.field("ranking").type))
    scorer, alpha, trained_result = load_trained(train, None, device="cpu")
    with caplog.at_level("WARNING", logger="moplex_core.assign"):
        _assigned_rows(part, scorer, alpha, trained_result.likelihood)
    first = part.column("example_id")[0].as_py()
    assert f"1 of {part.num_rows} rankings (the first: example_id {first!r}) put every response in one tier" in caplog.text


def test_a_mixture_trained_on_a_cache_of_older_code_says_its_rankings_are_cached_by_this_code(trained, tmp_path,
                                                                                              caplog):
    # a train artifact kept over an upgrade of moplex: its cache's code version (here made cache-5, as
    # moplex before 2026-11-25 wrote it) is not the code that caches the rankings to assign
    store, train, _, other = trained
    root = tmp_path / "root"
    shutil.copytree(store.root, root)
    cache = root / json.loads((train / "manifest.json").read_text())["inputs"]["cache"]
    manifest = json.loads((cache / "manifest.json").read_text())
    ours = manifest["code_version"]
    copy = ArtifactStore(root)
    with caplog.at_level("WARNING", logger="moplex_core.assign"):
        run_assign(root / "train" / train.name, root / "ingest" / other.name, copy, device="cpu", progress=False)
    assert "caches the rankings to assign" not in caplog.text  # trained on this code's cache: nothing to say
    shutil.rmtree(root / "assign")
    (cache / "manifest.json").write_text(json.dumps({**manifest, "code_version": "cache-5"}))
    with caplog.at_level("WARNING", logger="moplex_core.assign"):
        run_assign(root / "train" / train.name, root / "ingest" / other.name, copy, device="cpu", progress=False)
    assert (f"train/{train.name} trained on {cache.parent.name}/{cache.name}, which cache-5 wrote; this moplex caches "
            f"the rankings to assign with {ours}") in caplog.text
