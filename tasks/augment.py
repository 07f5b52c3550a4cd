"""Prefect tasks of the augment stage.

As for ingest, the artifact store is the cache (no Prefect result cache): a version that exists is
complete, and an interrupted one resumes from its finished shards when the task runs again.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.augment import AugmentPlan, AugmentResult, plan_augment, run_augment
from moplex_core.config import AugmentConfig


@task(name="plan-augmented", cache_policy=NO_CACHE)
def plan_augmented(config: AugmentConfig, rankings: str, root: str) -> AugmentPlan:
    """The version this config maps to (hashing a local model's files) and whether it is done."""
    return plan_augment(config, rankings, ArtifactStore(root))


@task(name="write-augmented", cache_policy=NO_CACHE)
def write_augmented(config: AugmentConfig, root: str, plan: AugmentPlan) -> AugmentResult:
    """Generate the missing shards and write the augmented artifact; raises `ShortfallError` when a
    prompt fell short in fail mode (for a version already complete, too)."""
    result = run_augment(config, plan.rankings, ArtifactStore(root), plan)
    logger = get_run_logger()
    if result.shortfall.num_rows:
        logger.warning("%d ranking(s) kept with fewer generated responses; see %s/shortfall.parquet",
                       sum(result.shortfall.column("rankings").to_pylist()), result.path)
    return result
