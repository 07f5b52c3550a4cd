"""The ingest stage: a dataset in, a versioned `rankings` artifact out (DESIGN.md 3, 4, 6)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import IngestConfig
from tasks.ingest import plan_rankings, write_rankings


@flow(name="ingest")
def ingest_flow(config: IngestConfig, root: str = DEFAULT_ROOT) -> str:
    """Write (or find) the rankings artifact of ``config`` under ``root``; returns its folder."""
    logger = get_run_logger()
    plan = plan_rankings(config, root)
    if plan.complete:
        logger.info(ALREADY_COMPLETE, plan.ref, plan.path)
        return str(plan.path)
    return str(write_rankings(config, root, plan).path)
