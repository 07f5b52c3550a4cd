"""The end-to-end pipeline: ingest -> (tiny model) -> augment -> cache -> train -> evaluate (DESIGN 1, 4).

Every stage is a subflow writing a versioned artifact; a stage whose version is complete is skipped
(the artifact store is the cache), an interrupted one resumes from its finished shards or EM
iterations. So a retried flow run (the UI's Retry, ``prefect flow-run retry``) redoes only what did
not finish. ``moplex run PRESET`` is the command-line twin of this flow.

A failed stage is rerun up to ``stage_retries`` times (each try its own subflow run, resuming from
what the previous one finished), unless its error is one a rerun repeats (NOT_RETRIED): bad input,
a bad setting, a corrupt artifact, a dataset or model that is not here.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from prefect import flow, get_run_logger, tags
from prefect.runtime import deployment, flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_UI_URL, temporary_settings
from prefect.states import State

from moplex_core.artifacts import ArtifactError, read_manifest, written_here
from moplex_core.augment import ShortfallError
from moplex_core.config import PipelineConfig, pipeline_preset, with_overrides
from moplex_core.data.sources import DatasetUnavailableError
from moplex_core.ingest import rejected_note
from moplex_core.lm.loading import ModelUnavailableError
from moplex_core.pipeline import run_stages
from moplex_core.processes import (
    FLOW_HEARTBEAT_SECONDS,
    popen_ending_with_this_thread,
    process_identity,
    process_running,
    stop_on_signals_until_exit,
)
from flows.augment import augment_flow
from flows.cache import cache_flow
from flows.evaluate import evaluate_flow
from flows.ingest import ingest_flow
from flows.tiny_model import tiny_model_flow
from flows.train import train_flow
from tasks.pipeline import fail_on_purpose, publish_run_artifacts

log = logging.getLogger(__name__)

_STAGE_NOTE = "moplex pipeline stage: "
STAGE_FLOWS = {"ingest": ingest_flow, "model": tiny_model_flow, "augment": augment_flow, "cache": cache_flow,
               "train": train_flow, "evaluate": evaluate_flow}
"""The subflow of each stage `moplex_core.pipeline.run_stages` names."""

# Errors a rerun of the stage repeats: bad rows, files or settings (ValueError: SchemaError,
# RawSchemaError, pydantic's ValidationError), a bug's TypeError / LookupError, an artifact that is
# corrupt or cannot be written, a dataset or model that is not here, an augmentation shortfall
# (seeded), EM's non-finite scores (FloatingPointError: the same seeds diverge again), and a CUDA
# fault (torch.AcceleratorError: the process's CUDA context is lost, so a rerun in this process cannot
# succeed; a new flow run, e.g. Retry in the UI, starts a new process). Anything else (a killed vLLM
# worker, a network file system's hiccup, a pass out of device memory: another process may have held
# it, and the retry resumes from the finished shards or iterations) is retried.
NOT_RETRIED: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError, ArtifactError,
                                                DatasetUnavailableError, ModelUnavailableError, ShortfallError,
                                                FloatingPointError, torch.AcceleratorError)


def run_stage(name: str, call: Callable[[], str], retries: int, delay_seconds: float,
              logger: logging.Logger | logging.LoggerAdapter) -> str:
    """``call()`` (one stage flow), rerun after ``delay_seconds`` up to ``retries`` times when it fails
    with an error that is not NOT_RETRIED. The error that ends it carries a note naming the stage."""
    tries = 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as err:
            if tries > retries or isinstance(err, NOT_RETRIED):
                err.add_note(f"{_STAGE_NOTE}{name}")  # for run_in_process's one-line account of the failure
                raise
            logger.warning("the %s stage failed (%s: %s); retry %d of %d in %g s, resuming from what it finished",
                           name, type(err).__name__, err, tries, retries, delay_seconds)
            time.sleep(delay_seconds)


@flow(name="moplex-pipeline")
def moplex_pipeline(preset: str = "synthetic-demo", overrides: list[str] | None = None,
                    config: PipelineConfig | None = None) -> dict[str, str]:
    """Run every stage of ``config`` (default: the preset ``preset``), with ``overrides`` applied;
    returns each stage's artifact folder and the report.

    Args:
        preset: a pipeline preset of data/presets (`moplex run --list`), e.g. synthetic-demo,
            synthetic-compare, ultrafeedback-paper, persona-paper, helpsteer2, prism.
        overrides: settings as `moplex run --set` takes them, dotted key=value, e.g.
            train.em_iterations=3, root=/data/moplex (where the artifacts go; relative to the
            worker's directory otherwise), ingest.path=/data/persona.
        config: a whole PipelineConfig, replacing the preset when given (overrides still apply).
    """
    source = f"preset {preset}" if config is None else "the config given"
    config = with_overrides(config or pipeline_preset(preset), overrides or [])
    root, run_count = config.root, flow_run.get_run_count()
    logger = get_run_logger()
    logger.info("%s with overrides %s; artifacts under %s", source, overrides or [], Path(root).resolve())

    reused: dict[str, bool] = {}

    def stage(name: str, *args, **kwargs) -> str:
        if config.fault.stage == name and run_count <= config.fault.times:
            fail_on_purpose(config.fault, name, run_count, how_to_retry(flow_run.get_id()))
        started = datetime.now(timezone.utc)
        try:
            path = run_stage(name, lambda: STAGE_FLOWS[name](*args, **kwargs, root=root), config.stage_retries,
                             config.retry_delay_seconds, logger)
        except Exception as err:
            logger.error("the %s stage failed: %s: %s", name, type(err).__name__, err)
            raise
        reused[name], line = stage_outcome(path, started)
        logger.info("%s stage: %s", name, line)  # the pipeline's own log names every version, not only its subflows'
        return path

    dirs = run_stages(config, stage)
    publish_run_artifacts(dirs, reused)
    logger.info("report: %s/report.md", dirs["evaluate"])
    return {**dirs, "report": f"{dirs['evaluate']}/report.md"}


def stage_outcome(path: str, started: datetime) -> tuple[bool, str]:
    """(reused, a line for the pipeline's log) for the stage artifact at ``path``, whose stage flow
    started at ``started``: written by this run when this process finished its manifest since then,
    reused otherwise (found complete, by an earlier run or an earlier attempt of this one, or finished
    by another run on the same root while this one waited for its lock)."""
    manifest = read_manifest(path)
    ref = f"{Path(path).parent.name}/{Path(path).name}"
    # the manifest's time is in whole seconds: one finished in the second this stage started counts as written
    finished_since = datetime.fromisoformat(manifest["finished"]) >= started.replace(microsecond=0)
    if not (finished_since and written_here(manifest)):
        return True, f"{ref} reused (complete since {manifest['finished']}) at {path}"
    resumed = ", resumed from what an interrupted run had finished" if manifest.get("resumed") else ""
    return False, f"{ref} written by this run{resumed} at {path}"


def retry_command(run_id) -> str:
    """The command that retries pipeline run ``run_id``: a run of a deployment by its id alone (its
    worker sets the 30 s heartbeat, prefect.yaml); a run without one (``moplex run``) also needs the
    flow's entrypoint, and the heartbeat `moplex run` sets, which Prefect's own command does not: with
    its 180 s, prefect-automations.yaml would mark the live retry Crashed."""
    if deployment.get_id() is not None:
        return f"prefect flow-run retry {run_id}"
    return (f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY={FLOW_HEARTBEAT_SECONDS} prefect flow-run retry {run_id} "
            f"--entrypoint {Path(__file__).resolve()}:moplex_pipeline")


def how_to_retry(run_id) -> str:
    """The ways to retry pipeline run ``run_id``: the UI's Retry reaches a worker only for a run of a
    deployment; the command, always."""
    command = retry_command(run_id)
    return f"UI: Retry; CLI: {command}" if deployment.get_id() is not None else f"CLI: {command}"


def flow_run_url(run_id) -> str:
    """Where the Prefect UI shows a flow run (a temporary server's runs stay in PREFECT_HOME)."""
    if PREFECT_API_URL.value():
        return f"{PREFECT_UI_URL.value()}/runs/flow-run/{run_id}"
    return f"http://127.0.0.1:4200/runs/flow-run/{run_id} after `prefect server start` (same PREFECT_HOME)"


def _raised(state: State) -> BaseException | None:
    """The exception of ours that failed a run (not Prefect's wrapping), or None."""
    try:
        err = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 -- the result may not be readable back
        return None
    if not isinstance(err, BaseException) or type(err).__module__.startswith("prefect."):
        return None
    return err


def _stages(err: BaseException) -> list[str]:
    """The stages ``err`` failed in, as `run_stage` noted them (none: it was raised between stages)."""
    return [note.removeprefix(_STAGE_NOTE) for note in getattr(err, "__notes__", ()) if note.startswith(_STAGE_NOTE)]


def failure_cause(state: State) -> str:
    """What failed a pipeline run, first: ``the <stage> stage failed: <Error>: <message>`` from the
    exception itself (its message names the file, row, field or setting), not Prefect's wrapping."""
    err = _raised(state)
    if err is None:  # no exception of ours; fall back to the state's message
        return state.message or f"the pipeline run ended {state.type.value}"
    stages = _stages(err)
    where = f"the {stages[0]} stage failed: " if stages else ""
    return f"{where}{type(err).__name__}: {err}"


def refused_its_settings(state: State) -> bool:
    """Whether a run failed on a check of its settings between stages (`run_stages`: the stages'
    devices on this machine, the rankings against train.k and evaluate.splits, the model against the
    cache's lengths and the LoRA targets):
    a ValueError no stage raised. A retry of that flow run applies the same settings and fails the same
    way."""
    err = _raised(state)
    return isinstance(err, ValueError) and not _stages(err)


def without_heartbeats() -> AbstractContextManager[None]:
    """Prefect settings with no flow-run heartbeats (a context manager). Heartbeats drive zombie
    detection of deployed runs; elsewhere they only cost time: every flow run's exit waits up to 1 s
    for Prefect's heartbeat thread, 6 or 7 flow runs per pipeline run (the pipeline's, one per stage;
    more with stage retries)."""
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


LOCAL_RUN_TAG = "moplex-local-run"
"""The tag of every flow run a `moplex` command runs on Prefect's temporary server; its other tag,
``OWNER_TAG`` + `process_identity`, names the process that runs it."""
OWNER_TAG = "moplex-process:"


@contextmanager
def local_run_settings() -> Iterator[None]:
    """Prefect settings for flows run in this process (``moplex run``, ``moplex experiment compare``).
    Against a real server nothing changes. Without PREFECT_API_URL, Prefect's temporary server lives
    only as long as this process, so nothing can act on heartbeats and they are turned off, and the
    server is started in a session of its own (`temporary_server_in_its_own_session`). The flow runs
    are tagged with this process (`LOCAL_RUN_TAG`, ``OWNER_TAG``), and those that an earlier process
    on this PREFECT_HOME left Running when it died without a word are marked Crashed
    (`crash_runs_of_ended_processes`)."""
    if PREFECT_API_URL.value():
        yield
        return
    with without_heartbeats(), temporary_server_in_its_own_session(), \
            tags(LOCAL_RUN_TAG, OWNER_TAG + process_identity()):
        crash_runs_of_ended_processes()
        yield


def crash_runs_of_ended_processes() -> list[str]:
    """Mark Crashed the flow runs of PREFECT_HOME's temporary server (`LOCAL_RUN_TAG`) still Pending or
    Running whose process has ended: a SIGKILL (the OOM killer, ``kill -9``) leaves no server to notice
    (it stopped with the process) and no heartbeat to miss, so the run would stay Running. A run of a
    process that is still running, or of another machine's (a PREFECT_HOME on a shared disk), is left
    as it is. Returns the runs marked, ``name (id)`` each, and names them in a warning."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))
    crashed = []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[LOCAL_RUN_TAG]),
                                                                   state=unfinished))
        for run in runs:
            owner = next((tag.removeprefix(OWNER_TAG) for tag in run.tags if tag.startswith(OWNER_TAG)), "")
            if process_running(owner) is not False:
                continue
            now = datetime.now(timezone.utc)
            message = (f"its process ({owner}) ended without recording an end (SIGKILL, out of memory); marked by "
                       f"the next moplex command on this PREFECT_HOME at {now:%Y-%m-%d %H:%M} UTC")
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            crashed.append(f"{run.name} ({run.id})")
    if crashed:
        log.warning("marked Crashed %d flow run(s) that a moplex process on this PREFECT_HOME left Pending or Running "
                    "when it died without a word: %s", len(crashed), ", ".join(crashed))
    return crashed


@contextmanager
def temporary_server_in_its_own_session() -> Iterator[None]:
    """Prefect starts its temporary server as a child in this process's process group, so a Ctrl-C
    in the terminal, or a SIGTERM or SIGINT to the group (``timeout``, systemd), stops the server at
    the moment it stops this process. Prefect then retries for minutes to record the crash on the
    dead server, printing connection tracebacks (``timeout -s INT 55 moplex run synthetic-demo``
    took 5 min 52 s to exit, 2026-11-23). Started in a session of its own, as ``setsid`` would, the
    server outlives the signal, Prefect records the crash at once, and it stops the server on exit as
    after any run. Prefect 3.8.8 has no setting for this: its server module's ``subprocess.Popen``
    is given ``start_new_session=True`` while the context is open (the server starts on the first
    API call inside it). On the main thread only: elsewhere nothing changes.

    No signal reaches that server now, so this process must unwind on SIGTERM, SIGHUP (a closed
    terminal) and SIGINT for Prefect's exit hook to stop it (`stop_on_signals_until_exit`). A SIGKILL
    allows no unwinding: on Linux the server is also told to stop when this thread ends
    (`_stopped_with_this_thread`), and it is started from the main thread, which ends only with the
    process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from prefect.server.api import server

    stop_on_signals_until_exit()
    own_session = types.SimpleNamespace(**vars(subprocess))
    own_session.Popen = _stopped_with_this_thread
    previous, server.subprocess = server.subprocess, own_session
    try:
        yield
    finally:
        server.subprocess = previous


def _stopped_with_this_thread(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` of ``args`` in a session of its own, which on Linux also gets SIGTERM when the
    calling thread ends, however it ends, SIGKILL included: the server is started from the main
    thread, which ends only with the process."""
    if isinstance(args, list) and threading.current_thread() is threading.main_thread():
        return popen_ending_with_this_thread(args, start_new_session=True, **kwargs)
    return subprocess.Popen(args, start_new_session=True, **kwargs)


def run_in_process(preset: str, overrides: list[str], root: str) -> tuple[bool, str]:
    """Run the pipeline here (``moplex run``; the caller has checked the settings, whose artifact root
    is ``root``); (completed, what to tell the user). The run's parameters are the preset and the
    overrides, as a deployment's are: its first log line and the UI name them, and a retry applies
    them again."""
    with local_run_settings():
        state = moplex_pipeline(preset=preset, overrides=overrides, return_state=True)
    run_id = state.state_details.flow_run_id
    ui = flow_run_url(run_id)
    if not state.is_completed():
        if refused_its_settings(state):
            advice = ("change the setting it names and rerun the command (a retry of this run would apply the "
                      "same settings and fail the same way)")
        else:
            advice = (f"fix the cause and rerun the command, or retry the run (same PREFECT_HOME, or the same "
                      f"server where PREFECT_API_URL is set) with `{retry_command(run_id)}` (a fault.stage set on "
                      "purpose fails again on a new run)")
        return False, (
            f"{failure_cause(state)}\n"
            f"(pipeline run {run_id} ended {state.type.value}; Prefect's log above has the traceback.) Finished "
            f"stages are kept: {advice}. Prefect UI: {ui}"
        )
    return True, completed_run_summary(state.result(), root, run_id)


def completed_run_summary(dirs: dict[str, str], root: str, run_id) -> str:
    """What `moplex run` tells the user after a completed run: the report, each stage's folder, what
    a drop-mode ingest left out, how to score new rankings, and where the run is in the UI."""
    lines = [Path(dirs["report"]).read_text(), "artifacts (moplex inspect PATH shows any of them):"]
    lines += [f"  {stage:<9} {path}" for stage, path in dirs.items()]
    left_out = rejected_note(dirs["ingest"])
    if left_out:
        lines.append(f"\n{left_out}")
    root = shlex.quote(root)
    lines.append(f"\nNew rankings to these clusters (README, Using the trained mixture): moplex ingest --dataset generic "
                 f"--path FILE --set 'split.fractions=[1,0,0]' --root {root}, then moplex assign "
                 f"{shlex.quote(dirs['train'])} ingest/<version>")
    lines.append(f"\nPrefect flow run {run_id} (stage versions, metrics, report and file paths under "
                 f"Artifacts):\n  {flow_run_url(run_id)}")
    return "\n".join(lines)
