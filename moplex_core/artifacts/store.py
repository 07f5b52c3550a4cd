"""`ArtifactStore`: the versioned stage outputs under one root, found by stage and version prefix."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moplex_core.artifacts.errors import ArtifactError, ArtifactNotFoundError
from moplex_core.artifacts.layout import (
    STAGE_ORDER,
    ArtifactInfo,
    ArtifactRef,
    artifact_version,
    has_manifest,
    is_stage_folder,
    is_version_folder,
    read_checked_manifest,
    read_manifest,
    readable_manifest,
    root_of,
)
from moplex_core.artifacts.writer import ArtifactWriter


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
        """Whether the version is finished, as a stage's plan asks before it writes: False without a
        manifest (never begun, or to resume); `ArtifactCorruptError` where the manifest is there but a
        file it lists (`output_files`) is missing or not its size (a folder half deleted or copied by
        hand), so that a damaged version is refused by name, not handed on as finished."""
        path = self.path(stage, version)
        if not has_manifest(path):
            return False
        read_checked_manifest(path)
        return True

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

    def list(self, stage: str | None = None) -> list[ArtifactInfo]:
        """Every version folder under the root (or one stage), finished or not: stages in the
        pipeline's order (`STAGE_ORDER`, then any other by name), versions by name; other folders (an
        experiment's output, a user's data) are not versions. A finished version whose manifest
        cannot be read is listed unfinished, with manifest None."""
        stage_dirs = [self.root / stage] if stage else sorted(self.root.iterdir(), key=_in_stage_order) \
            if self.root.is_dir() else []
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
        (a version prefix is enough) under this root (`locate`), with any path inside it after
        (``train/8f1d/em``), else a version prefix in an existing stage folder (``ROOT/STAGE/PREFIX``),
        with any path inside it after (``ROOT/train/8f1d/em``)."""
        path = Path(text).expanduser()
        if path.exists():
            return path
        absolute = Path(os.path.abspath(path))  # ../8f1d/em typed in a stage folder: its stage's name, not ".."
        missing = next(head for head in (absolute, *absolute.parents) if head.parent.exists())  # its first part absent
        in_stage_folder = is_stage_folder(missing.parent)  # ROOT/STAGE/PREFIX[/inner]
        spelled_as_path = path.is_absolute() or text.startswith(".")  # /tmp/x, ~/x, ./x: not stage/version
        parts = text.strip("/").split("/")
        if len(parts) >= 2 and not spelled_as_path:
            try:
                return self.locate("/".join(parts[:2])).path.joinpath(*parts[2:])
            except ArtifactNotFoundError:
                a_stage_here = is_stage_folder(self.root / parts[0])  # stage/badprefix/inner: name its versions
                if (len(parts) == 2 and not in_stage_folder) or (len(parts) > 2 and a_stage_here):
                    raise
        if in_stage_folder:
            found = ArtifactStore(root_of(missing)).locate(f"{missing.parent.name}/{missing.name}").path
            return found / absolute.relative_to(missing)
        if len(parts) == 1 and not spelled_as_path and is_stage_folder(self.root / parts[0]):
            return self.root / parts[0]  # a stage's name (ingest, ingest/): its folder under this root
        if len(parts) == 1 and not spelled_as_path and self.root.is_dir():  # a stage misspelled, or not run here
            stages = sorted(s.name for s in self.root.iterdir() if is_stage_folder(s))
            meant = difflib.get_close_matches(parts[0], stages, n=1)
            raise ArtifactNotFoundError(f"{text} is no path here and no stage's folder under {self.root} (its stages: "
                                        f"{', '.join(stages) or 'none'}{f'; did you mean {meant[0]}?' if meant else ''})")
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


def _in_stage_order(folder: Path) -> tuple[int, str]:
    """Sort key of a root's folders: the pipeline's stages in its order, then the rest by name."""
    return (STAGE_ORDER.index(folder.name) if folder.name in STAGE_ORDER else len(STAGE_ORDER), folder.name)


def _some(infos: list[ArtifactInfo], shown: int = 8) -> str:
    """The first ``shown`` refs of a list, and how many more (`moplex inspect ROOT/STAGE` lists all)."""
    if not infos:
        return "none"
    more = f", and {len(infos) - shown} more" if len(infos) > shown else ""
    return ", ".join(str(info.ref) for info in infos[:shown]) + more



def _check_name(name: str, what: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{what} must be a plain, non-hidden directory name, got {name!r}")
