"""`assign`: new rankings routed to a trained mixture's clusters (moplex_core.assign), as a flow to
deploy beside the pipeline: a train artifact and a rankings artifact in, an `assign` artifact out."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, default_root
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.assign import plan_assignment, write_assignment


@flow(name="moplex-assign")
def assign_flow(train: str, rankings: str, root: str | None = None, device: str = "auto",
                score_batch_size: int = 32, model: str | None = None) -> str:
    """Write (or find) the posteriors of the rankings folder ``rankings`` (an ingest output) under the
    mixture at ``train`` (a train artifact folder); returns the assign artifact's folder. ``root``:
    where its cache and assign artifacts go (default: the train artifact's root). ``model``: where the
    base model is now, when it moved (default: where the train artifact's cache recorded it)."""
    root = root or default_root(train)
    plan = plan_assignment(train, rankings, root, device, score_batch_size, model)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info(ALREADY_COMPLETE, plan.ref, plan.path)
        path = plan.path
    else:
        path = write_assignment(train, rankings, root, plan).path
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
