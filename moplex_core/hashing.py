"""Stable identities: canonical JSON, short content hashes and file digests.

Artifact versions, example ids and prompt ids are all hashes; they must not change with dict order,
float formatting or the machine, so everything hashed goes through `canonical_json` or raw UTF-8.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

_CHUNK = 1 << 20
_MODEL_FILES: dict[tuple, dict[str, str]] = {}  # (folder, every file's name, size, mtime_ns, inode) -> digests


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; NaN and infinity are refused (they have no JSON)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def short_hash(*parts: str, length: int = 16) -> str:
    """Hex sha256 prefix of the parts joined by a unit separator (so ("ab", "c") != ("a", "bc"))."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:length]


def seed_from(text: str, byteorder: Literal["little", "big"] = "little") -> int:
    """A 64-bit integer from the sha256 of ``text`` (its first 8 bytes in ``byteorder``): a seed that
    a name or an id gives the same on every machine and in every process (Python's hash() does not)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], byteorder)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(model: str) -> str:
    """``sha256:<hash>`` of a local model directory's files (`model_files`: relative names and
    bytes), so that a retrained model gets a new version and a moved one keeps it.

    A hub name is ``hub:<name>@<commit>``, the commit of the local Hugging Face cache's snapshot it
    loads from, so a model updated on the hub and downloaded again is another model; a hub name that
    is not in the local cache yet is ``hub:<name>``, unpinned (it is downloaded as it loads)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from moplex_core.lm.loading import hub_snapshot  # torch and transformers: only for hub names

        snapshot = hub_snapshot(model)
        return f"hub:{model}@{snapshot.name}" if snapshot is not None else f"hub:{model}"
    return files_fingerprint(model_files(path))


def files_fingerprint(files: dict[str, str]) -> str:
    """The ``sha256:`` fingerprint of a listing of files (relative name -> hex sha256, in path order:
    `model_files`, a dataset's `data.sources.source_fingerprint`)."""
    return "sha256:" + short_hash(canonical_json([[name, digest] for name, digest in files.items()]), length=64)


def model_files(folder: str | Path) -> dict[str, str]:
    """Relative name (posix) -> hex sha256 of every file of a local model folder, in path order.
    Hidden files (temporaries) do not count. Within one process a folder whose files have kept their
    names, sizes, modification times and inodes is not read again (a comparison's many train and
    evaluate stages check one multi-GB model)."""
    path = Path(folder).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    stats = [(f.relative_to(path).as_posix(), f.stat()) for f in files]
    key = (str(path.resolve()), tuple((name, s.st_size, s.st_mtime_ns, s.st_ino) for name, s in stats))
    if key not in _MODEL_FILES:
        _MODEL_FILES[key] = {name: sha256_file(path / name) for name, _ in stats}
    return dict(_MODEL_FILES[key])


def files_changed(before: dict[str, str], now: dict[str, str]) -> str:
    """What differs between two `model_files` listings, in words: "README.md added; model.safetensors
    changed" (at most five names of each kind)."""
    kinds = [("added", sorted(now.keys() - before.keys())), ("removed", sorted(before.keys() - now.keys())),
             ("changed", sorted(n for n in before.keys() & now.keys() if before[n] != now[n]))]
    return "; ".join(f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''} {kind}" for kind, names in kinds if names)
