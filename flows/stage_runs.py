"""What a stage's flow run shows of its artifact: a name after it (``train/e86da142fbe2``) and, for a run of
its own, Prefect artifacts of it."""

from __future__ import annotations

from pathlib import Path

from prefect.context import FlowRunContext

from moplex_core.artifacts import ArtifactRef


def name_run_after(ref: ArtifactRef) -> None:
    """Rename the current flow run to ``ref`` (e.g. ``train/e86da142fbe2``), the version it writes or
    finds complete, once its plan has it: in the UI, `prefect flow-run ls` and the pipeline's subflow
    list a stage run then says which stage and version it is, not Prefect's random two words (which
    name it until then, in the lines Prefect logs as it starts and ends it)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    name = str(ref)
    context.client.set_flow_run_name(flow_run_id=context.flow_run.id, name=name)
    context.flow_run.name = name  # get_run_logger's lines from here on carry it too


def publish_if_alone(stage: str, path: str | Path, reused: bool) -> None:
    """Where this stage's flow run is a run of its own (a stage deployment, ``prefect deployment run
    moplex-evaluate/evaluate``, or the flow called from a script), not another flow's subflow:
    Prefect artifacts of its version, as the pipeline publishes for every stage (the version table,
    its Parquet files, and for evaluate the metrics table and the report). ``reused``: the version
    was found complete, not written by this run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow_run.parent_task_run_id is not None:
        return
    from tasks.pipeline import publish_run_artifacts  # pandas and the evaluate module: only where used

    publish_run_artifacts({stage: str(path)}, {stage: reused}, pipeline=False)
