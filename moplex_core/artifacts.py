"""Where an artifact lives, how it is written so a crash never leaves a lie, and how to read it back.

Layout (DESIGN.md 4)::

    <root>/<stage>/<version>/
        part-00000.parquet ...   row shards, numbered from 0
        <any other files>        e.g. rejected.parquet, report.md, em/iter-0001/adapters/c0/...
        manifest.json            written last: its presence is what makes the version complete
    <root>/<stage>/.<version>.lock   held by the one writer of that version

``version`` is a short hash of (stage, the stage's config, the versions of its inputs, a code version
string), so the same inputs and config always land in the same place and a finished stage is skipped.

Every file is written to a hidden temporary name beside its target and renamed into place once
whole, so a visible file is a finished file. A writer that is killed leaves finished shards and
hidden temporaries; the next writer of the same version removes the temporaries, reuses the shards
(after reading their Parquet footers) and carries on. Hidden names (starting with ".") are never
part of an artifact.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock, Timeout

from moplex_core.hashing import canonical_json, sha256_file, short_hash

log = logging.getLogger(__name__)

DEFAULT_ROOT = "data/artifacts"
ALREADY_COMPLETE = ("%s is already complete at %s (the same versioned settings and inputs; settings that do not "
                    "change what is written, such as batch sizes, make no new version); nothing to do")
"""What a stage flow logs for a version it finds complete (its ref and folder)."""
MANIFEST = "manifest.json"
CHECKPOINTS = "em"
"""A version's folder of checkpoints (train's EM iterations): files like any other, listed apart by inspect."""
VERSION_LENGTH = 12
_SHARD_RE = re.compile(r"^part-(\d{5})\.parquet$")
_STARTED = ".started"
_LIBRARIES = ("moplex", "pyarrow", "pandas", "numpy", "torch", "transformers", "peft", "datasets", "prefect")


class ArtifactError(RuntimeError):
    """An artifact is missing, unfinished, or does not match its manifest."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    pass


class ArtifactIncompleteError(ArtifactError):
    pass


class ArtifactCorruptError(ArtifactError):
    pass


class ArtifactStageError(ArtifactError, ValueError):
    """An artifact of another stage than the one asked for (a train artifact given as rankings)."""


class ArtifactStorageError(ArtifactError, OSError):
    """The artifact root cannot take a write: read-only, permission denied, or no space left."""


_STORAGE_PROBLEMS = {
    errno.ENOSPC: "no space is left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "the operation is not permitted",
}
# Only where a writer creates its version folder: inside a write, these are a missing or misplaced
# file of the stage's own, not a problem of where it writes.
_FOLDER_PROBLEMS = {**_STORAGE_PROBLEMS, errno.ENOTDIR: "a part of the path is a file, not a folder",
                    errno.ENOENT: "the folder cannot be created there"}


def _storage_error(err: BaseException | None, path: Path,
                   problems: dict[int, str] = _STORAGE_PROBLEMS) -> ArtifactStorageError | None:
    """A user-facing error for a write that failed because of where it writes, else None (also for
    an error that is already the store's own)."""
    if not isinstance(err, OSError) or isinstance(err, ArtifactError):
        return None
    problem = problems.get(err.errno)
    if problem is None:
        return None
    return ArtifactStorageError(
        f"cannot write {path}: {problem} ({err.strerror}: {err.filename or path}). Nothing was marked "
        "complete, and files already finished stay for a resume. Free space or make the artifact root "
        "writable, or choose another root (moplex --root DIR, or root=DIR in the config)."
    )


def _about(err: BaseException | None, folder: Path) -> bool:
    """Whether an OSError names a file under ``folder``, or names none and is a full or read-only
    device (a write error of pyarrow's, which names no file, is taken to be about the folder)."""
    if not isinstance(err, OSError):
        return False
    named = [f for f in (err.filename, err.filename2) if f is not None and not isinstance(f, int)]
    if not named:
        return err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    try:
        folder = folder.resolve()
        return any(Path(os.fsdecode(f)).resolve().is_relative_to(folder) for f in named)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL: never hide the error itself
        return False


@contextmanager
def _storage_errors(path: Path, problems: dict[int, str] = _STORAGE_PROBLEMS) -> Iterator[None]:
    """Re-raise an OSError of the block as `ArtifactStorageError` when it is about where ``path`` lives."""
    try:
        yield
    except OSError as err:
        storage = _storage_error(err, path, problems)
        if storage is None:
            raise
        raise storage from err


@dataclass(frozen=True)
class ArtifactRef:
    """A stage output, written ``stage/version`` (e.g. ``ingest/3fa2c1d09b7e``)."""

    stage: str
    version: str

    def __str__(self) -> str:
        return f"{self.stage}/{self.version}"

    @classmethod
    def parse(cls, text: str) -> ArtifactRef:
        stage, sep, version = text.strip("/").partition("/")
        if not sep or not stage or not version or "/" in version:
            raise ValueError(f"an artifact reference is 'stage/version', e.g. 'ingest/3fa2c1d09b7e'; got {text!r}")
        return cls(stage, version)


@dataclass(frozen=True)
class ArtifactInfo:
    ref: ArtifactRef
    path: Path
    complete: bool
    manifest: dict[str, Any] | None


def artifact_version(
    stage: str,
    config: Mapping[str, Any],
    inputs: Mapping[str, str | ArtifactRef] | None = None,
    code_version: str = "",
) -> str:
    """The version of a stage output: a hash of everything that determines its content.

    ``config`` is the JSON-able part of the stage config that changes the output (see
    ``moplex_core.config.StageConfig.identity``); ``inputs`` maps input names to artifact references
    or other content fingerprints (e.g. ``"sha256:..."`` of a local source file); ``code_version`` is
    bumped by hand when the stage's code changes what it writes.
    """
    payload = {
        "stage": stage,
        "config": dict(config),
        "inputs": {name: str(ref) for name, ref in (inputs or {}).items()},
        "code_version": code_version,
    }
    return short_hash(canonical_json(payload), length=VERSION_LENGTH)


def shard_name(index: int) -> str:
    if not 0 <= index <= 99_999:
        raise ValueError(f"shard index must be in 0..99999, got {index}")
    return f"part-{index:05d}.parquet"


def is_complete(version_dir: str | Path) -> bool:
    return (Path(version_dir) / MANIFEST).is_file()


def read_manifest(version_dir: str | Path, stages: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifest of a finished artifact; raises if the directory is missing or unfinished, or, when
    ``stages`` names some, written by another stage."""
    version_dir = Path(version_dir)
    if not version_dir.is_dir():
        raise ArtifactNotFoundError(f"no artifact at {version_dir}")
    if not is_complete(version_dir):
        raise ArtifactIncompleteError(
            f"{version_dir} has no {MANIFEST}: its stage did not finish. Rerun the stage with the same "
            "config; it resumes from the shards already written."
        )
    try:
        manifest = json.loads((version_dir / MANIFEST).read_text())
    except ValueError as err:  # not JSON, or not UTF-8: damaged after it was written
        raise ArtifactCorruptError(f"{version_dir / MANIFEST} cannot be read ({err}): the artifact was damaged after "
                                   "it was written; delete the version folder and rerun its stage") from None
    if not isinstance(manifest, dict):
        raise ArtifactCorruptError(f"{version_dir / MANIFEST} holds no manifest (a JSON {type(manifest).__name__}): "
                                   "delete the version folder and rerun its stage")
    if stages and manifest.get("stage") not in stages:
        wanted = " or ".join(f"{stage}/<version>" for stage in stages)
        raise ArtifactStageError(f"{version_dir} was written by the {manifest.get('stage')!r} stage; give {wanted}")
    return manifest


def readable_manifest(version_dir: Path) -> dict[str, Any] | None:
    """The manifest of a finished version, or None when there is none or it cannot be read."""
    try:
        manifest = read_manifest(version_dir)
    except (ArtifactError, OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "files" in manifest else None


def is_version_folder(path: str | Path) -> bool:
    """Whether ``path`` is a version folder written by moplex, finished or under way (a data folder
    of the user's may hold a ``manifest.json`` of its own: only moplex's names a stage). A
    ``manifest.json`` that cannot be read or parsed counts as moplex's, damaged: never as data."""
    path = Path(path)
    if (path / _STARTED).is_file():
        return True
    if not (path / MANIFEST).is_file():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return True
    return isinstance(manifest, dict) and {"stage", "version", "code_version"} <= manifest.keys()


def is_stage_folder(path: str | Path) -> bool:
    """Whether ``path`` is a stage's folder: it holds a version folder, finished or under way."""
    path = Path(path)
    return path.is_dir() and any(is_version_folder(p) for p in path.iterdir() if p.is_dir())


def shard_paths(version_dir: str | Path) -> list[Path]:
    """The visible row shards of a version directory, in shard order (finished or not)."""
    version_dir = Path(version_dir)
    return sorted(p for p in version_dir.iterdir() if _SHARD_RE.match(p.name)) if version_dir.is_dir() else []


def load_table(version_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All shards of a finished artifact as one Arrow table, rows in shard order."""
    return pa.concat_tables(pq.read_table(path, columns=columns) for path in finished_shards(version_dir))


def finished_shards(version_dir: str | Path) -> list[Path]:
    """The row shards a finished artifact's manifest lists, in shard order, each checked to be there at
    the size the manifest records (`ArtifactCorruptError` otherwise; `ArtifactError` when it has none)."""
    version_dir = Path(version_dir)
    manifest = read_manifest(version_dir)
    names = sorted(name for name in manifest["files"] if _SHARD_RE.match(name))
    if not names:
        raise ArtifactError(f"{version_dir} holds no part-*.parquet shards; its stage writes other files only")
    check_files(version_dir, manifest, names)
    return [version_dir / name for name in names]


def check_files(version_dir: str | Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Raise `ArtifactCorruptError` when a file the manifest lists (or one of ``names``) is missing or
    not the size it records (`off_the_manifest`)."""
    changed = off_the_manifest(version_dir, manifest, names)
    if changed:
        raise ArtifactCorruptError(f"{version_dir}: {', '.join(changed)} missing or not the size its manifest "
                                   "records (an interrupted copy?). Delete the version directory and rerun its stage.")


def off_the_manifest(version_dir: str | Path, manifest: dict[str, Any], names: list[str] | None = None) -> list[str]:
    """The files the manifest lists (or those of ``names``) that are missing or not the size it
    records: a check without reading them (`verify` hashes every file)."""
    version_dir = Path(version_dir)
    return [name for name in (sorted(manifest["files"]) if names is None else names)
            if not (version_dir / name).is_file()
            or (version_dir / name).stat().st_size != manifest["files"][name]["bytes"]]


def verify(version_dir: str | Path) -> None:
    """Recompute the sha256 of every file and compare with the manifest; raise listing every mismatch."""
    version_dir = Path(version_dir)
    recorded = read_manifest(version_dir)["files"]
    problems = []
    for name, entry in sorted(recorded.items()):
        path = version_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{name} changed since the manifest was written")
    problems += [f"{name} is not in the manifest" for name in _visible_files(version_dir) if name not in recorded]
    if problems:
        raise ArtifactCorruptError(
            f"{version_dir} does not match its manifest: " + "; ".join(problems)
            + ". Delete the version directory and rerun its stage."
        )


class ArtifactStore:
    """Versioned stage outputs under one root directory (default ``data/artifacts``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def version(
        self,
        stage: str,
        config: Mapping[str, Any],
        inputs: Mapping[str, str | ArtifactRef] | None = None,
        code_version: str = "",
    ) -> str:
        return artifact_version(stage, config, inputs, code_version)

    def path(self, stage: str, version: str) -> Path:
        _check_name(stage, "stage")
        _check_name(version, "version")
        return self.root / stage / version

    def is_complete(self, stage: str, version: str) -> bool:
        return is_complete(self.path(stage, version))

    def manifest(self, stage: str, version: str) -> dict[str, Any]:
        return read_manifest(self.path(stage, version))

    def writer(
        self,
        stage: str,
        version: str,
        *,
        config: Mapping[str, Any],
        inputs: Mapping[str, str | ArtifactRef] | None = None,
        code_version: str = "",
        lock_timeout: float | None = None,
    ) -> ArtifactWriter:
        """A context manager that owns the version while open (see `ArtifactWriter`).

        ``config`` is recorded in the manifest as given (pass the full config, paths included, for
        provenance); the version itself is whatever the caller computed with `version`.
        """
        return ArtifactWriter(self.path(stage, version), ArtifactRef(stage, version), dict(config),
                              {k: str(v) for k, v in (inputs or {}).items()}, code_version, lock_timeout)

    def load_table(self, stage: str, version: str, columns: list[str] | None = None) -> pa.Table:
        return load_table(self.path(stage, version), columns)

    def load(self, stage: str, version: str, columns: list[str] | None = None) -> pd.DataFrame:
        return self.load_table(stage, version, columns).to_pandas()

    def verify(self, stage: str, version: str) -> None:
        verify(self.path(stage, version))

    def fingerprint(self, stage: str, version: str) -> str:
        """A hash of the finished artifact's file contents (for cache keys that must notice a rewrite)."""
        return short_hash(canonical_json(self.manifest(stage, version)["files"]))

    def list(self, stage: str | None = None) -> list[ArtifactInfo]:
        """Every version folder under the root (or one stage), finished or not, sorted by name; other
        folders (an experiment's output, a user's data) are not versions. A finished version whose
        manifest cannot be read is listed unfinished, with manifest None."""
        stage_dirs = [self.root / stage] if stage else sorted(self.root.iterdir()) if self.root.is_dir() else []
        infos = []
        for stage_dir in stage_dirs:
            if not stage_dir.is_dir() or stage_dir.name.startswith("."):
                continue
            for version_dir in sorted(stage_dir.iterdir()):
                if version_dir.is_dir() and not version_dir.name.startswith(".") and is_version_folder(version_dir):
                    manifest = readable_manifest(version_dir)
                    infos.append(ArtifactInfo(ArtifactRef(stage_dir.name, version_dir.name), version_dir,
                                              manifest is not None, manifest))
        return infos

    def resolve(self, text: str) -> Path:
        """What a user typed for an artifact: an existing path as it is, else ``stage/version``
        (a version prefix is enough) under this root (`locate`), else a version prefix in an
        existing stage folder (``ROOT/STAGE/PREFIX``)."""
        path = Path(text).expanduser()
        if path.exists():
            return path
        in_stage_folder = len(path.parts) >= 2 and is_stage_folder(path.parent)
        spelled_as_path = path.is_absolute() or text.startswith(".")  # /tmp/x, ~/x, ./x: not stage/version
        if text.strip("/").count("/") == 1 and not spelled_as_path:
            try:
                return self.locate(text).path
            except ArtifactNotFoundError:
                if not in_stage_folder:
                    raise
        if in_stage_folder:
            return ArtifactStore(path.parent.parent).locate(f"{path.parent.name}/{path.name}").path
        return path

    def locate(self, ref: str | ArtifactRef) -> ArtifactInfo:
        """Find ``stage/version``, where version may be any unambiguous prefix (as with git)."""
        ref = ArtifactRef.parse(ref) if isinstance(ref, str) else ref
        candidates = self.list(ref.stage)
        matches = [info for info in candidates if info.ref.version.startswith(ref.version)]
        matches = [info for info in matches if info.ref.version == ref.version] or matches  # exact beats prefix
        if len(matches) == 1:
            return matches[0]
        if not matches:
            if not self.root.is_dir():
                raise ArtifactNotFoundError(f"no artifact {ref} under {self.missing_root()}")
            stages = sorted(s.name for s in self.root.iterdir() if is_stage_folder(s))
            found = (f"versions of {ref.stage}: {_some(candidates)}" if (self.root / ref.stage).is_dir()
                     else f"no stage {ref.stage!r} there; its stages: {', '.join(stages) or 'none'}")
            raise ArtifactNotFoundError(f"no artifact {ref} under {self.root} ({found})")
        raise ArtifactError(f"{ref} is ambiguous under {self.root}: it matches {_some(matches)}; give more of the "
                            "version")


    def missing_root(self) -> str:
        """The root named for a user whose root is not a folder, with what to do."""
        return (f"{self.root.resolve()}, which {'is a file' if self.root.exists() else 'does not exist'} (run from the "
                "folder the artifacts are under, or give --root; `make demo` writes data/artifacts)")


def _some(infos: list[ArtifactInfo], shown: int = 8) -> str:
    """The first ``shown`` refs of a list, and how many more (`moplex inspect ROOT/STAGE` lists all)."""
    if not infos:
        return "none"
    more = f", and {len(infos) - shown} more" if len(infos) > shown else ""
    return ", ".join(str(info.ref) for info in infos[:shown]) + more


class ArtifactWriter:
    """Writes one version of a stage output; commit (the manifest) happens on a clean exit.

    Use as ``with store.writer(stage, version, config=...) as w:``. Entering takes the version's lock
    (a second writer waits), then:

    - ``w.complete`` is True when the version was already finished (another run completed it while
      this one waited): the body should do nothing, and nothing is written or rewritten;
    - otherwise files left by an interrupted run are kept (``w.reused`` names them) and hidden
      temporaries are deleted; ``has_shard``/``has_file`` tell the body what it may skip.

    On a clean exit the manifest is written: config, inputs, rows (sum over shards), the sha256 of
    every file, start and finish times, library versions, ``w.summary`` (stage-specific numbers),
    and ``runs``: the start time, config and library versions of every run that worked on the
    version, failed attempts included (the top-level config is the last run's).
    On an exception nothing is committed and finished files stay for the next run.
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
            with _storage_errors(self.path, _FOLDER_PROBLEMS):
                self._enter()
        except OSError:
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
        self.complete = is_complete(self.path)
        if self.complete:
            log.info("%s %s; nothing to do", self.ref,
                     "was completed by another run while this one waited" if waited else "is already complete")
        else:
            self.path.mkdir(exist_ok=True)
            _remove_temporaries(self.path)
            self.reused = _visible_files(self.path)
            if self.reused:
                log.info("%s resumes an interrupted run; reusing %d finished file(s)", self.ref, len(self.reused))
            marker = self.path / _STARTED
            run = {"started": _now(), "config": self._config, "library_versions": _library_versions()}
            # Where a model lies is left out: its files are the version's input, so they are the same.
            changes = sorted({change for earlier in _runs(marker) for change in run_changes(earlier, run, ("model",))})
            if self.reused and changes:
                log.warning("%s resumes from files that earlier runs wrote with %s: settings outside the version "
                            "(how, not what), but a float they hold can differ from this run's in its last digits "
                            "(a sampled token of augment's can flip); `moplex inspect` lists every run",
                            self.ref, "; ".join(changes))
            ended = not marker.exists() or marker.read_bytes().endswith(b"\n")  # an older moplex's has no newline
            with open(marker, "a") as started:  # one line per run of this version
                started.write(("" if ended else "\n") + json.dumps(run, sort_keys=True, default=str) + "\n")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        try:
            if exc_type is None and not self.complete:
                self._commit()
                self.complete = True
        finally:
            self._lock.release()
        # A full or read-only root met by code writing its own files in the block (e.g. PEFT's
        # save_pretrained) gets the same sentence as the store's own writes; an error naming another
        # place (an unreadable model file or input artifact) stays as it is. A full device that names
        # no file is taken to be the root's.
        storage = _storage_error(exc, self.path) if _about(exc, self.path) else None
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

    def has_file(self, name: str) -> bool:
        return (self.path / _check_relative(name)).exists()

    def write_shard(self, index: int, data: pa.Table | pd.DataFrame) -> Path:
        table = data if isinstance(data, pa.Table) else pa.Table.from_pandas(data, preserve_index=False)
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
        table = data if isinstance(data, pa.Table) else pa.Table.from_pandas(data, preserve_index=False)
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
        target = self.path / _check_relative(name)
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
        target = self.path / _check_relative(name)
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
        indices = [int(_SHARD_RE.match(p.name).group(1)) for p in shards]
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            raise ArtifactError(
                f"{self.ref} has shards {indices} with gaps at {missing}; shards must be numbered 0..n-1. "
                "Write the missing shards before leaving the writer block."
            )
        files = {
            name: {"sha256": sha256_file(self.path / name), "bytes": (self.path / name).stat().st_size}
            for name in _visible_files(self.path)
        }
        _sync_tree(self.path, files)  # what other code wrote into the block (PEFT, EM) reaches the disk first
        started = self.path / _STARTED
        runs = _runs(started) or [{"started": _now()}]
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
            "runs": runs,
            "library_versions": _library_versions(),
        }
        with atomic_path(self.path / MANIFEST) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        started.unlink(missing_ok=True)


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A hidden temporary path beside ``target``, renamed onto it (durably) when the block ends."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with _storage_errors(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
    finally:
        with suppress(OSError):  # an unwritable folder must not hide the error above
            tmp.unlink(missing_ok=True)


def _visible_files(version_dir: Path) -> list[str]:
    """Relative POSIX names of every non-hidden file below ``version_dir`` except the manifest."""
    names = []
    for path in version_dir.rglob("*"):
        rel = path.relative_to(version_dir)
        if path.is_file() and rel.as_posix() != MANIFEST and not any(p.startswith(".") for p in rel.parts):
            names.append(rel.as_posix())
    return sorted(names)


def _remove_temporaries(version_dir: Path) -> None:
    # Hidden entries are temporaries of killed writers (ours and e.g. em.py's ".name.tmp-pid").
    for path in sorted(version_dir.rglob(".*"), reverse=True):
        if ".tmp-" in path.name:
            log.info("removing %s left by an interrupted writer", path)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def _check_name(name: str, what: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{what} must be a plain, non-hidden directory name, got {name!r}")


def _check_relative(name: str) -> str:
    rel = PurePosixPath(name)
    if rel.is_absolute() or not rel.parts or any(p in ("", ".", "..") or p.startswith(".") for p in rel.parts):
        raise ValueError(f"artifact file names are relative paths without hidden or '..' parts, got {name!r}")
    if rel.as_posix() == MANIFEST:
        raise ValueError(f"{MANIFEST} is written by the store itself")
    return rel.as_posix()


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
    ``key value (last: value)`` per config value (but those in ``ignore``) or library version."""
    return [f"{key} {json.dumps(value, default=str)} (last: {json.dumps((later.get(field) or {}).get(key), default=str)})"
            for field in ("config", "library_versions") for key, value in sorted((earlier.get(field) or {}).items())
            if value != (later.get(field) or {}).get(key) and not (field == "config" and key in ignore)]


def _runs(started: Path) -> list[dict[str, Any]]:
    """The runs that wrote a version, first first, from its start marker: each run's start time,
    config and library versions (a marker of an older moplex holds a bare start time)."""
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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _library_versions() -> dict[str, str]:
    versions = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
