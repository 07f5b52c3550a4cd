"""Where an artifact lives, how it is written so a crash never leaves a lie, and how to read it back.

Layout (DESIGN.md 4)::

    <root>/<stage>/<version>/
        part-00000.parquet ...   row shards, numbered from 0
        <any other files>        e.g. rejected.parquet, report.md, em/restart-00/iter-0001/...
        manifest.json            written last: its presence is what makes the version complete
    <root>/<stage>/.<version>.lock   held by the one writer of that version

``version`` is a short hash of (stage, the stage's config, the versions of its inputs, a code version
string), so the same inputs and config always land in the same place and a finished stage is skipped.

Every file is written to a hidden temporary name beside its target and renamed into place once
whole, so a visible file is a finished file. A writer that is killed leaves finished shards and
hidden temporaries; the next writer of the same version removes the temporaries, reuses the shards
(after reading their Parquet footers) and carries on. Hidden names (starting with ".") are never
part of an artifact.

`layout` holds what a version folder is and how it is read back, `writer` how it is written,
`store` the versions under one root, `errors` the errors; every name other modules use is importable
from here.
"""

from moplex_core.artifacts.errors import (
    ArtifactCorruptError,
    ArtifactError,
    ArtifactIncompleteError,
    ArtifactNotFoundError,
    ArtifactStageError,
    ArtifactStorageError,
)
from moplex_core.artifacts.layout import (
    ALREADY_COMPLETE,
    CHECKPOINTS,
    DEFAULT_ROOT,
    MANIFEST,
    VERSION_LENGTH,
    ArtifactInfo,
    ArtifactRef,
    artifact_version,
    check_files,
    default_root,
    finished_shards,
    has_manifest,
    is_stage_folder,
    is_version_folder,
    load_table,
    off_the_manifest,
    output_files,
    read_checked_manifest,
    read_manifest,
    readable_manifest,
    root_of,
    shard_name,
    shard_paths,
    verify,
)
from moplex_core.artifacts.store import ArtifactStore
from moplex_core.artifacts.writer import ArtifactWriter, atomic_path, run_changes, written_here

__all__ = [
    "ALREADY_COMPLETE", "CHECKPOINTS", "DEFAULT_ROOT", "MANIFEST", "VERSION_LENGTH", "ArtifactCorruptError",
    "ArtifactError", "ArtifactIncompleteError", "ArtifactInfo", "ArtifactNotFoundError", "ArtifactRef",
    "ArtifactStageError", "ArtifactStorageError", "ArtifactStore", "ArtifactWriter", "artifact_version", "check_files",
    "default_root", "finished_shards", "has_manifest", "is_stage_folder", "is_version_folder", "load_table",
    "off_the_manifest", "output_files", "read_checked_manifest", "read_manifest", "readable_manifest", "root_of",
    "run_changes", "shard_name", "shard_paths", "verify", "atomic_path", "written_here",
]
