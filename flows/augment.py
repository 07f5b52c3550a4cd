"""The augment stage: a `rankings` artifact in, a versioned `augmented` artifact out (paper 4.1, DESIGN.md 3)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import AugmentConfig
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.augment import plan_augmented, write_augmented


@flow(name="moplex-augment")
def augment_flow(config: AugmentConfig, rankings: str, root: str = DEFAULT_ROOT) -> str:
    """Write (or find) the augmented artifact of ``config`` for the rankings folder ``rankings``
    (an ingest output); returns its folder. A complete version is not regenerated, but its
    shortfall is still checked against ``config.on_shortfall``."""
    plan = plan_augmented(config, rankings, root)
    name_run_after(plan.ref)
    logger = get_run_logger()  # after the rename: its lines carry the new name
    if plan.complete:
        logger.info(ALREADY_COMPLETE, plan.ref, plan.path)
    path = write_augmented(config, root, plan).path
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
