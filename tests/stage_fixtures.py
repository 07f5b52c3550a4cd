"""Small synthetic rankings/augmented artifacts for the cache and train stage tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

import torch

from moplex_core.artifacts import ArtifactStore
from moplex_core.cache import run_cache
from moplex_core.config import CacheConfig, IngestConfig, SplitConfig, TinyModelConfig, TrainConfig
from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.ingest import run_ingest
from moplex_core.tiny_model import run_tiny_model
from moplex_core.train import run_train


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


def tiny_trained_mixture(store: ArtifactStore, *, em_iterations: int = 1, train_settings: dict | None = None,
                         **cache_settings) -> tuple[Path, Path, Path]:
    """(rankings, cache, train) folders: 36 synthetic rankings (k = 3, m = 3, split 50/25/25), the
    pipeline's tiny model, its cache (CacheConfig defaults unless ``cache_settings``) and exact EM over 3
    LoRA adapters (r = 4 on q_proj and v_proj; ``train_settings`` sets other TrainConfig fields), built on one
    torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rankings = run_ingest(IngestConfig(dataset="synthetic", synthetic={"n": 36, "k": 3, "m": 3},
                                           split=SplitConfig(fractions=(0.5, 0.25, 0.25))), store).path
        model = run_tiny_model(TinyModelConfig(pretrain_steps=5, hidden_size=32), rankings, store)
        cache = run_cache(CacheConfig(model=str(model), **cache_settings), rankings, store, progress=False).path
        settings = {"lora_r": 4, "lora_targets": ("q_proj", "v_proj"), "anchors": None, **(train_settings or {})}
        train = run_train(TrainConfig(k=3, em_iterations=em_iterations, **settings), cache, store, progress=False).path
    finally:
        torch.set_num_threads(threads)
    return rankings, cache, train
