"""Prefect tasks of the tiny-model stage (a pipeline whose model is "tiny"). The artifact store is the
cache, as in tasks/ingest.py."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import TinyModelConfig
from moplex_core.tiny_model import TinyModelPlan, plan_tiny_model, run_tiny_model


@task(name="plan-tiny-model", cache_policy=NO_CACHE)
def plan_model(config: TinyModelConfig, rankings_dir: str, root: str) -> TinyModelPlan:
    """The version this config and rankings artifact map to, and whether it is built."""
    return plan_tiny_model(config, rankings_dir, ArtifactStore(root))


@task(name="build-tiny-model", cache_policy=NO_CACHE)
def build_model(config: TinyModelConfig, rankings_dir: str, root: str, plan: TinyModelPlan) -> None:
    """Build and pre-train the tiny Qwen3 model on the rankings' train texts."""
    run_tiny_model(config, rankings_dir, ArtifactStore(root), plan)  # logs what it built (moplex_core.tiny_model)
