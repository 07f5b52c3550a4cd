"""The train stage: a `cache` artifact in, k LoRA adapters fitted by EM out (DESIGN 3, 5.3-5.5)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import ALREADY_COMPLETE, DEFAULT_ROOT
from moplex_core.config import TrainConfig
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.train import fit_mixture_of_adapters, plan_mixture


@flow(name="moplex-train")
def train_flow(config: TrainConfig, cache_dir: str, root: str = DEFAULT_ROOT, model: str | None = None) -> str:
    """Write (or find, or resume) the train artifact of ``config`` on the cache at ``cache_dir``.
    ``model``: where the cache's base model is now, when it moved (default: where the cache recorded it)."""
    plan = plan_mixture(config, cache_dir, root)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info(ALREADY_COMPLETE, plan.ref, plan.path)
        path = plan.path
    else:
        path = fit_mixture_of_adapters(config, cache_dir, root, plan, model).path
    publish_if_alone(plan.ref.stage, path, plan.complete)
    return str(path)
