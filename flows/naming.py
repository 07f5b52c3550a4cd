"""Flow-run names that say what a stage run is about: its artifact (``train/e86da142fbe2``)."""

from __future__ import annotations

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
