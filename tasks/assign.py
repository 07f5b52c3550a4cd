"""Prefect tasks of `assign` (outside the pipeline). The artifact store is the cache (no Prefect result
cache), as in tasks/ingest.py: a finished version is skipped and a task never hands back a path whose
files are gone."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.assign import AssignPlan, AssignResult, plan_assign, run_assign


@task(name="plan-assignment", cache_policy=NO_CACHE)
def plan_assignment(train: str, rankings: str, root: str, device: str, score_batch_size: int,
                    model: str | None = None) -> AssignPlan:
    """The version these train and rankings artifacts map to, and whether it is done."""
    return plan_assign(train, rankings, ArtifactStore(root), model=model, device=device,
                       score_batch_size=score_batch_size)


@task(name="write-assignment", cache_policy=NO_CACHE)
def write_assignment(train: str, rankings: str, root: str, plan: AssignPlan) -> AssignResult:
    """Cache the rankings (unless done), score them under every adapter and write their posteriors."""
    result = run_assign(train, rankings, ArtifactStore(root), plan=plan)
    get_run_logger().info("assignment %s: %d rankings at %s", result.ref, result.rows, result.path)
    return result
