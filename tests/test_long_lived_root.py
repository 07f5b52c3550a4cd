"""A root kept for months: versions deleted, half deleted or copied elsewhere by hand, and the listing a
user reads to decide what to keep. Each test works on its own copy of one real pipeline's root (tiny
model, cache, one EM iteration, an evaluation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moplex_core.artifacts import CHECKPOINTS, MANIFEST, ArtifactCorruptError, ArtifactStore, read_manifest
from moplex_core.cli import main
from moplex_core.config import EvaluateConfig, TrainConfig
from moplex_core.evaluate import plan_evaluate, run_evaluate
from moplex_core.inspect import inspect_path
from moplex_core.train import load_trained, plan_train
from stage_fixtures import tiny_trained_mixture


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The root of one pipeline: ingest, model, cache, train and evaluate versions."""
    store = ArtifactStore(tmp_path_factory.mktemp("built"))
    _, cache, train = tiny_trained_mixture(store)
    run_evaluate(EvaluateConfig(), train, cache, store)
    return store.root


@pytest.fixture
def root(built, tmp_path) -> Path:
    """A copy of the built root to break (the model folder the cache recorded stays in the original)."""
    return Path(shutil.copytree(built, tmp_path / "root"))


def _version(root: Path, stage: str) -> Path:
    (version,) = ArtifactStore(root).list(stage)
    return version.path


def _train_config(train: Path) -> TrainConfig:
    recorded = read_manifest(train)["config"]
    return TrainConfig.model_validate({k: v for k, v in recorded.items() if k not in ("model", "resolved_dtype")})


@pytest.mark.parametrize("stage, name", [("ingest", "part-00000.parquet"), ("model", "model/model.safetensors"),
                                         ("cache", "part-00000.parquet"), ("train", "result.json"),
                                         ("train", "adapters/c1/adapter_model.safetensors"),
                                         ("evaluate", "metrics.parquet")])
def test_a_finished_version_with_a_file_deleted_is_refused_by_name_not_found_complete(root, stage, name):
    # Before: a stage found such a version "complete" and handed it on, and pyarrow or pathlib failed
    # later on the missing file (evaluate's metrics.parquet, train's result.json), or transformers on
    # a model folder that its own stage had written.
    store = ArtifactStore(root)
    version = _version(root, stage)
    (version / name).unlink()
    with pytest.raises(ArtifactCorruptError, match=rf"{version}: {name} missing .*Delete the version directory "
                                                   "and rerun its stage"):
        store.is_complete(stage, version.name)  # what every stage's plan asks
    if stage == "evaluate":
        with pytest.raises(ArtifactCorruptError, match="metrics.parquet missing"):
            plan_evaluate(EvaluateConfig(), _version(root, "train"), _version(root, "cache"), store)
    if stage == "train":
        with pytest.raises(ArtifactCorruptError, match=f"{name} missing"):
            plan_train(_train_config(version), _version(root, "cache"), store)
    assert f"{version.parent.name}/{version.name}" in (line := next(
        line for line in inspect_path(root).splitlines() if version.name in line.split()[0])) and "DAMAGED" in line


def test_a_train_version_read_by_evaluate_or_assign_is_checked_as_its_stage_checks_it(root):
    # load_trained, which evaluate and assign call on a train folder they are given: a deleted
    # start_posteriors.parquet once passed for an artifact from before train-5 (the report without EM's start).
    train = _version(root, "train")
    (train / "start_posteriors.parquet").unlink()
    with pytest.raises(ArtifactCorruptError, match=rf"{train}: start_posteriors.parquet missing"):
        load_trained(train, read_manifest(train)["config"]["model"])


def test_a_train_versions_checkpoints_can_be_deleted_to_free_space(root):
    train = _version(root, "train")
    before = {line.split()[0]: line for line in inspect_path(root).splitlines()[1:]}
    shutil.rmtree(train / CHECKPOINTS)
    store = ArtifactStore(root)
    assert plan_train(_train_config(train), _version(root, "cache"), store).complete
    _, alpha, _ = load_trained(train, read_manifest(train)["config"]["model"])  # what evaluate and assign read
    assert alpha.shape == (3,)
    ref = f"train/{train.name}"
    after = {line.split()[0]: line for line in inspect_path(root).splitlines()[1:]}
    assert after[ref].split()[1] == "complete" and after[ref] != before[ref]  # smaller on disk, not damaged
    assert "none reads them once the version is finished" in inspect_path(train)


def test_the_listing_says_each_versions_size_what_uses_it_and_which_inputs_are_gone(root):
    versions = {info.ref.stage: info for info in ArtifactStore(root).list()}
    short = {stage: f"{stage}/{info.ref.version[:4]}" for stage, info in versions.items()}
    listing = inspect_path(root).splitlines()
    assert listing[0].startswith(f"artifacts under {root} (5 version(s), ") and listing[0].endswith(" on disk):")
    lines = {line.split()[0]: line for line in listing[1:]}
    line = {stage: lines[str(info.ref)] for stage, info in versions.items()}
    manifest = versions["train"].manifest
    on_disk = sum(e["bytes"] for e in manifest["files"].values())  # the tiny mixture's: 1 to 999 kB
    assert line["train"].split()[2:4] == [f"{on_disk / 1e3:.1f}", "kB"]
    assert line["ingest"].endswith(f"used by {short['model']}, {short['cache']}")
    assert f"from {short['ingest']}  used by {short['cache']}, {short['train']}" in line["model"]
    assert line["cache"].endswith(f"from {short['ingest']}, {short['model']}  "
                                  f"used by {short['train']}, {short['evaluate']}")
    assert line["train"].endswith(f"from {short['cache']}, {short['model']}  used by {short['evaluate']}")
    assert line["evaluate"].endswith(f"from {short['cache']}, {short['train']}")

    shutil.rmtree(versions["cache"].path)  # deleted by hand; a half-deleted model: its manifest gone
    (versions["model"].path / MANIFEST).unlink()
    lines = {line.split()[0]: line for line in inspect_path(root).splitlines()[1:]}
    assert str(versions["cache"].ref) not in lines
    assert lines[str(versions["train"].ref)].endswith(
        f"from {short['cache']} (gone), {short['model']} (partial)  used by {short['evaluate']}")
    assert lines[str(versions["model"].ref)].split()[1] == "PARTIAL"  # listed, not left out: it takes space
    assert "neither manifest.json nor a run's start marker: a version deleted, copied in part or edited" in lines[
        str(versions["model"].ref)]
    assert inspect_path(root).splitlines()[0].startswith(f"artifacts under {root} (3 version(s) and 1 partial folder(s), ")
    assert inspect_path(versions["model"].path).startswith(  # asked for by name: what it is, not "no artifacts"
        f"{versions['model'].path}: PARTIAL, neither manifest.json nor a run's start marker: a version deleted")
    (versions["model"].path / MANIFEST).write_text("{}")  # one that says nothing of a stage: not moplex's
    partial = next(line for line in inspect_path(root).splitlines() if str(versions["model"].ref) in line)
    assert "PARTIAL" in partial and "a manifest.json without a stage, version and code version" in partial
    (versions["model"].path / MANIFEST).unlink()
    (root / "model" / "my-base-model").mkdir()  # the user's own, which no stage writes to: not theirs to delete
    (root / "model" / "my-base-model" / "config.json").write_text("{}")
    assert "my-base-model" not in inspect_path(root) and "my-base-model" not in inspect_path(root / "model")
    (versions["train"].path / MANIFEST).rename(versions["train"].path / ".started")  # as if a run were under way
    lines = {line.split()[0]: line for line in inspect_path(root).splitlines()[1:]}
    assert lines[str(versions["evaluate"].ref)].endswith(f"from {short['cache']} (gone), {short['train']} (unfinished)")


def test_an_unfinished_version_is_listed_with_when_it_started_and_the_settings_it_was_started_with(root):
    # What a killed `moplex run --set train.k=2` leaves: the start marker and no manifest.
    train = _version(root, "train")
    killed = train.with_name("0123456789ab")
    killed.mkdir()
    run = {"started": "2026-01-02T03:04:05+00:00", "code_version": read_manifest(train)["code_version"],
           "inputs": read_manifest(train)["inputs"], "config": {**read_manifest(train)["config"], "k": 2}}
    (killed / ".started").write_text(json.dumps(run) + "\n")
    lines = {line.split()[0]: line for line in inspect_path(root / "train").splitlines()[1:]}
    cache = f"cache/{_version(root, 'cache').name[:4]}"
    assert lines["train/0123456789ab"].split()[1:2] == ["INCOMPLETE"]
    assert "so far, started 2026-01-02T03:04:05+00:00  from " + cache in lines["train/0123456789ab"]
    assert lines["train/0123456789ab"].endswith("[k=2]") and lines[f"train/{train.name}"].endswith("[k=3]")
    users = ", ".join(sorted([f"train/{train.name[:4]}", "train/0123"]))  # a stage's versions by name
    assert f"used by {users}, evaluate/" in inspect_path(root / "cache")


def test_a_train_artifact_copied_without_its_cache_is_refused_by_assign_with_what_to_copy(root, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    for stage in ("train", "ingest"):  # the adapters and new rankings, not the cache they were trained on
        shutil.copytree(_version(root, stage), elsewhere / stage / _version(root, stage).name)
    train = elsewhere / "train" / _version(root, "train").name
    cache = read_manifest(train)["inputs"]["cache"]
    assert main(["assign", str(train), f"ingest/{_version(root, 'ingest').name[:6]}", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"train/{train.name} was trained on {cache}, whose manifest.json holds the settings" in err
    assert f"no artifact at {elsewhere / cache}. Put that version's folder back at {elsewhere / cache}" in err
    assert "Traceback" not in err
