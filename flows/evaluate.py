"""The evaluate stage: a train artifact and its cache in, a versioned `evaluate` artifact out (DESIGN 3, 7)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import EvaluateConfig
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.evaluate import plan_evaluation, write_evaluation


@flow(name="moplex-evaluate")
def evaluate_flow(config: EvaluateConfig, train_dir: str, cache_dir: str, root: str = DEFAULT_ROOT,
                  model: str | None = None) -> str:
    """Write (or find) the evaluation of the mixture at ``train_dir`` (trained on ``cache_dir``);
    returns its folder (metrics.parquet, report.md, plots/). ``model``: where the cache's base model
    is now, when it moved (default: where the cache recorded it)."""
    plan = plan_evaluation(config, train_dir, cache_dir, root)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info(ALREADY_COMPLETE, plan.ref, plan.path)
        path = plan.path
    else:
        path = write_evaluation(config, train_dir, cache_dir, root, plan, model).path
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
