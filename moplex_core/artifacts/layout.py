"""What a version folder holds and how it is read back: names, versions, manifests, shards, and
the checks that a finished artifact is whole."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moplex_core.artifacts.errors import (
    ArtifactCorruptError,
    ArtifactError,
    ArtifactIncompleteError,
    ArtifactNotFoundError,
    ArtifactStageError,
)
from moplex_core.hashing import canonical_json, sha256_file, short_hash

DEFAULT_ROOT = "data/artifacts"
STAGE_ORDER = ("ingest", "model", "augment", "cache", "train", "evaluate", "assign", "compare")
"""The stage folders of a root in the pipeline's order, each the ``STAGE`` of its module, as listed."""
ALREADY_COMPLETE = ("%s is already complete at %s (the same versioned settings and inputs; settings that do not "
                    "change what is written, such as batch sizes, make no new version); nothing to do")
"""What a stage flow logs for a version it finds complete (its ref and folder)."""
MANIFEST = "manifest.json"
CHECKPOINTS = "em"
"""A version's folder of checkpoints (train's EM iterations): files like any other, listed apart by inspect."""
VERSION_LENGTH = 12
VERSION_NAME = re.compile(f"[0-9a-f]{{{VERSION_LENGTH}}}")
"""The name `artifact_version` gives a version folder (a folder of another name in a stage's folder is the
user's, a model kept in ROOT/model/)."""
SHARD_RE = re.compile(r"^part-(\d{5})\.parquet$")
STARTED = ".started"


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


def has_manifest(version_dir: str | Path) -> bool:
    """Whether the version folder holds its manifest, which a writer writes last (the files it lists
    are not checked here: `ArtifactStore.is_complete` checks them)."""
    return (Path(version_dir) / MANIFEST).is_file()


def read_manifest(version_dir: str | Path, stages: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifest of a finished artifact; raises if the directory is missing or unfinished, or, when
    ``stages`` names some, written by another stage."""
    version_dir = Path(version_dir)
    if not version_dir.is_dir():
        raise ArtifactNotFoundError(f"no artifact at {version_dir}{_prefix_hint(version_dir)}")
    if not has_manifest(version_dir) and is_stage_folder(version_dir):  # not an unfinished version: say so
        versions = sorted(p.name for p in version_dir.iterdir() if p.is_dir() and is_version_folder(p))
        raise ArtifactNotFoundError(f"{version_dir} is a stage's folder, not a version folder: give one of its "
                                    f"versions ({', '.join(versions[:8])}{', ...' if len(versions) > 8 else ''})")
    if not has_manifest(version_dir) and not (version_dir / STARTED).is_file():  # no run ever began here
        stages = sorted(p.name for p in version_dir.iterdir() if is_stage_folder(p))
        if stages:
            raise ArtifactNotFoundError(f"{version_dir} is an artifact root, not a version folder: give one of its "
                                        f"versions, STAGE/VERSION under it (its stages: {', '.join(stages)}; `moplex "
                                        f"inspect {version_dir}` lists the versions)")
        named_so = version_dir.parent.name in STAGE_ORDER and VERSION_NAME.fullmatch(version_dir.name) is not None
        if named_so or shard_paths(version_dir) or is_stage_folder(version_dir.parent):  # a version's folder
            raise ArtifactIncompleteError(f"{version_dir} holds neither {MANIFEST} nor a run's start marker: a version "
                                          "deleted or copied in part; delete it and rerun its stage")
        raise ArtifactNotFoundError(f"{version_dir} is not a moplex artifact (no {MANIFEST}): give a version folder, "
                                    "ROOT/STAGE/VERSION, or STAGE/VERSION under the root; a folder of data files is "
                                    "read by `moplex ingest --dataset generic --path FOLDER` first")
    if not has_manifest(version_dir):
        raise ArtifactIncompleteError(
            f"{version_dir} has no {MANIFEST}: its stage did not finish. Rerun the stage with the same "
            f"config; it resumes from what it finished ({'EM iterations' if version_dir.parent.name == 'train' else 'shards'}"
            f"; `moplex inspect {version_dir}` shows the run's settings)."
        )
    try:
        manifest = json.loads((version_dir / MANIFEST).read_text())
    except ValueError as err:  # not JSON, or not UTF-8: damaged after it was written
        raise ArtifactCorruptError(f"{version_dir / MANIFEST} cannot be read ({err}): the artifact was damaged after "
                                   "it was written; delete the version folder and rerun its stage") from None
    if not isinstance(manifest, dict):
        raise ArtifactCorruptError(f"{version_dir / MANIFEST} holds no manifest (a JSON {type(manifest).__name__}): "
                                   "delete the version folder and rerun its stage")
    problem = _manifest_problem(manifest, version_dir)
    if problem:  # an edited manifest, or one copied into another version's folder
        raise ArtifactCorruptError(f"{version_dir / MANIFEST} {problem}: delete the version folder and rerun its stage")
    if stages and manifest.get("stage") not in stages:
        wanted = " or ".join(f"{stage}/<version>" for stage in stages)
        raise ArtifactStageError(f"{version_dir} was written by the {manifest.get('stage')!r} stage; give {wanted}")
    return manifest


def _manifest_problem(manifest: dict[str, Any], version_dir: Path) -> str | None:
    """What makes a finished version's manifest one no stage may trust, or None: another version's
    (its stage and version are not the folder's), a file list that is not name -> sha256 and bytes, a
    file outside the version folder (nothing there is checked, hashed or read), or row shards that are
    not part-00000 .. of the count it records (one dropped from the list would go unread)."""
    stage, version = manifest.get("stage"), manifest.get("version")
    if (stage, version) != (version_dir.parent.name, version_dir.name) and {"stage", "version"} <= manifest.keys():
        return f"is the manifest of {stage}/{version}, not of this folder's {version_dir.parent.name}/{version_dir.name}"
    files = manifest.get("files")
    if files is None:  # moplex's lists them; a user's own manifest.json (`is_version_folder`) is not checked here
        return "lists no files" if {"stage", "version", "code_version"} <= manifest.keys() else None
    if not isinstance(files, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
            for entry in files.values()):
        return "lists its files in another form than name -> {sha256, bytes}"
    outside = [name for name in files if not _is_own_file_name(name)]
    if outside:
        return f"lists files outside its version folder ({', '.join(map(repr, outside[:3]))})"
    shards = sorted(name for name in files if SHARD_RE.match(name))
    if isinstance(manifest.get("shards"), int) and shards != [shard_name(i) for i in range(manifest["shards"])]:
        return f"lists {len(shards)} row shard(s) where it records {manifest['shards']} (part-00000 on)"
    return None


def _prefix_hint(path: Path) -> str:
    """For a missing ``ROOT/STAGE/PREFIX``: the versions whose names start with PREFIX (a Python caller
    of `load_table` or `read_manifest` gives the full name; `ArtifactStore.locate` takes a prefix)."""
    if not path.name or not is_stage_folder(path.parent):
        return ""
    matches = sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name) and is_version_folder(p))
    return (f" (a version folder takes its full name: {', '.join(matches[:8])}; ArtifactStore(ROOT).locate("
            f"'{path.parent.name}/{path.name}') finds one by prefix)" if matches else "")


def own_file_name(name: str) -> str:
    """``name`` as a file of a version folder: a relative POSIX path without hidden or '..' parts,
    and not the manifest itself; ValueError otherwise (a name that would leave the folder)."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or not rel.parts or any(p in ("", ".", "..") or p.startswith(".") for p in rel.parts):
        raise ValueError(f"artifact file names are relative paths without hidden or '..' parts, got {name!r}")
    if rel.as_posix() == MANIFEST:
        raise ValueError(f"{MANIFEST} is written by the store itself")
    return rel.as_posix()


def readable_manifest(version_dir: Path) -> dict[str, Any] | None:
    """The manifest of a finished version, or None when there is none or it cannot be read."""
    try:
        manifest = read_manifest(version_dir)
    except (ArtifactError, OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "files" in manifest else None


def _is_own_file_name(name: str) -> bool:
    try:
        own_file_name(name)
    except ValueError:
        return False
    return True


def root_of(version_dir: str | Path) -> Path:
    """The artifact root that holds a version folder, ``ROOT`` of ``ROOT/STAGE/VERSION`` (as given:
    resolve the path first where a relative or moved one must not matter)."""
    return Path(version_dir).parents[1]


def default_root(artifact: str | Path) -> str:
    """Where a command's new artifacts go when no root is given: the root of its input ``artifact`` when
    that is a version folder (``ROOT/STAGE/VERSION``, as typed: relative, with ``~``), so that they
    join the root their input is in, else DEFAULT_ROOT."""
    path = Path(artifact).expanduser().resolve()
    return str(root_of(path)) if is_version_folder(path) else DEFAULT_ROOT


def is_version_folder(path: str | Path) -> bool:
    """Whether ``path`` is a version folder written by moplex, finished or under way (a data folder
    of the user's may hold a ``manifest.json`` of its own: only moplex's names a stage). A
    ``manifest.json`` that cannot be read or parsed counts as moplex's, damaged: never as data."""
    path = Path(path)
    if (path / STARTED).is_file():
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
    return sorted(p for p in version_dir.iterdir() if SHARD_RE.match(p.name)) if version_dir.is_dir() else []


def load_table(version_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All shards of a finished artifact as one Arrow table, rows in shard order."""
    return pa.concat_tables(pq.read_table(path, columns=columns) for path in finished_shards(version_dir))


def finished_shards(version_dir: str | Path) -> list[Path]:
    """The row shards a finished artifact's manifest lists, in shard order, each checked to be there with
    the size and sha256 the manifest records (`ArtifactCorruptError` otherwise; `ArtifactError` when it
    has none): a byte changed in a shard would otherwise be read as data, or fail later naming no file."""
    version_dir = Path(version_dir)
    manifest = read_manifest(version_dir)
    names = sorted(name for name in manifest["files"] if SHARD_RE.match(name))
    if not names:
        tables = sorted(name for name in manifest["files"] if "/" not in name and name.endswith(".parquet"))
        raise ArtifactError(f"{version_dir} holds no part-*.parquet shards; its stage writes other files only"
                            + (f" (read {', '.join(tables)} with pd.read_parquet)" if tables else ""))
    check_files(version_dir, manifest, names, hashes=True)
    return [version_dir / name for name in names]


def check_files(version_dir: str | Path, manifest: dict[str, Any], names: list[str] | None = None, *,
                hashes: bool = False) -> None:
    """Raise `ArtifactCorruptError` when a file the manifest lists (or one of ``names``) is missing or
    not the size it records, or with ``hashes`` not its sha256 (`off_the_manifest`)."""
    changed = off_the_manifest(version_dir, manifest, names, hashes=hashes)
    if changed:
        named = ", ".join(changed[:_FILES_NAMED]) + (f" and {len(changed) - _FILES_NAMED} more"
                                                    if len(changed) > _FILES_NAMED else "")
        raise ArtifactCorruptError(f"{version_dir}: {named} missing or not the size{' or sha256' if hashes else ''} "
                                   "its manifest records (an interrupted copy, a damaged disk, or changed or deleted "
                                   "by hand?). Delete the version directory and rerun its stage.")


_FILES_NAMED = 8  # a model folder or a version of hundreds of shards deleted: the first few, and a count


def output_files(manifest: dict[str, Any]) -> list[str]:
    """The files of a finished version that its stage finding it complete, or a later stage, reads:
    every file its manifest lists but those under `CHECKPOINTS` (a train version's EM iterations, most
    of its size), a record of how it was made that nothing reads once it is finished, which may be
    deleted to free space."""
    return sorted(name for name in manifest["files"] if not name.startswith(f"{CHECKPOINTS}/"))


def read_checked_manifest(version_dir: str | Path) -> dict[str, Any]:
    """The manifest of a finished version whose `output_files` are all there at the sizes it records
    (else `ArtifactCorruptError` naming them): what a stage that finds it complete, or reads it, relies on."""
    manifest = read_manifest(version_dir)
    check_files(version_dir, manifest, output_files(manifest))
    return manifest


_HASHED: set[tuple[str, int, int, str]] = set()
"""(file, size, mtime in ns, sha256) of the files found to match their manifest's sha256 in this process."""


def off_the_manifest(version_dir: str | Path, manifest: dict[str, Any], names: list[str] | None = None, *,
                     hashes: bool = False) -> list[str]:
    """The files the manifest lists (or those of ``names``) that are missing or not the size it
    records: a check without reading them; with ``hashes`` also those of another sha256 (a file read
    once per process while its size and mtime stay: a stage that loads columns of one artifact several
    times hashes it once)."""
    version_dir = Path(version_dir)

    def off(name: str) -> bool:
        path, entry = version_dir / name, manifest["files"][name]
        if not path.is_file() or (stat := path.stat()).st_size != entry["bytes"]:
            return True
        if not hashes:
            return False
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, entry["sha256"])
        if key not in _HASHED and sha256_file(path) == entry["sha256"]:
            _HASHED.add(key)
        return key not in _HASHED

    return [name for name in (sorted(manifest["files"]) if names is None else names) if off(name)]


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
    problems += [f"{name} is not in the manifest" for name in visible_files(version_dir) if name not in recorded]
    if problems:
        raise ArtifactCorruptError(
            f"{version_dir} does not match its manifest: " + "; ".join(problems)
            + ". Delete the version directory and rerun its stage."
        )


def visible_files(version_dir: Path) -> list[str]:
    """Relative POSIX names of every non-hidden file below ``version_dir`` except the manifest."""
    names = []
    for path in version_dir.rglob("*"):
        rel = path.relative_to(version_dir)
        if path.is_file() and rel.as_posix() != MANIFEST and not any(p.startswith(".") for p in rel.parts):
            names.append(rel.as_posix())
    return sorted(names)
