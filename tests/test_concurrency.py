"""Two runs on one artifact root, and a root that cannot be written (issue 8, item 3).

Two writers of one version take its file lock (DESIGN 4): the second waits, then finds the version
complete and reuses it; nothing is written twice and the artifact verifies. A read-only or full root
fails with `ArtifactStorageError` naming the path, and nothing half-written is marked complete.
"""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from moplex_core.artifacts import ArtifactStorageError, ArtifactStore, read_manifest, verify
from moplex_core.cli import main
from moplex_core.config import IngestConfig
from moplex_core.ingest import plan_ingest, run_ingest

from prefect_server_fixtures import prefect_environment, start

REPO = Path(__file__).resolve().parents[1]
INGEST = ["ingest", "--dataset", "synthetic", "--set", "synthetic.n=300", "--set", "shard_rows=100"]
CONFIG = IngestConfig(dataset="synthetic", synthetic={"n": 300}, shard_rows=100)
# `moplex ingest` with INFO logging on, so a test can see a process reach the lock (same main()).
LOGGED_MAIN = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
               "from moplex_core.cli import main; sys.exit(main(sys.argv[1:]))")


def _hidden_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".*"))


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_two_processes_writing_one_version_the_second_waits_then_reuses(tmp_path):
    """Both `moplex ingest` processes are held at the version's lock (the test takes it first), so
    they really overlap; released, one writes and the other finds the version complete."""
    root = tmp_path / "root"
    plan = plan_ingest(CONFIG, ArtifactStore(root))
    (root / "ingest").mkdir(parents=True)
    lock = FileLock(root / "ingest" / f".{plan.ref.version}.lock")
    lock.acquire()
    logs = [tmp_path / f"run-{i}.log" for i in range(2)]
    processes = [start([sys.executable, "-c", LOGGED_MAIN, *INGEST, "--root", str(root)], None, log) for log in logs]
    try:
        _wait_for(lambda: all("waiting for its lock" in log.read_text() for log in logs), 120,
                  "both processes to wait for the lock")
        assert all(p.poll() is None for p in processes)
        assert not plan.path.exists() or not (plan.path / "manifest.json").exists()
        lock.release()
        for p in processes:
            p.wait(timeout=120)
    finally:
        if lock.is_locked:
            lock.release()
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], outputs
    wrote = [o for o in outputs if f"{plan.ref}: wrote 300 rankings" in o]
    reused = [o for o in outputs if "was completed by another run while this one waited" in o
              and f"{plan.ref} is already complete" in o]
    assert len(wrote) == 1 and len(reused) == 1, outputs
    verify(plan.path)
    manifest = read_manifest(plan.path)
    assert manifest["rows"] == 300 and manifest["shards"] == 3 and not manifest["resumed"]
    assert [p.name for p in (root / "ingest").iterdir() if not p.name.startswith(".")] == [plan.ref.version]
    assert _hidden_files(plan.path) == []


@pytest.mark.slow  # two `moplex run` processes, each with its own temporary Prefect server: ~3 min on 2 cores
@pytest.mark.timeout(900)
def test_two_moplex_runs_of_one_config_on_one_root(tmp_path):
    """The whole pipeline twice at once, same config, same root, same PREFECT_HOME (as one user
    starting it twice): both complete with the same artifacts, each written once, and all verify.

    The home's database is created first: two temporary servers starting on a fresh PREFECT_HOME
    race on Prefect's own first migration ("duplicate column name"; Prefect then restarts the
    server), which is Prefect's start-up, not the artifact store this test is about."""
    root = tmp_path / "artifacts"
    env = prefect_environment(tmp_path / "prefect-home", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
                              OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo", "--threads", "1", "--root", str(root),
               "--set", "ingest.synthetic.n=60", "--set", "tiny_model.pretrain_steps=20",
               "--set", "train.em_iterations=2", "--set", "train.first_epochs=1", "--set", "stage_retries=0"]
    subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=300)
    logs = [tmp_path / f"run-{i}.log" for i in range(2)]
    processes = [start(command, env, log) for log in logs]
    try:
        for p in processes:
            p.wait(timeout=840)
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    stages = ("ingest", "model", "augment", "cache", "train", "evaluate")
    for stage in stages:
        versions = [p for p in (root / stage).iterdir() if not p.name.startswith(".")]
        assert len(versions) == 1, (stage, versions)
        verify(versions[0])
        assert _hidden_files(versions[0]) == [], stage
        assert all(f"{stage:<9} {versions[0]}" in o for o in outputs), stage  # both name the same folder
    # written once: the other run waited at the lock and found it complete, or planned after it was
    assert sum(o.count("wrote 60 rankings to") for o in outputs) == 1
    assert sum(o.count("augmented rankings to") for o in outputs) == 1


# ---------------------------------------------------------------------------------------------------
# a root that cannot be written


def test_a_read_only_root_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """A root without write permission; as root, which ignores file permissions, its folders' mkdir
    raises EACCES as the kernel would."""
    root = tmp_path / "root"
    root.mkdir()
    if os.geteuid() == 0:
        real_mkdir = pathlib.Path.mkdir

        def denied(self, *args, **kwargs):
            if str(self).startswith(f"{root}/"):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", denied)
    root.chmod(0o555)
    try:
        assert main([*INGEST, "--root", str(root)]) == 1
    finally:
        root.chmod(0o755)
    err = capsys.readouterr().err
    assert "cannot write" in err and "permission is denied" in err and str(root) in err
    assert list(root.iterdir()) == []


def test_a_root_under_a_file_is_a_clear_error_and_a_missing_root_is_named(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main([*INGEST, "--root", str(tmp_path / "afile" / "root")]) == 1  # real: ENOTDIR, not injected
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'afile' / 'root'}" in err and "a part of the path is a file, not a folder" in err
    assert "Move what is in the way, or choose another root" in err and "Free space" not in err
    assert main(["inspect", "ingest/abcd", "--root", str(tmp_path / "nowhere")]) == 1
    assert f"under {tmp_path / 'nowhere'}, which does not exist" in capsys.readouterr().err
    assert main(["inspect", "--root", str(tmp_path / "nowhere")]) == 1  # the root's listing
    assert f"no artifacts to list: the root is {tmp_path / 'nowhere'}, which does not exist (run from" in \
        capsys.readouterr().err


def test_a_read_only_file_system_is_a_clear_error_and_a_finished_version_still_reads(tmp_path, capsys, monkeypatch):
    """Injected: every mkdir under the root raises EROFS (as root, chmod cannot make a directory
    read-only, and no read-only mount is available here)."""
    root = tmp_path / "root"
    real_mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(root)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    assert main([*INGEST, "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"moplex ingest: cannot write {root}/ingest/" in err and "the file system is read-only" in err
    assert "--root DIR" in err
    assert not root.exists()

    monkeypatch.setattr(pathlib.Path, "mkdir", real_mkdir)
    assert main([*INGEST, "--root", str(root)]) == 0  # written while writable
    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    capsys.readouterr()
    assert main([*INGEST, "--root", str(root)]) == 0  # complete: nothing to write, so read-only is fine
    assert "already complete" in capsys.readouterr().out


def test_a_full_disk_mid_stage_marks_nothing_complete_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    """Injected: the write of the second shard raises ENOSPC, as a full disk would (no small
    file system can be mounted here). The first shard stays for the resume; the rerun reuses it."""
    root = tmp_path / "root"
    real_writer = pq.ParquetWriter

    class FullDisk(real_writer):
        def write_table(self, table, *args, **kwargs):
            if "part-00001" in str(self.where):
                raise OSError(errno.ENOSPC, "No space left on device", str(self.where))
            return super().write_table(table, *args, **kwargs)

    monkeypatch.setattr("moplex_core.artifacts.writer.pq.ParquetWriter", FullDisk)
    assert main([*INGEST, "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "part-00001.parquet" in err and "no space is left on the device" in err
    version = plan_ingest(CONFIG, ArtifactStore(root)).path
    assert not (version / "manifest.json").exists()
    assert sorted(p.name for p in version.iterdir() if not p.name.startswith(".")) == ["part-00000.parquet"]
    assert not [p for p in version.iterdir() if ".tmp-" in p.name]
    first = (version / "part-00000.parquet").stat()

    monkeypatch.setattr("moplex_core.artifacts.writer.pq.ParquetWriter", real_writer)
    assert main([*INGEST, "--root", str(root)]) == 0
    manifest = read_manifest(version)
    assert manifest["resumed"] and manifest["shards"] == 3
    assert (version / "part-00000.parquet").stat().st_mtime_ns == first.st_mtime_ns  # reused, not rewritten
    verify(version)


def test_only_errors_about_the_root_are_blamed_on_it(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    model = tmp_path / "models" / "base" / "model.safetensors"
    with pytest.raises(PermissionError) as err:  # e.g. an unreadable base model, loaded in the block
        with store.writer("train", "v1", config={}):
            raise PermissionError(errno.EACCES, "Permission denied", str(model))
    assert not isinstance(err.value, ArtifactStorageError) and err.value.filename == str(model)
    with pytest.raises(PermissionError):  # a file name in bytes: still the error itself, not a TypeError
        with store.writer("train", "v4", config={}):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsencode(model))
    with pytest.raises(ArtifactStorageError, match="permission is denied"):  # PEFT writing into the version
        with store.writer("train", "v2", config={}) as writer:
            raise PermissionError(errno.EACCES, "Permission denied", str(writer.path / "adapters" / "c0"))
    with pytest.raises(ArtifactStorageError, match="no space is left"):  # pyarrow names no file
        with store.writer("train", "v3", config={}):
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_the_manifest_leaves_the_version_incomplete(tmp_path, monkeypatch):
    """Injected: writing the manifest's temporary file raises ENOSPC."""
    real_write_text = pathlib.Path.write_text

    def full_at_manifest(self, *args, **kwargs):
        if self.name.startswith(".manifest.json.tmp-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_at_manifest)
    store = ArtifactStore(tmp_path)
    with pytest.raises(ArtifactStorageError, match="manifest.json: no space is left on the device"):
        run_ingest(CONFIG, store)
    version = plan_ingest(CONFIG, store).path
    assert not (version / "manifest.json").exists() and len(list(version.glob("part-*.parquet"))) == 3
    monkeypatch.setattr(pathlib.Path, "write_text", real_write_text)
    assert run_ingest(CONFIG, store).built
    verify(version)
