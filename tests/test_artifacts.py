"""The versioned artifact store: versions, atomic writes, manifests, resume, locking, loading."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moplex_core.artifacts import (
    MANIFEST,
    ArtifactCorruptError,
    ArtifactError,
    ArtifactIncompleteError,
    ArtifactNotFoundError,
    ArtifactRef,
    ArtifactStore,
    artifact_version,
    load_table,
    read_manifest,
    verify,
)
from moplex_core.artifacts.layout import STAGE_ORDER, readable_manifest
from moplex_core.hashing import sha256_file
from moplex_core.inspect import inspect_path

REPO = Path(__file__).resolve().parents[1]


def table(i: int, n: int = 10) -> pa.Table:
    rows = range(n * i, n * i + n)
    return pa.table({"row": pa.array(rows, pa.int64()), "text": [f"row {k}" for k in rows]})


def write_demo(store: ArtifactStore, version: str = "v1", shards: int = 3, stage: str = "demo") -> Path:
    with store.writer(stage, version, config={"shards": shards}, inputs={"rankings": "ingest/abc"},
                      code_version="demo-1") as w:
        for i in range(shards):
            w.write_shard(i, table(i))
    return w.path


def test_version_is_a_hash_of_stage_config_inputs_and_code():
    base = artifact_version("ingest", {"a": 1, "b": [1, 2]}, {"x": "s/v"}, "c1")
    assert base == artifact_version("ingest", {"b": [1, 2], "a": 1}, {"x": "s/v"}, "c1")  # key order
    assert base == artifact_version("ingest", {"a": 1, "b": [1, 2]}, {"x": ArtifactRef("s", "v")}, "c1")
    changed = [
        artifact_version("augment", {"a": 1, "b": [1, 2]}, {"x": "s/v"}, "c1"),
        artifact_version("ingest", {"a": 2, "b": [1, 2]}, {"x": "s/v"}, "c1"),
        artifact_version("ingest", {"a": 1, "b": [1, 2]}, {"x": "s/w"}, "c1"),
        artifact_version("ingest", {"a": 1, "b": [1, 2]}, {"x": "s/v"}, "c2"),
    ]
    assert base not in changed and len(set(changed)) == 4
    assert len(base) == 12 and int(base, 16) >= 0


def test_written_artifact_has_manifest_with_hashes_and_loads_back(tmp_path):
    store = ArtifactStore(tmp_path)
    path = write_demo(store)
    assert store.is_complete("demo", "v1")
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["stage"] == "demo" and manifest["version"] == "v1"
    assert manifest["config"] == {"shards": 3} and manifest["inputs"] == {"rankings": "ingest/abc"}
    assert manifest["code_version"] == "demo-1" and manifest["rows"] == 30 and manifest["shards"] == 3
    assert set(manifest["files"]) == {"part-00000.parquet", "part-00001.parquet", "part-00002.parquet"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(path / name)
    assert manifest["started"] <= manifest["finished"] and not manifest["resumed"]
    assert {"python", "pyarrow", "pandas"} <= set(manifest["library_versions"])

    loaded = load_table(store.path("demo", "v1")).to_pandas()
    assert isinstance(loaded, pd.DataFrame) and loaded["row"].tolist() == list(range(30))
    assert load_table(store.path("demo", "v1"), ["text"]).column_names == ["text"]
    verify(store.path("demo", "v1"))
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporaries or markers left


def test_a_dataframe_is_written_with_plain_types_whatever_the_pandas_version(tmp_path):
    frame = pd.DataFrame({"split": ["test", None], "value": [0.5, float("nan")], "seed": [0, 1]})
    frame.index = [7, 9]  # an index is not a column of the file
    with ArtifactStore(tmp_path).writer("demo", "v1", config={}, inputs={}, code_version="demo-1") as writer:
        writer.write_table("metrics.parquet", frame)
        writer.write_shard(0, frame)
    for name in ("metrics.parquet", "part-00000.parquet"):
        table = pq.read_table(tmp_path / "demo" / "v1" / name)
        assert table.schema.metadata is None  # no pandas metadata: the bytes do not name its version
        assert table.schema.types == [pa.string(), pa.float64(), pa.int64()]  # pandas 3 would give large_string
        assert table.column("split").to_pylist() == ["test", None]


def test_the_listing_order_names_every_stage_of_the_pipeline():
    from moplex_core import assign, augment, cache, evaluate, ingest, tiny_model, train
    from moplex_core.experiments import compare

    stages = [m.STAGE for m in (ingest, tiny_model, augment, cache, train, evaluate, assign, compare)]
    assert list(STAGE_ORDER) == stages


def test_a_version_that_newer_code_builds_again_says_so(tmp_path, caplog):
    store = ArtifactStore(tmp_path)
    write_demo(store, "old111")  # code demo-1
    write_demo(store, "other2", shards=2)  # other settings: not this one's predecessor
    with caplog.at_level(logging.INFO, logger="moplex_core.artifacts.writer"):
        with store.writer("demo", "new222", config={"shards": 3}, inputs={"rankings": "ingest/abc"},
                          code_version="demo-2") as w:
            w.write_shard(0, table(0))
    assert caplog.text.count("demo/old111 has these settings and inputs but was written by demo-1; this code "
                             "writes demo-2, so demo/new222 is built anew") == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moplex_core.artifacts.writer"):
        write_demo(store, "same333", shards=2)  # the same code as its look-alikes: nothing to say
    assert "built anew" not in caplog.text


def test_an_unfinished_version_that_other_code_started_is_named_when_newer_code_builds_again(tmp_path, caplog):
    """An upgrade over an interrupted run: the old folder's files are not resumed (another code
    version is another version), and the run says so rather than training from the start in silence."""
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError), store.writer("demo", "old111", config={"shards": 3},
                                                   inputs={"rankings": "ingest/abc"}, code_version="demo-1") as w:
        w.write_shard(0, table(0))
        raise RuntimeError("killed")
    run = json.loads((w.path / ".started").read_text())
    assert (run["code_version"], run["inputs"]) == ("demo-1", {"rankings": "ingest/abc"})
    with pytest.raises(RuntimeError), store.writer("demo", "other2", config={"shards": 2},  # other settings
                                                   inputs={"rankings": "ingest/abc"}, code_version="demo-1") as w:
        w.write_shard(0, table(0))
        raise RuntimeError("killed")
    with caplog.at_level(logging.INFO, logger="moplex_core.artifacts.writer"):
        with store.writer("demo", "new222", config={"shards": 3}, inputs={"rankings": "ingest/abc"},
                          code_version="demo-2") as w:
            assert w.reused == []
            w.write_shard(0, table(0))
    assert caplog.text.count("demo/old111, unfinished, was started with these settings and inputs by demo-1; this "
                             "code writes demo-2, so its finished files are not resumed and demo/new222 is built "
                             "from the start") == 1
    assert "demo/other2" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moplex_core.artifacts.writer"):  # the same code: nothing to say
        with store.writer("demo", "same333", config={"shards": 2}, inputs={"rankings": "ingest/abc"},
                          code_version="demo-1") as w:
            w.write_shard(0, table(0))
    assert "unfinished" not in caplog.text

def test_a_sibling_whose_start_marker_or_manifest_holds_a_config_that_is_no_mapping_is_passed_over(tmp_path):
    """A hand-edited start marker or manifest beside a new version: the run names nothing of it and starts
    (an AttributeError from the sibling's config.items() stopped every run of the stage before)."""
    store = ArtifactStore(tmp_path)
    unfinished, finished = tmp_path / "demo" / "old111", tmp_path / "demo" / "old222"
    unfinished.mkdir(parents=True)
    (unfinished / ".started").write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", "code_version": "demo-0",
                                                     "inputs": {}, "config": ["shards", 3]}) + "\n")
    finished.mkdir()
    (finished / "manifest.json").write_text(json.dumps({"stage": "demo", "version": "old222", "code_version": "demo-0",
                                                        "files": {}, "inputs": {}, "config": "shards=3"}))
    with store.writer("demo", "new333", config={"shards": 3}, code_version="demo-1") as w:
        w.write_shard(0, table(0))
    assert store.manifest("demo", "new333")["rows"] == 10


def test_list_locate_and_fingerprint(tmp_path):
    store = ArtifactStore(tmp_path)
    write_demo(store, "aaa111")
    write_demo(store, "aab222")
    (tmp_path / "demo" / "abc333").mkdir()  # an unfinished version: its writer left the start marker
    (tmp_path / "demo" / "abc333" / ".started").write_text("2026-11-24T00:00:00+00:00")
    (tmp_path / "demo" / "notes").mkdir()  # not a version: no marker, no manifest of moplex's
    (tmp_path / "experiments" / "identifiability").mkdir(parents=True)  # an experiment's --out under the root
    write_demo(store, "fff999", stage="ingest")
    infos = store.list()
    assert [(str(i.ref), i.complete) for i in infos] == [  # the pipeline's stages first, in its order
        ("ingest/fff999", True), ("demo/aaa111", True), ("demo/aab222", True), ("demo/abc333", False)
    ]
    damaged = write_demo(store, "abd444")
    (damaged / MANIFEST).write_text('{"stage": "demo", "vers')  # a finished version's manifest, cut short
    assert ("demo/abd444", False, None) in [(str(i.ref), i.complete, i.manifest) for i in store.list("demo")]
    found: list[str] = []
    assert "DAMAGED: manifest.json cannot be read" in inspect_path(damaged, damaged=found)  # a version, not data
    listed: list[str] = []
    assert "demo/abd444                      DAMAGED   " in inspect_path(tmp_path / "demo", damaged=listed)
    assert found == listed == [str(damaged)]  # moplex inspect exits 1
    with pytest.raises(ArtifactCorruptError, match=f"{damaged / MANIFEST} cannot be read .*delete the version folder"):
        read_manifest(damaged)  # a stage that finds it "complete" is told which file, not a bare JSON error
    (damaged / MANIFEST).write_text("[1, 2]")
    with pytest.raises(ArtifactCorruptError, match="holds no manifest \\(a JSON list\\)"):
        store.manifest("demo", "abd444")
    shutil.rmtree(damaged)
    assert store.locate("demo/aab").path == tmp_path / "demo" / "aab222"
    write_demo(store, "aab222x")  # a version named with another's whole name as its prefix
    assert store.locate("demo/aab222").path == tmp_path / "demo" / "aab222"
    shutil.rmtree(tmp_path / "demo" / "aab222x")
    with pytest.raises(ArtifactError, match="ambiguous"):
        store.locate("demo/aa")
    with pytest.raises(ArtifactNotFoundError, match="versions of demo: demo/aaa111"):
        store.locate("demo/zzz")
    # what a user types: an existing path as it is, else stage/version under the root
    assert store.resolve("demo/aab") == tmp_path / "demo" / "aab222"
    assert store.resolve("demo/aab/part-00001.parquet") == tmp_path / "demo" / "aab222" / "part-00001.parquet"
    assert store.resolve("no/such/file") == Path("no/such/file")  # a relative path of three parts, not a version
    with pytest.raises(ArtifactNotFoundError, match=r"no artifact demo/zzz under .* \(versions of demo: "):
        store.resolve("demo/zzz/part-00001.parquet")  # a stage of this root: its versions are named
    assert store.resolve(str(tmp_path / "demo" / "aaa111")) == tmp_path / "demo" / "aaa111"
    assert store.resolve("/no/such/folder") == Path("/no/such/folder")  # left for the caller to report
    assert store.resolve("/nosuchdir/abc") == Path("/nosuchdir/abc")  # a path, though it reads as stage/version
    with pytest.raises(ArtifactNotFoundError, match=r"no stage 'nope' there; its stages: demo, ingest\)$"):
        store.resolve("nope/abc")  # experiments/ holds no version: not a stage
    with pytest.raises(ArtifactNotFoundError, match=r"^deom is no path here and no stage's folder under .* \(its "
                                                    r"stages: demo, ingest; did you mean demo\?\)$"):
        store.resolve("deom")  # a stage's name misspelled
    assert ArtifactStore(tmp_path / "elsewhere").resolve("deom") == Path("deom")  # no root: left for the caller
    # a version prefix at the end of a stage folder's path, from anywhere
    assert ArtifactStore(tmp_path / "elsewhere").resolve(str(tmp_path / "demo" / "aab")) == tmp_path / "demo" / "aab222"
    # ... with a path inside the version after it
    assert (ArtifactStore(tmp_path / "elsewhere").resolve(str(tmp_path / "demo" / "aab" / "part-00001.parquet"))
            == tmp_path / "demo" / "aab222" / "part-00001.parquet")
    assert store.resolve(str(tmp_path / "demo" / "aab222" / "gone")) == tmp_path / "demo" / "aab222" / "gone"
    with pytest.raises(ArtifactNotFoundError, match="versions of demo: demo/aaa111"):
        store.resolve(str(tmp_path / "demo" / "zzz"))
    # a folder that is not a stage's is not searched: the path is returned for the caller to report
    (tmp_path / "notes").mkdir()
    assert store.resolve(str(tmp_path / "notes" / "aab")) == tmp_path / "notes" / "aab"
    many = ArtifactStore(tmp_path / "many")
    for i in range(11):
        write_demo(many, f"v{i:02d}")
    with pytest.raises(ArtifactNotFoundError, match=r"demo/v07, and 3 more\)$"):
        many.locate("demo/x")


def test_a_manifest_no_stage_may_trust_is_refused_by_name(tmp_path):
    store = ArtifactStore(tmp_path)
    source = write_demo(store, "abc111")
    manifest = json.loads((source / MANIFEST).read_text())
    copied = tmp_path / "demo" / "def222"
    shutil.copytree(source, copied)  # another version's folder copied under this version's name
    with pytest.raises(ArtifactCorruptError, match="is the manifest of demo/abc111, not of this folder's demo/def222"):
        store.is_complete("demo", "def222")
    shutil.rmtree(copied)
    for edited, problem in [
        ({**manifest, "files": {k: v for k, v in manifest["files"].items() if k != "part-00002.parquet"}},
         "lists 2 row shard\\(s\\) where it records 3"),  # a shard dropped from the list: it would go unread
        ({**manifest, "files": list(manifest["files"])}, "lists its files in another form"),
        ({**manifest, "files": {k: {"sha256": v["sha256"]} for k, v in manifest["files"].items()}},
         "lists its files in another form"),
        ({k: v for k, v in manifest.items() if k != "files"}, "lists no files"),
    ]:
        (source / MANIFEST).write_text(json.dumps(edited))
        for read in (lambda: store.is_complete("demo", "abc111"), lambda: load_table(source), lambda: verify(source)):
            with pytest.raises(ArtifactCorruptError, match=problem):  # not a KeyError or a short table
                read()


def test_a_folder_no_run_began_in_is_named_for_what_it_is_not_called_unfinished(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    version = write_demo(store, "aab222")
    with pytest.raises(ArtifactNotFoundError, match="root is an artifact root, not a version folder: .*its stages: demo"):
        read_manifest(store.root)
    (tmp_path / "data").mkdir()
    with pytest.raises(ArtifactNotFoundError, match="data is not a moplex artifact .*moplex ingest --dataset generic"):
        read_manifest(tmp_path / "data")
    (version / MANIFEST).unlink()  # a version folder copied without its manifest, and no run's marker
    with pytest.raises(ArtifactIncompleteError, match="holds neither manifest.json nor a run's start marker"):
        read_manifest(store.root / "demo" / "aab222")
    (version / ".started").write_text("{}")  # a run began here and did not finish
    with pytest.raises(ArtifactIncompleteError, match="its stage did not finish"):
        read_manifest(version)


def test_a_version_prefix_typed_through_dot_dot_resolves_in_its_stage_folder(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "root")
    version = write_demo(store, "aab222")
    monkeypatch.chdir(version)  # inside a version folder, a sibling by its prefix
    assert ArtifactStore("elsewhere").resolve("../aab/part-00001.parquet") == version / "part-00001.parquet"
    assert ArtifactStore("elsewhere").resolve("../aab") == version


def test_a_stage_name_resolves_to_its_folder_under_the_root_not_the_working_directory(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "root")
    write_demo(store, "aab222")
    monkeypatch.chdir(tmp_path)
    assert store.resolve("demo/") == store.resolve("demo") == store.root / "demo"  # a command names its versions
    (tmp_path / "demo").mkdir()  # a folder of that name here: a path typed as it is, as before
    assert store.resolve("demo") == Path("demo")


def test_unfinished_or_tampered_artifacts_are_refused_with_a_way_out(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(ArtifactNotFoundError):
        load_table(store.path("demo", "nothing"))
    path = write_demo(store)
    (path / "part-00001.parquet").write_bytes(b"not what was written")
    (path / "stray.txt").write_text("x")
    with pytest.raises(ArtifactCorruptError, match="part-00001.parquet changed.*stray.txt is not in the manifest"):
        verify(store.path("demo", "v1"))
    with pytest.raises(ArtifactCorruptError, match="part-00001.parquet missing or not the size or sha256 its manifest"):
        load_table(store.path("demo", "v1"))  # an interrupted copy of a root: refused, never half read
    flipped = write_demo(store, "v3")
    data = bytearray((flipped / "part-00000.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a damaged disk: the size is right, the data is not
    (flipped / "part-00000.parquet").write_bytes(bytes(data))
    with pytest.raises(ArtifactCorruptError, match="v3: part-00000.parquet missing or not the size or sha256 its "
                                                   "manifest records .* Delete the version directory"):
        load_table(flipped)
    (path / MANIFEST).unlink()
    with pytest.raises(ArtifactIncompleteError, match="holds neither manifest.json nor a run's start marker: a "
                                                      "version deleted or copied in part; delete it"):
        load_table(store.path("demo", "v1"))
    lost = write_demo(store, "v2")
    (lost / "part-00002.parquet").unlink()  # a shard the manifest lists: refused, never read around
    with pytest.raises(ArtifactCorruptError, match="part-00002.parquet missing"):
        load_table(store.path("demo", "v2"))


def test_a_finished_version_missing_a_file_is_refused_by_name_when_found_its_checkpoints_aside(tmp_path):
    # What every stage's plan asks: a version half deleted by hand is not handed on as complete.
    store = ArtifactStore(tmp_path)
    with store.writer("train", "t1", config={}) as w:
        for i in range(10):
            w.write_shard(i, table(i))
        w.write_file("em/restart-00/iter-0000/state.json", "{}")
    assert store.is_complete("train", "t1") and not store.is_complete("train", "t2")
    shutil.rmtree(w.path / "em")  # EM's checkpoints: nothing reads them once the version is finished
    assert store.is_complete("train", "t1")
    (w.path / "part-00003.parquet").unlink()
    with pytest.raises(ArtifactCorruptError, match=f"{w.path}: part-00003.parquet missing .*deleted by hand"):
        store.is_complete("train", "t1")
    for shard in w.path.glob("part-*.parquet"):
        shard.unlink()
    with pytest.raises(ArtifactCorruptError, match=r": part-00000.parquet, .*, part-00007.parquet and 2 more missing"):
        store.is_complete("train", "t1")


def test_everything_written_in_the_block_is_on_disk_before_the_manifest(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr("moplex_core.artifacts.writer.os.fsync", recording_fsync)
    store = ArtifactStore(tmp_path)
    with store.writer("train", "v1", config={}) as writer:
        with writer.directory("adapters/c0") as folder:  # as PEFT's save_pretrained fills it
            (folder / "adapter_model.safetensors").write_bytes(b"weights")
        (writer.path / "em" / "iter-0000").mkdir(parents=True)
        (writer.path / "em" / "iter-0000" / "state.json").write_text("{}")  # written by EM, not the store
    path = store.path("train", "v1")
    before_manifest = synced[: max(i for i, p in enumerate(synced) if p.name.startswith(".manifest.json.tmp-"))]
    for needed in (path / "adapters" / "c0" / "adapter_model.safetensors", path / "adapters" / "c0",
                   path / "em" / "iter-0000" / "state.json", path / "em" / "iter-0000", path / "em", path,
                   path.parent):
        assert needed in before_manifest, needed


def test_a_failed_writer_commits_nothing_and_the_next_one_reuses_finished_shards(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.writer("demo", "v1", config={}) as w:
            w.write_shard(0, table(0))
            w.write_shard(1, table(1))
            raise RuntimeError("boom")
    assert not store.is_complete("demo", "v1")
    with store.writer("demo", "v1", config={}) as w:
        assert w.reused == ["part-00000.parquet", "part-00001.parquet"]
        written = [i for i in range(3) if not w.has_shard(i)]
        for i in written:
            w.write_shard(i, table(i))
    assert written == [2]
    assert store.manifest("demo", "v1")["resumed"] is True
    assert load_table(store.path("demo", "v1")).to_pandas()["row"].tolist() == list(range(30))


def test_a_writer_that_failed_before_writing_anything_leaves_no_version_folder(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(OSError, match="no model at /nonexistent"):  # as a stage's model loading fails
        with store.writer("demo", "v1", config={}):
            raise OSError("no model at /nonexistent")
    assert not store.path("demo", "v1").exists() and store.list("demo") == []
    with store.writer("demo", "v1", config={}) as w:  # the rerun starts the version afresh
        assert w.reused == []
        w.write_shard(0, table(0))
    assert store.is_complete("demo", "v1")


def test_the_manifest_of_a_resumed_version_records_every_run_with_its_config_and_libraries(tmp_path, caplog):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.writer("demo", "v1", config={"threads": 2, "model": "/old/root/model"}) as w:
            w.write_shard(0, table(0))
            raise RuntimeError("boom")
    marker = tmp_path / "demo" / "v1" / ".started"
    first = json.loads(marker.read_text())
    first["library_versions"]["torch"] = "0.0.1"  # as if the first run had another torch
    marker.write_text(json.dumps(first) + "\n")
    with caplog.at_level(logging.WARNING, logger="moplex_core.artifacts"):
        with store.writer("demo", "v1", config={"threads": 1, "model": "/new/root/model"}) as w:
            w.write_shard(1, table(1))
    manifest = store.manifest("demo", "v1")
    # the shard it reuses was written with other settings outside the version: said when it resumes (but
    # not a model's new place: its files are the version's input)
    assert (f'demo/v1 resumes from files that earlier runs wrote with threads 2 (last: 1); torch "0.0.1" (last: '
            f'"{manifest["library_versions"]["torch"]}"): settings outside') in caplog.text
    assert [run["config"]["threads"] for run in manifest["runs"]] == [2, 1]
    assert manifest["started"] == manifest["runs"][0]["started"] and manifest["config"]["threads"] == 1
    assert manifest["runs"][1]["library_versions"] == manifest["library_versions"]
    report = inspect_path(tmp_path / "demo" / "v1")
    assert "runs:     2 (this version was worked on by 1 earlier run(s))" in report
    assert 'threads 2 (last: 1)' in report and f'torch "0.0.1" (last: "{manifest["library_versions"]["torch"]}")' in report

    with store.writer("demo", "v2", config={}) as w:
        w.write_shard(0, table(0))
        (w.path / ".started").write_text("2026-11-24T00:00:00+00:00")  # the marker of an older moplex
    assert store.manifest("demo", "v2")["runs"] == [{"started": "2026-11-24T00:00:00+00:00"}]
    (tmp_path / "demo" / "v3").mkdir()
    (tmp_path / "demo" / "v3" / ".started").write_text("2026-11-24T00:00:00+00:00")  # an older moplex's, killed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moplex_core.artifacts"):
        with store.writer("demo", "v3", config={"threads": 1}) as w:
            w.write_shard(0, table(0))
    assert "resumes from files" not in caplog.text  # nothing reused, and an older marker records no settings
    runs = store.manifest("demo", "v3")["runs"]
    assert runs[0] == {"started": "2026-11-24T00:00:00+00:00"} and runs[1]["config"] == {"threads": 1}



def test_a_run_records_torchs_thread_count_and_a_resume_on_another_says_so(tmp_path, caplog):
    # The thread count is outside every version (a machine's setting, like a batch size), yet MKL sums
    # a matrix product's long reductions per thread: the demo's train stage on 2 threads wrote other
    # bytes than on 1 under the same version (docs/reliability.md, "Killed runs"). Its manifest says which.
    import torch

    threads = torch.get_num_threads()
    store = ArtifactStore(tmp_path)
    try:
        torch.set_num_threads(1)
        with pytest.raises(RuntimeError, match="boom"):
            with store.writer("demo", "v1", config={}) as w:
                w.write_shard(0, table(0))
                raise RuntimeError("boom")
        torch.set_num_threads(2)
        with caplog.at_level(logging.WARNING, logger="moplex_core.artifacts"):
            with store.writer("demo", "v1", config={}) as w:
                w.write_shard(1, table(1))
    finally:
        torch.set_num_threads(threads)
    manifest = store.manifest("demo", "v1")
    assert [run["runtime"] for run in manifest["runs"]] == [{"torch_threads": 1}, {"torch_threads": 2}]
    assert manifest["runtime"] == {"torch_threads": 2}
    assert "demo/v1 resumes from files that earlier runs wrote with torch_threads 1 (last: 2)" in caplog.text
    report = inspect_path(tmp_path / "demo" / "v1")
    assert "runtime:  torch_threads 2" in report and "torch_threads 1 (last: 2)" in report


def test_an_unreadable_shard_is_rewritten_not_trusted(tmp_path):
    store = ArtifactStore(tmp_path)
    path = tmp_path / "demo" / "v1"
    path.mkdir(parents=True)
    (path / "part-00000.parquet").write_bytes(b"PAR1 truncated")
    sink = pa.BufferOutputStream()
    pq.write_table(table(1), sink)
    garbled = bytearray(sink.getvalue().to_pybytes())
    garbled[-40:-8] = b"\xff" * 32  # a garbled footer: pyarrow says OSError without an errno
    (path / "part-00001.parquet").write_bytes(bytes(garbled))
    with store.writer("demo", "v1", config={}) as w:
        assert not w.has_shard(0) and not w.has_shard(1)
        w.write_shard(0, table(0))
        w.write_shard(1, table(1))
    assert load_table(store.path("demo", "v1")).to_pandas()["row"].tolist() == list(range(20))


SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import pyarrow as pa
    from moplex_core.artifacts import ArtifactStore

    root, mode = sys.argv[1], sys.argv[2]
    with ArtifactStore(root).writer("demo", "v1", config={"shards": 5}) as w:
        for i in range(5):
            if w.has_shard(i):
                print("reused", i, flush=True)
                continue
            rows = range(10 * i, 10 * i + 10)
            table = pa.table({"row": pa.array(rows, pa.int64()), "text": [f"row {k}" for k in rows]})
            with w.open_shard(i, table.schema) as out:
                out.write_table(table.slice(0, 5))
                if mode == "die-in-shard-3" and i == 3:
                    Path(root, "halfway").write_text("shard 3 is half written")
                    time.sleep(120)
                out.write_table(table.slice(5))
        w.write_file("notes/about.txt", "five shards of ten rows")
    """
)


def run_writer(root: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SLOW_WRITER, str(root), mode], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=60)


def test_resume_after_sigkill_mid_shard_reuses_finished_shards_and_gives_the_same_artifact(tmp_path):
    root, clean_root = tmp_path / "killed", tmp_path / "clean"
    version_dir = root / "demo" / "v1"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(root), "die-in-shard-3"], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (root / "halfway").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the writer never reached shard 3"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)

    visible = sorted(p.name for p in version_dir.iterdir() if not p.name.startswith("."))
    assert visible == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [p.name for p in version_dir.glob(".part-00003.parquet.tmp-*")], "the half-written temporary"

    resumed = run_writer(root, "finish")
    assert resumed.stdout.split("\n")[:3] == ["reused 0", "reused 1", "reused 2"]
    assert not list(version_dir.glob(".*.tmp-*"))
    run_writer(clean_root, "finish")

    store, clean = ArtifactStore(root), ArtifactStore(clean_root)
    assert store.manifest("demo", "v1")["files"] == clean.manifest("demo", "v1")["files"]
    assert store.manifest("demo", "v1")["resumed"] and not clean.manifest("demo", "v1")["resumed"]
    assert load_table(store.path("demo", "v1")).equals(load_table(clean.path("demo", "v1")))
    verify(store.path("demo", "v1"))


def test_a_second_writer_of_one_version_waits_then_finds_it_complete(tmp_path):
    store = ArtifactStore(tmp_path)
    inside, release = threading.Event(), threading.Event()

    def first_writer():
        with store.writer("demo", "v1", config={}) as w:
            w.write_shard(0, table(0))
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=first_writer)
    thread.start()
    assert inside.wait(10)
    with pytest.raises(ArtifactError, match="waiting for another writer"):
        with store.writer("demo", "v1", config={}, lock_timeout=0.2):
            pass
    threading.Timer(0.3, release.set).start()
    with store.writer("demo", "v1", config={}) as second:
        assert second.complete  # waited for the lock, then found the finished version
        with pytest.raises(ArtifactError, match="already complete"):
            second.write_shard(1, table(1))
    thread.join()
    assert store.manifest("demo", "v1")["rows"] == 10


def test_a_folder_written_again_replaces_the_last_whole_and_one_that_fails_leaves_it_and_no_staging(tmp_path):
    """A resumed run writes a folder a killed one finished (its adapters, its tiny model): the new one
    replaces it whole, no file of the old one left in it; an error while filling it keeps the last
    whole folder and removes the half-filled staging folder."""
    store = ArtifactStore(tmp_path)
    with store.writer("train", "v1", config={}) as w:
        with w.directory("adapters/c0") as staging:
            (staging / "old.bin").write_bytes(b"old")
        with w.directory("adapters/c0") as staging:
            (staging / "new.bin").write_bytes(b"new")
        assert sorted(p.name for p in (w.path / "adapters" / "c0").iterdir()) == ["new.bin"]
        with pytest.raises(RuntimeError, match="save_pretrained failed"):
            with w.directory("adapters/c0") as staging:
                (staging / "half.bin").write_bytes(b"half")
                raise RuntimeError("save_pretrained failed")
        assert sorted(p.name for p in (w.path / "adapters").iterdir()) == ["c0"]  # no hidden staging folder
        assert sorted(p.name for p in (w.path / "adapters" / "c0").iterdir()) == ["new.bin"]
    assert sorted(store.manifest("train", "v1")["files"]) == ["adapters/c0/new.bin"]


def test_extra_files_folders_and_subartifacts_are_written_atomically_and_hashed(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.writer("train", "v1", config={}) as w:
        w.write_file("em/iter-0001/state.json", json.dumps({"iteration": 1}))
        w.write_table("em/iter-0001/posteriors.parquet", pd.DataFrame({"example_id": ["a"], "gamma": [[0.5, 0.5]]}))
        with w.directory("em/iter-0001/adapters/c0") as staging:
            assert staging.name.startswith(".") and staging.parent.name == "adapters"
            (staging / "adapter_config.json").write_text("{}")
            (staging / "adapter_model.safetensors").write_bytes(b"\0" * 16)
        assert (w.path / "em/iter-0001/adapters/c0/adapter_config.json").is_file()
    manifest = store.manifest("train", "v1")
    assert sorted(manifest["files"]) == [
        "em/iter-0001/adapters/c0/adapter_config.json",
        "em/iter-0001/adapters/c0/adapter_model.safetensors",
        "em/iter-0001/posteriors.parquet",
        "em/iter-0001/state.json",
    ]
    assert manifest["rows"] == 0 and manifest["shards"] == 0
    with pytest.raises(ArtifactError, match="holds no part-"):
        load_table(store.path("train", "v1"))


def test_a_resumed_writer_deletes_temporaries_of_killed_writers(tmp_path):
    store = ArtifactStore(tmp_path)
    sub = tmp_path / "train" / "v1" / "em" / "iter-0002"
    sub.mkdir(parents=True)
    (sub / ".state.json.tmp-1234").write_text("half")  # moplex_core.em's temporary naming
    (sub / ".c0.tmp-abcd1234").mkdir()  # a staged folder
    (sub / "posteriors.parquet").write_bytes(b"finished elsewhere")
    with store.writer("train", "v1", config={}) as w:
        assert w.reused == ["em/iter-0002/posteriors.parquet"]
    assert sorted(p.name for p in sub.iterdir()) == ["posteriors.parquet"]


def test_misuse_is_refused_with_a_reason(tmp_path):
    store = ArtifactStore(tmp_path)
    writer = store.writer("demo", "v1", config={})
    with pytest.raises(ArtifactError, match="outside its `with store.writer"):
        writer.write_shard(0, table(0))
    with store.writer("demo", "v1", config={}) as w:
        for bad in ("../escape.txt", ".hidden", "/abs.txt", MANIFEST):
            with pytest.raises(ValueError):
                w.write_file(bad, "x")
    with pytest.raises(ValueError, match="plain, non-hidden"):
        store.path("demo", "../up")
    with pytest.raises(ArtifactError, match="gaps at \\[1\\]"):
        with store.writer("demo", "v2", config={}) as w:
            w.write_shard(0, table(0))
            w.write_shard(2, table(2))
    assert not store.is_complete("demo", "v2")


def test_a_model_folder_is_read_once_per_process_until_a_file_changes(tmp_path, monkeypatch):
    from moplex_core import hashing

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    reads = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda path: reads.append(path) or real(path))
    first = hashing.model_fingerprint(str(model))
    assert hashing.model_fingerprint(str(model)) == first and len(reads) == 2  # the second call read nothing
    written = (model / "model.safetensors").stat().st_mtime_ns
    (model / "model.safetensors").write_bytes(b"weightz")  # the same size, other bytes
    os.utime(model / "model.safetensors", ns=(written + 10**9, written + 10**9))  # a later time on any file system
    assert hashing.model_fingerprint(str(model)) != first and len(reads) == 4


def test_a_link_in_a_version_folder_is_never_followed(tmp_path):
    store = ArtifactStore(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    folder = store.path("demo", "v1")
    folder.mkdir(parents=True)
    (folder / ".started").symlink_to(outside)  # a run would append its record there, and read it back
    with pytest.raises(ArtifactCorruptError, match=r"\.started is not a regular file \(a link\?\)"):
        with store.writer("demo", "v1", config={}):
            pass
    assert outside.read_text() == "precious\n"
    (folder / ".started").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("")
    (folder / ".x.tmp-1").symlink_to(elsewhere, target_is_directory=True)  # a temporary that is a link
    with store.writer("demo", "v1", config={}) as w:  # the lock was given back; the link goes, not its target
        w.write_shard(0, table(0))
    assert (elsewhere / "keep").exists() and not (folder / ".x.tmp-1").exists()


def test_a_manifest_naming_files_outside_its_folder_is_refused_not_read(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.writer("demo", "v1", config={}) as w:
        w.write_shard(0, table(0))
    manifest_path = store.path("demo", "v1") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["../../secret.txt"] = {"bytes": 1, "sha256": "0" * 64}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactCorruptError, match=r"lists files outside its version folder \('\.\./\.\./secret\.txt'\)"):
        verify(store.path("demo", "v1"))
    assert readable_manifest(store.path("demo", "v1")) is None  # inspect then reports it unreadable


def test_a_prefix_a_stage_folder_or_a_version_without_shards_given_to_load_table_is_answered_with_what_to_give(
        tmp_path):
    """A notebook's load_table("ROOT/ingest/63fa") or ("ROOT/ingest"): before, "no artifact at" and "has no
    manifest.json: its stage did not finish. Rerun the stage" (wrong advice for a stage's folder)."""
    store = ArtifactStore(tmp_path)
    write_demo(store, "0a1b2c3d4e5f")
    write_demo(store, "0a1b99999999")
    with pytest.raises(ArtifactNotFoundError, match=r"no artifact at .*demo/0a1b \(a version folder takes its full "
                                                    r"name: 0a1b2c3d4e5f, 0a1b99999999; ArtifactStore\(ROOT\)\.locate"
                                                    r"\('demo/0a1b'\) finds one by prefix\)"):
        load_table(tmp_path / "demo" / "0a1b")
    with pytest.raises(ArtifactNotFoundError, match=r"demo is a stage's folder, not a version folder: give one of "
                                                    r"its versions \(0a1b2c3d4e5f, 0a1b99999999\)"):
        load_table(tmp_path / "demo")
    assert load_table(store.locate("demo/0a1b2").path).num_rows == 30
    with pytest.raises(ArtifactNotFoundError, match=r"no artifact at \S+/demo/ffff$"):  # no version of that prefix
        load_table(tmp_path / "demo" / "ffff")
    with store.writer("train", "v1", config={}, code_version="t-1") as w:
        w.write_table("posteriors.parquet", table(0))
    with pytest.raises(ArtifactError, match=r"holds no part-\*\.parquet shards; its stage writes other files only "
                                            r"\(read posteriors\.parquet with pd\.read_parquet\)"):
        load_table(store.path("train", "v1"))
