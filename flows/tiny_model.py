"""The tiny-model stage: a rankings artifact in, a small offline Qwen3 base model out (moplex_core.tiny_model)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from moplex_core.artifacts import DEFAULT_ROOT
from moplex_core.config import TinyModelConfig
from flows.stage_runs import name_run_after, publish_if_alone
from tasks.tiny_model import build_model, plan_model


@flow(name="moplex-tiny-model")
def tiny_model_flow(config: TinyModelConfig, rankings_dir: str, root: str = DEFAULT_ROOT) -> str:
    """Build (or find) the tiny model of ``config`` for the rankings at ``rankings_dir``; returns its
    artifact folder (the model, loadable with from_pretrained, is its ``model/`` folder)."""
    plan = plan_model(config, rankings_dir, root)
    name_run_after(plan.ref)
    if plan.complete:
        get_run_logger().info("%s is already built at %s; nothing to do", plan.ref, plan.model_dir)
    else:
        build_model(config, rankings_dir, root, plan)
    publish_if_alone(plan.ref.stage, plan.path, plan.complete)
    return str(plan.path)
