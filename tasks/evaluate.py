"""Prefect tasks of the evaluate stage. The artifact store is the cache (no Prefect result cache), as
in tasks/ingest.py: a finished version is skipped and a task never hands back a path whose files are gone."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import EvaluateConfig
from moplex_core.evaluate import EvaluatePlan, EvaluateResult, plan_evaluate, run_evaluate


@task(name="plan-evaluation", cache_policy=NO_CACHE)
def plan_evaluation(config: EvaluateConfig, train_dir: str, cache_dir: str, root: str) -> EvaluatePlan:
    """The version this config, train and cache artifacts map to, and whether it is done."""
    return plan_evaluate(config, train_dir, cache_dir, ArtifactStore(root))


@task(name="write-evaluation", cache_policy=NO_CACHE)
def write_evaluation(config: EvaluateConfig, train_dir: str, cache_dir: str, root: str,
                     plan: EvaluatePlan, model: str | None = None) -> EvaluateResult:
    """Score the held-out splits exactly and write metrics.parquet, report.md and the plots."""
    result = run_evaluate(config, train_dir, cache_dir, ArtifactStore(root), plan, model=model)
    get_run_logger().info("evaluation %s: %d metric rows, report at %s", result.ref, len(result.metrics), result.report)
    return result
