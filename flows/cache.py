"""The cache stage: rankings (or augmented rankings) in, a versioned `cache` artifact out (DESIGN 3, 5.4)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import CacheConfig
from flows.naming import name_run_after
from tasks.cache import plan_reference_cache, write_reference_cache


@flow(name="cache")
def cache_flow(config: CacheConfig, rankings_dir: str, root: str = DEFAULT_ROOT) -> str:
    """Write (or find) the cache of the artifact at ``rankings_dir`` under ``root``; returns its folder."""
    plan = plan_reference_cache(config, rankings_dir, root)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info(ALREADY_COMPLETE, plan.ref, plan.path)
        return str(plan.path)
    return str(write_reference_cache(config, rankings_dir, root, plan).path)
