"""Prefect tasks of the train stage. The artifact store is the cache (no Prefect result cache): a
finished version is skipped, an unfinished one resumes at its last finished EM iteration."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import TrainConfig
from moplex_core.train import TrainPlan, TrainResult, plan_train, run_train


@task(name="plan-train", cache_policy=NO_CACHE)
def plan_mixture(config: TrainConfig, cache_dir: str, root: str) -> TrainPlan:
    """The version this config and cache map to, and whether it is done."""
    return plan_train(config, cache_dir, ArtifactStore(root))


@task(name="fit-mixture", cache_policy=NO_CACHE)
def fit_mixture_of_adapters(config: TrainConfig, cache_dir: str, root: str, plan: TrainPlan,
                            model: str | None = None) -> TrainResult:
    """Run (or resume) EM over the k LoRA adapters and write the train artifact."""
    result = run_train(config, cache_dir, ArtifactStore(root), plan, model=model)
    get_run_logger().info("train %s: LL %.4f after %d iterations at %s", result.ref, result.log_likelihood,
                          result.iterations, result.path)
    return result
