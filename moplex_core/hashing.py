"""Stable identities: canonical JSON, short content hashes and file digests.

Artifact versions, example ids and prompt ids are all hashes; they must not change with dict order,
float formatting or the machine, so everything hashed goes through `canonical_json` or raw UTF-8.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; NaN and infinity are refused (they have no JSON)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def short_hash(*parts: str, length: int = 16) -> str:
    """Hex sha256 prefix of the parts joined by a unit separator (so ("ab", "c") != ("a", "bc"))."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:length]


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
