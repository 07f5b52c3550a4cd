"""The cache stage: rankings (or augmented rankings) in, a versioned `cache` artifact out (DESIGN 3, 5.4)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import CacheConfig
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.cache import plan_reference_cache, write_reference_cache


@flow(name="moplex-cache")
def cache_flow(config: CacheConfig, rankings_dir: str, root: str = DEFAULT_ROOT) -> str:
    """Write (or find) the cache of the artifact at ``rankings_dir`` under ``root``; returns its folder."""
    plan = plan_reference_cache(config, rankings_dir, root)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info(ALREADY_COMPLETE, plan.ref, plan.path)
        path = plan.path
    else:
        path = write_reference_cache(config, rankings_dir, root, plan).path
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
