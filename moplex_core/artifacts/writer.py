"""`ArtifactWriter`: one version written so that a crash never leaves a lie, resumed by the next
writer; `atomic_path` for any file written into place."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock, Timeout

from moplex_core.artifacts.errors import (
    FOLDER_PROBLEMS,
    ArtifactCorruptError,
    ArtifactError,
    about_the_folder,
    storage_error,
    storage_errors,
)
from moplex_core.artifacts.layout import (
    MANIFEST,
    SHARD_RE,
    STARTED,
    ArtifactRef,
    has_manifest,
    own_file_name,
    readable_manifest,
    shard_name,
    shard_paths,
    visible_files,
)
from moplex_core.hashing import sha256_file

log = logging.getLogger(__name__)

# This process's mark in the manifests it finishes (`written_here`): a version another process finished
# while this one waited for its lock is told apart from one this process wrote in the same seconds.
PROCESS_MARK = uuid.uuid4().hex

_LIBRARIES = ("moplex", "pyarrow", "pandas", "numpy", "torch", "transformers", "peft", "datasets", "prefect")


class ArtifactWriter:
    """Writes one version of a stage output; commit (the manifest) happens on a clean exit.

    Use as ``with store.writer(stage, version, config=...) as w:``. Entering takes the version's lock
    (a second writer waits), then:

    - ``w.complete`` is True when the version was already finished (another run completed it while
      this one waited): the body should do nothing, and nothing is written or rewritten;
    - otherwise files left by an interrupted run are kept (``w.reused`` names them) and hidden
      temporaries are deleted; ``has_shard`` tells the body which shards it may skip.

    On a clean exit the manifest is written: config, inputs, rows (sum over shards), the sha256 of
    every file, start and finish times, library versions, ``w.summary`` (stage-specific numbers),
    and ``runs``: the start time, config and library versions of every run that worked on the
    version, failed attempts included (the top-level config is the last run's).
    On an exception nothing is committed and finished files stay for the next run; a version that
    has no finished file then (the stage failed before writing one: a missing model, bad input) is
    removed, so that no folder is listed as an interrupted run to resume (its ``.started`` lines go
    with it: no run worked on it).
    Code that writes its own files under ``w.path`` must write them under a hidden temporary name
    and rename them into place, as this class does.
    """

    def __init__(
        self,
        path: Path,
        ref: ArtifactRef,
        config: dict[str, Any],
        inputs: dict[str, str],
        code_version: str,
        lock_timeout: float | None,
    ):
        self.path = path
        self.ref = ref
        self.complete = False
        self.reused: list[str] = []
        self.summary: dict[str, Any] = {}
        self._config = config
        self._inputs = inputs
        self._code_version = code_version
        self._lock = FileLock(path.parent / f".{path.name}.lock")
        self._lock_timeout = -1 if lock_timeout is None else lock_timeout
        self._open = False

    def __enter__(self) -> ArtifactWriter:
        try:
            with storage_errors(self.path, FOLDER_PROBLEMS):
                self._enter()
        except BaseException:
            if self._lock.is_locked:
                self._lock.release()
            raise
        self._open = True
        return self

    def _enter(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        waited = False
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            waited = True
            log.info("%s is being written by another run; waiting for its lock", self.ref)
            try:
                self._lock.acquire(timeout=self._lock_timeout)
            except Timeout:
                raise ArtifactError(
                    f"gave up after {self._lock_timeout} s waiting for another writer of {self.ref} "
                    f"(lock {self._lock.lock_file}). If no such run is alive, the lock is stale: delete it."
                ) from None
        self.complete = has_manifest(self.path)
        if self.complete:
            log.info("%s %s; nothing to do", self.ref,
                     "was completed by another run while this one waited" if waited else "is already complete")
        else:
            self.path.mkdir(exist_ok=True)
            _remove_temporaries(self.path)
            self.reused = visible_files(self.path)
            marker = self.path / STARTED
            if marker.is_symlink() or (marker.exists() and not marker.is_file()):
                raise ArtifactCorruptError(f"{marker} is not a regular file (a link?): a run records itself there, "
                                           "and no link is followed out of a version folder; remove it and rerun")
            if self.reused:
                log.info("%s resumes an interrupted run; reusing %d finished file(s)", self.ref, len(self.reused))
            elif not marker.exists():
                self._say_what_it_supersedes()
            run = {"started": _now(), "config": self._config, "library_versions": _library_versions(),
                   "runtime": _runtime(), "code_version": self._code_version, "inputs": self._inputs}
            # Where a model lies is left out: its files are the version's input, so they are the same.
            changes = sorted({change for earlier in _started_runs(marker)
                              for change in run_changes(earlier, run, ("model",))})
            if self.reused and changes:
                log.warning("%s resumes from files that earlier runs wrote with %s: settings outside the version "
                            "(how, not what), but a float they hold can differ from this run's in its last digits "
                            "(a sampled token of augment's can flip); `moplex inspect` lists every run",
                            self.ref, "; ".join(changes))
            ended = not marker.exists() or marker.read_bytes().endswith(b"\n")  # an older moplex's has no newline
            with open(marker, "a") as started:  # one line per run of this version
                started.write(("" if ended else "\n") + json.dumps(run, sort_keys=True, default=str) + "\n")

    def _say_what_it_supersedes(self) -> None:
        """A new version beside a finished one of the same inputs and recorded config (every setting,
        those outside the version too, where the model lies aside) that other stage code wrote (an
        upgrade of moplex): say why the stage runs again, which it would otherwise do in silence, hours
        of training perhaps. A sibling that also differs in a setting outside the version (a batch
        size) is not named: the writer has the recorded config, not the version's identity."""
        def settings(config: dict[str, Any], inputs: dict[str, Any]) -> Any:  # where a model lies is left out, as
            if not isinstance(config, dict):  # a hand-edited marker or manifest: matches nothing, raises nothing
                return None
            return json.loads(json.dumps([{k: v for k, v in config.items() if k != "model"}, inputs],  # in a resume
                                         sort_keys=True, default=str))

        ours = settings(self._config, self._inputs)
        for sibling in sorted(self.path.parent.iterdir()):
            manifest = readable_manifest(sibling) if sibling != self.path and sibling.is_dir() else None
            if manifest and manifest.get("code_version") != self._code_version and \
                    settings(manifest.get("config") or {}, manifest.get("inputs") or {}) == ours:
                log.warning("%s/%s has these settings and inputs but was written by %s; this code writes %s, so "
                            "%s is built anew (`moplex inspect` shows both)", self.ref.stage, sibling.name,
                            manifest.get("code_version"), self._code_version, self.ref)
                return
            # An unfinished one that other stage code started: its files are not resumed (the code version is
            # part of the version), which the run would otherwise not say. A marker of a moplex before
            # commit 53ff48d records neither code version nor inputs: nothing is said of it.
            last = last_started_run(sibling) if sibling != self.path and not manifest else None
            if last and {"code_version", "inputs"} <= last.keys() and last["code_version"] != self._code_version \
                    and settings(last.get("config") or {}, last["inputs"] or {}) == ours:
                log.warning("%s/%s, unfinished, was started with these settings and inputs by %s; this code writes "
                            "%s, so its finished files are not resumed and %s is built from the start (delete "
                            "%s/%s unless a moplex that writes %s is to finish it)", self.ref.stage, sibling.name,
                            last["code_version"], self._code_version, self.ref, self.ref.stage, sibling.name,
                            last["code_version"])
                return

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        try:
            if exc_type is None and not self.complete:
                self._commit()
                self.complete = True
            elif not self.complete and not visible_files(self.path):
                # Failed before it wrote anything (a model that is not there, bad input): no folder is
                # left for `moplex inspect` to list as an interrupted run to resume.
                with suppress(OSError):  # the error that stopped the run is the one to see
                    shutil.rmtree(self.path)
        finally:
            self._lock.release()
        # A full or read-only root met by code writing its own files in the block (e.g. PEFT's
        # save_pretrained) gets the same sentence as the store's own writes; an error naming another
        # place (an unreadable model file or input artifact) stays as it is. A full device that names
        # no file is taken to be the root's.
        storage = storage_error(exc, self.path) if about_the_folder(exc, self.path) else None
        if storage is not None:
            raise storage from exc

    def has_shard(self, index: int) -> bool:
        """Whether shard ``index`` is finished: visible (renamed into place) with a readable footer."""
        path = self.path / shard_name(index)
        if not path.is_file():
            return False
        try:
            pq.read_metadata(path)
        except (pa.ArrowInvalid, OSError) as err:
            if isinstance(err, OSError) and err.errno is not None:  # EIO, EMFILE: raised, never a deletion
                raise
            log.warning("%s has an unreadable footer (%s); it will be rewritten", path, err)
            path.unlink()
            return False
        return True

    def write_shard(self, index: int, data: pa.Table | pd.DataFrame) -> Path:
        table = arrow_table(data)
        with self.open_shard(index, table.schema) as out:
            out.write_table(table)
        return self.path / shard_name(index)

    @contextmanager
    def open_shard(self, index: int, schema: pa.Schema) -> Iterator[pq.ParquetWriter]:
        """Stream record batches into shard ``index``; it becomes visible only when the block ends."""
        with self._staged(shard_name(index)) as tmp, pq.ParquetWriter(tmp, schema) as out:
            yield out

    def write_table(self, name: str, data: pa.Table | pd.DataFrame) -> Path:
        """Any other Parquet file of the artifact, e.g. ``rejected.parquet``."""
        table = arrow_table(data)
        with self._staged(name) as tmp:
            pq.write_table(table, tmp)
        return self.path / name

    def write_file(self, name: str, data: bytes | str) -> Path:
        with self._staged(name) as tmp:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        return self.path / name

    @contextmanager
    def directory(self, name: str) -> Iterator[Path]:
        """A folder filled by other code (e.g. PEFT ``save_pretrained``), renamed into place when whole."""
        target = self.path / own_file_name(name)
        self._check_writable()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        staging.mkdir()
        try:
            yield staging
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
            _fsync_dir(target.parent)
        finally:
            if staging.exists():
                shutil.rmtree(staging)

    @contextmanager
    def _staged(self, name: str) -> Iterator[Path]:
        target = self.path / own_file_name(name)
        self._check_writable()
        with atomic_path(target) as tmp:
            yield tmp

    def _check_writable(self) -> None:
        if not self._open:
            raise ArtifactError(f"write to {self.ref} outside its `with store.writer(...)` block")
        if self.complete:
            raise ArtifactError(f"{self.ref} is already complete; nothing may be written to it")

    def _commit(self) -> None:
        shards = shard_paths(self.path)
        indices = [int(SHARD_RE.match(p.name).group(1)) for p in shards]
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            raise ArtifactError(
                f"{self.ref} has shards {indices} with gaps at {missing}; shards must be numbered 0..n-1. "
                "Write the missing shards before leaving the writer block."
            )
        files = {
            name: {"sha256": sha256_file(self.path / name), "bytes": (self.path / name).stat().st_size}
            for name in visible_files(self.path)
        }
        _sync_tree(self.path, files)  # what other code wrote into the block (PEFT, EM) reaches the disk first
        started = self.path / STARTED
        runs = _started_runs(started) or [{"started": _now()}]
        manifest = {
            "stage": self.ref.stage,
            "version": self.ref.version,
            "code_version": self._code_version,
            "config": self._config,
            "inputs": self._inputs,
            "rows": sum(pq.read_metadata(p).num_rows for p in shards),
            "shards": len(shards),
            "files": files,
            "summary": self.summary,
            "started": runs[0]["started"],
            "finished": _now(),
            "resumed": bool(self.reused),
            "process": PROCESS_MARK,
            "runs": runs,
            "library_versions": _library_versions(),
            "runtime": _runtime(),
        }
        with atomic_path(self.path / MANIFEST) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        started.unlink(missing_ok=True)



@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A hidden temporary path beside ``target``, renamed onto it (durably) when the block ends."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with storage_errors(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
    finally:
        with suppress(OSError):  # an unwritable folder must not hide the error above
            tmp.unlink(missing_ok=True)



def _remove_temporaries(version_dir: Path) -> None:
    # Hidden entries are temporaries of killed writers (ours, `atomic_path`'s ".name.tmp-<uuid>", and
    # e.g. moplex_core.train's ".adapters.tmp-<pid>").
    for path in sorted(version_dir.rglob(".*"), reverse=True):
        if ".tmp-" in path.name:
            log.info("removing %s left by an interrupted writer", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:  # a file, or a link (never followed: what it points at is not ours)
                path.unlink(missing_ok=True)



def _sync_tree(version_dir: Path, names: Iterable[str]) -> None:
    """fsync the files ``names`` below ``version_dir``, their folders deepest first, the version folder
    and its stage folder, so that a power loss after the manifest cannot leave it naming lost bytes."""
    folders = {version_dir, version_dir.parent}
    for name in names:
        with open(version_dir / name, "rb") as f:
            os.fsync(f.fileno())
        folders.update((version_dir / name).parents[: len(PurePosixPath(name).parts) - 1])
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(folder)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_changes(earlier: dict[str, Any], later: dict[str, Any], ignore: Collection[str] = ()) -> list[str]:
    """What run record ``earlier`` (a manifest's ``runs`` entry) ran with that ``later`` did not: one
    ``key value (last: value)`` per config value (but those in ``ignore``), library version or runtime
    setting (`_runtime`: torch's thread count)."""
    return [f"{key} {json.dumps(value, default=str)} (last: {json.dumps((later.get(field) or {}).get(key), default=str)})"
            for field in ("config", "library_versions", "runtime")
            for key, value in sorted((earlier.get(field) or {}).items())
            if value != (later.get(field) or {}).get(key) and not (field == "config" and key in ignore)]


def _started_runs(started: Path) -> list[dict[str, Any]]:
    """The runs that wrote a version, first first, from its start marker: each run's start time,
    config, library versions, runtime, and (since commit 53ff48d) the stage's code version and inputs (a
    marker of an older moplex holds fewer: a bare start time at first)."""
    if not started.exists():
        return []
    runs = []
    for line in started.read_text().splitlines():
        try:
            run = json.loads(line)
        except ValueError:
            run = None
        runs.append(run if isinstance(run, dict) and "started" in run else {"started": line.strip()})
    return [run for run in runs if run["started"]]


def last_started_run(version_dir: Path) -> dict[str, Any] | None:
    """The last run record of an unfinished version's start marker; None where there is none, or it
    cannot be read (a link is not followed out of a version folder)."""
    marker = version_dir / STARTED
    if not version_dir.is_dir() or marker.is_symlink() or not marker.is_file():
        return None
    try:
        runs = _started_runs(marker)
    except (OSError, ValueError):  # unreadable, or not text
        return None
    return runs[-1] if runs else None


def written_here(manifest: dict[str, Any]) -> bool:
    """Whether this process finished the version of ``manifest`` (a manifest of before this field: no)."""
    return manifest.get("process") == PROCESS_MARK


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _runtime() -> dict[str, int]:
    """Process settings outside every version that still change a stage's floats: torch's CPU thread
    count (`moplex run --threads`; torch's default is the machine's cores). MKL splits a matrix
    product's long sums among the threads, so another count rounds them otherwise, and EM can carry
    that far (docs/reliability.md, "Killed runs"). Empty where torch is not loaded (ingest computes no floats with it)."""
    torch = sys.modules.get("torch")
    return {"torch_threads": torch.get_num_threads()} if torch is not None else {}


def _library_versions() -> dict[str, str]:
    versions = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def arrow_table(data: pa.Table | pd.DataFrame) -> pa.Table:
    """``data`` as written to Parquet. A DataFrame loses its index and the pandas metadata, and its
    text columns are ``string`` (pandas 3 gives ``large_string``), so that the file's bytes and
    types do not depend on the pandas version and match the files written from Arrow schemas."""
    if isinstance(data, pa.Table):
        return data
    table = pa.Table.from_pandas(data, preserve_index=False).replace_schema_metadata(None)
    return table.cast(pa.schema([pa.field(f.name, pa.string() if pa.types.is_large_string(f.type) else f.type,
                                          f.nullable) for f in table.schema]))
