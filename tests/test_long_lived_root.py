"""A root kept for months: versions deleted, half deleted or copied elsewhere by hand. Each test works
on its own copy of one real pipeline's root (tiny model, cache, one EM iteration, an evaluation)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moplex_core.artifacts import ArtifactCorruptError, ArtifactStore, read_manifest
from moplex_core.cli import main
from moplex_core.config import EvaluateConfig, TrainConfig
from moplex_core.evaluate import plan_evaluate, run_evaluate
from moplex_core.inspect import inspect_path
from moplex_core.train import plan_train
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
