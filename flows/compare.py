"""Several methods x seeds of the pipeline on one dataset, and their comparison report (paper
Tables 3 and 4; moplex_core.experiments.compare). ``moplex experiment compare`` is its command-line twin.

Each (method, seed) is a `moplex-pipeline` subflow run, so every run shows in the Prefect UI with its
own stage artifacts, and the stages the methods share (ingest, tiny model, augment, cache) are
computed once. A retried compare run reruns only what did not finish.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import PipelineConfig, pipeline_preset, with_overrides
from moplex_core.methods import METHODS
from moplex_core.experiments.compare import plan_runs, write_comparison
from flows.pipeline import flow_run_url, local_run_settings, moplex_pipeline


@task(name="write-comparison", cache_policy=NO_CACHE)
def write_comparison_task(root: str, dataset: str, evaluations: list[tuple[str, int, str]],
                          overrides: list[str]) -> str:
    """The compare artifact of the runs' evaluations ((method, seed, evaluate folder) each)."""
    path = write_comparison(ArtifactStore(root), dataset, evaluations, overrides)
    get_run_logger().info("comparison report: %s/report.md", path)
    return str(path)


@flow(name="moplex-compare")
def compare_flow(methods: list[str] | None = None, seeds: int = 3, first_seed: int = 0,
                 preset: str = "synthetic-compare", overrides: list[str] | None = None,
                 config: PipelineConfig | None = None) -> str:
    """Run ``methods`` (default: all of METHODS) with train seeds first_seed .. first_seed + seeds - 1
    on ``config`` (default: the preset ``preset``) with ``overrides``; returns the compare artifact's
    folder (report.md inside). The report names the dataset by the preset, or by ``ingest.dataset``
    when a config is given (``preset`` is then unused) or the overrides change the preset's dataset."""
    methods = list(methods or METHODS)
    start = config or pipeline_preset(preset)
    base = with_overrides(start, overrides or [])
    seed_list = list(range(first_seed, first_seed + seeds))
    evaluations = []
    for method, seed, run_config in plan_runs(base, methods, seed_list):
        run = moplex_pipeline.with_options(flow_run_name=f"{method}-seed{seed}")
        evaluations.append((method, seed, run(config=run_config)["evaluate"]))
    dataset = preset if config is None and base.ingest.dataset == start.ingest.dataset else base.ingest.dataset
    return write_comparison_task(base.root, dataset, evaluations, overrides or [])


def run_compare_in_process(methods: list[str], seeds: int, first_seed: int, preset: str,
                           overrides: list[str]) -> tuple[bool, str]:
    """Run the compare flow here (``moplex experiment compare``); (completed, what to tell the user)."""
    with local_run_settings():
        state = compare_flow(methods, seeds, first_seed, preset, overrides, return_state=True)
    ui = flow_run_url(state.state_details.flow_run_id)
    if not state.is_completed():
        return False, (f"the comparison ended {state.type.value}: {state.message}\nfinished runs are kept; "
                       f"rerun the same command to continue\nbrowse it in the Prefect UI: {ui}")
    path = state.result()
    report = (Path(path) / "report.md").read_text()
    return True, f"{report}\nreport: {path}/report.md\nPrefect flow run: {ui}"
