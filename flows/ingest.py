"""The ingest stage: a dataset in, a versioned `rankings` artifact out (DESIGN.md 3, 4, 6)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import IngestConfig
from moplex_core.ingest import rejected_note
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.ingest import plan_rankings, write_rankings


@flow(name="moplex-ingest")
def ingest_flow(config: IngestConfig, root: str = DEFAULT_ROOT) -> str:
    """Write (or find) the rankings artifact of ``config`` under ``root``; returns its folder. What a
    drop-mode ingest left out is a warning of the run, also where the version already existed."""
    plan = plan_rankings(config, root)
    name_run_after(plan.ref)
    logger = get_run_logger()  # after the rename: its lines carry the new name
    if plan.complete:
        logger.info(ALREADY_COMPLETE, plan.ref, plan.path)
        path = plan.path
    else:
        path = write_rankings(config, root, plan).path
    left_out = rejected_note(path)
    if left_out:
        logger.warning(left_out)
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
