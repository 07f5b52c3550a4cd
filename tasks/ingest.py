"""Prefect tasks of the ingest stage.

Neither task uses Prefect's result cache: the artifact store is the cache (a version that exists is
complete by construction), so a task can never hand back a path whose files are gone.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import IngestConfig
from moplex_core.ingest import IngestPlan, IngestResult, plan_ingest, run_ingest


@task(name="plan-rankings", cache_policy=NO_CACHE)
def plan_rankings(config: IngestConfig, root: str) -> IngestPlan:
    """The version this config maps to (hashing a local source's content) and whether it is done."""
    return plan_ingest(config, ArtifactStore(root))


@task(name="write-rankings", cache_policy=NO_CACHE)
def write_rankings(config: IngestConfig, root: str, plan: IngestPlan) -> IngestResult:
    """Read, convert, validate and split the dataset, and write the rankings artifact."""
    return run_ingest(config, ArtifactStore(root), plan)  # logs what it wrote (moplex_core.ingest)
