"""The tiny offline base model as a pipeline stage: `rankings` in, a versioned model folder out.

When a pipeline's ``cache.model`` or ``augment.model`` is ``"tiny"`` (config.TINY_MODEL), no hub
model is needed: moplex_core.lm.tiny builds a small Qwen3 chat model whose tokenizer and
pre-training read the rankings' train-split texts. It is stored like any artifact::

    model/<version>/model/      config.json, model.safetensors, tokenizer files (save_pretrained)
    model/<version>/manifest.json

so it is built once per (TinyModelConfig, rankings version) and the later stages hash its files as
their model input (a rebuilt model with other weights gets new cache and train versions).

    plan_tiny_model  the version and whether it exists
    run_tiny_model   build it unless it exists; returns the model directory
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest
from moplex_core.config import TinyModelConfig
from moplex_core.lm.tiny import build_tiny_model

log = logging.getLogger(__name__)

STAGE = "model"
CODE_VERSION = "tiny-model-1"  # bump when a change here changes the model it builds
MODEL_DIR = "model"
TRAIN_SPLIT = "train"


@dataclass(frozen=True)
class TinyModelPlan:
    ref: ArtifactRef
    path: Path
    inputs: dict[str, str]  # {"rankings": "ingest/<version>"}
    complete: bool

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL_DIR


def plan_tiny_model(config: TinyModelConfig, rankings_dir: str | Path, store: ArtifactStore) -> TinyModelPlan:
    manifest = read_manifest(rankings_dir)
    inputs = {"rankings": f"{manifest['stage']}/{manifest['version']}"}
    version = store.version(STAGE, config.identity(), inputs, CODE_VERSION)
    return TinyModelPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), inputs,
                         store.is_complete(STAGE, version))


def training_pairs(rankings_dir: str | Path, max_pairs: int) -> list[tuple[str, str]]:
    """(prompt, response) for every original response of the train split, at most ``max_pairs``."""
    table = load_table(rankings_dir, columns=["prompt", "responses", "split"])
    train = table.filter(pc.equal(table.column("split"), TRAIN_SPLIT))
    if train.num_rows == 0:
        raise ValueError(f"{rankings_dir} has no {TRAIN_SPLIT!r} rankings to build the tiny model's tokenizer "
                         "and pre-training from; ingest with a non-empty train split")
    pairs = [(prompt, response) for prompt, responses in zip(train.column("prompt").to_pylist(),
                                                             train.column("responses").to_pylist(), strict=True)
             for response in responses]
    return pairs[:max_pairs]


def run_tiny_model(config: TinyModelConfig, rankings_dir: str | Path, store: ArtifactStore,
                   plan: TinyModelPlan | None = None) -> Path:
    """Build the tiny model of ``config`` for the rankings at ``rankings_dir`` unless it exists;
    returns its model directory (loadable with from_pretrained)."""
    plan = plan or plan_tiny_model(config, rankings_dir, store)
    if plan.complete:
        return plan.model_dir
    pairs = training_pairs(rankings_dir, config.max_pairs)
    with store.writer(STAGE, plan.ref.version, config=config.model_dump(mode="json"), inputs=plan.inputs,
                      code_version=CODE_VERSION) as writer:
        if writer.complete:
            return plan.model_dir
        with writer.directory(MODEL_DIR) as staging:
            build_tiny_model(staging, pairs, hidden_size=config.hidden_size, layers=config.layers,
                             heads=config.heads, kv_heads=config.kv_heads, vocab_size=config.vocab_size,
                             max_positions=config.max_positions, seed=config.seed,
                             pretrain_steps=config.pretrain_steps)
        writer.summary.update({"pretrain_pairs": len(pairs), "pretrain_steps": config.pretrain_steps})
    log.info("built the tiny model %s from %d (prompt, response) pairs at %s", plan.ref, len(pairs), plan.model_dir)
    return plan.model_dir
