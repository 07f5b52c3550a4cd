"""Small synthetic rankings/augmented artifacts for the cache and train stage tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from moplex_core.artifacts import ArtifactStore
from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic


def write_synthetic(store: ArtifactStore, *, n: int = 12, k: int = 3, m: int = 4, n_generated: int = 0,
                    seed: int = 0, shard_rows: int | None = None) -> Path:
    """A rankings artifact (n_generated = 0, stage "ingest") or an augmented one (stage "augment",
    the synthetic generator's `below` extras), with a seeded train/validation/test split."""
    data = generate_synthetic(SyntheticConfig(n=n, k=k, m=m, n_generated=n_generated, seed=seed))
    split = np.random.default_rng(seed).choice(["train", "validation", "test"], size=n, p=[0.6, 0.2, 0.2])
    frame = data.to_frame(split)
    stage = "augment" if n_generated else "ingest"
    if not n_generated:
        frame = frame.drop(columns=["generated"])
    table = pa.Table.from_pandas(frame, preserve_index=False)
    version = store.version(stage, {"n": n, "k": k, "m": m, "g": n_generated, "seed": seed})
    with store.writer(stage, version, config={}) as writer:
        rows = shard_rows or n
        for shard, start in enumerate(range(0, n, rows)):
            writer.write_shard(shard, table.slice(start, rows))
    return store.path(stage, version)
