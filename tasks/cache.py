"""Prefect tasks of the cache stage. The artifact store is the cache (no Prefect result cache), as
in tasks/ingest.py: a task never hands back a path whose files are gone."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.cache import CachePlan, CacheResult, plan_cache, run_cache
from moplex_core.config import CacheConfig


@task(name="plan-cache", cache_policy=NO_CACHE)
def plan_reference_cache(config: CacheConfig, rankings_dir: str, root: str) -> CachePlan:
    """The version this config, input artifact and model content map to, and whether it is done."""
    return plan_cache(config, rankings_dir, ArtifactStore(root))


@task(name="write-cache", cache_policy=NO_CACHE)
def write_reference_cache(config: CacheConfig, rankings_dir: str, root: str, plan: CachePlan) -> CacheResult:
    """Tokenise every response and compute its pi_ref terms, shard by shard (resumes a killed run)."""
    return run_cache(config, rankings_dir, ArtifactStore(root), plan)  # logs what it wrote (moplex_core.cache)
