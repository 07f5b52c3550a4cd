"""The store's errors, and the write errors that are about where it writes (a full disk, a
read-only root), told apart from the stage's own."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
FOLDER_PROBLEMS = {**_STORAGE_PROBLEMS, errno.ENOTDIR: "a part of the path is a file, not a folder",
                    errno.ENOENT: "the folder cannot be created there"}


def storage_error(err: BaseException | None, path: Path,
                   problems: dict[int, str] = _STORAGE_PROBLEMS) -> ArtifactStorageError | None:
    """A user-facing error for a write that failed because of where it writes, else None (also for
    an error that is already the store's own)."""
    if not isinstance(err, OSError) or isinstance(err, ArtifactError):
        return None
    problem = problems.get(err.errno)
    if problem is None:
        return None
    fix = ("Move what is in the way" if err.errno in (errno.ENOTDIR, errno.ENOENT)
           else "Free space or make the artifact root writable")
    return ArtifactStorageError(
        f"cannot write {path}: {problem} ({err.strerror}: {err.filename or path}). Nothing was marked "
        f"complete, and files already finished stay for a resume. {fix}, or choose another root (moplex "
        "--root DIR, or root=DIR in the config)."
    )


def about_the_folder(err: BaseException | None, folder: Path) -> bool:
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
def storage_errors(path: Path, problems: dict[int, str] = _STORAGE_PROBLEMS) -> Iterator[None]:
    """Re-raise an OSError of the block as `ArtifactStorageError` when it is about where ``path`` lives."""
    try:
        yield
    except OSError as err:
        storage = storage_error(err, path, problems)
        if storage is None:
            raise
        raise storage from err
