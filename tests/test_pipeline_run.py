"""How flows/pipeline.py runs stages: retries (run_stage: a transient failure is retried, an error a
rerun would repeat (bad input, a missing model) fails on its first try, and the error names its
stage) and the settings of an in-process run (local_run_settings)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from flows.pipeline import local_run_settings, run_stage
from tasks.pipeline import _embed_plots
from moplex_core.data.sources import HubUnreachableError
from moplex_core.lm.loading import ModelUnavailableError
from moplex_core.schema import RowIssue, SchemaError

from prefect_server_fixtures import prefect_environment

LOGGER = logging.getLogger("test-stage-retries")
# synthetic-demo's stages before train at a fifth of their rankings and pretraining steps: a run reaches train sooner
SMALLER_DEMO = ("ingest.synthetic.n=60", "tiny_model.pretrain_steps=20")


class Flaky:
    """A stage that raises each of ``errors`` in turn, then returns "done"; counts its calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_a_transient_failure_is_retried_and_logged(caplog):
    stage = Flaky(OSError("NFS server not responding"), HubUnreachableError("could not load 'x': read timed out"))
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        result = run_stage("cache", stage, retries=2, delay_seconds=0, logger=LOGGER)
    assert result == "done"
    assert stage.calls == 3
    assert "the cache stage failed (OSError: NFS server not responding); retry 1 of 2" in caplog.text
    assert "the cache stage failed (HubUnreachableError: could not load 'x': read timed out); retry 2 of 2" in caplog.text


def test_retries_run_out_and_the_last_error_names_the_stage():
    # out of device memory: another process may have held it (the retry resumes where the stage stopped)
    stage = Flaky(torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("again"))
    with pytest.raises(RuntimeError, match="again") as error:
        run_stage("train", stage, retries=1, delay_seconds=0, logger=LOGGER)
    assert stage.calls == 2
    assert error.value.__notes__ == ["moplex pipeline stage: train"]


@pytest.mark.parametrize("error", [
    SchemaError([RowIssue(1, "bad-1", "ranking", "index 7 is out of range", "rankings.jsonl line 2")]),
    ValueError("train.k = 40 clusters, but the cache has only 12 training ranking(s)"),
    ModelUnavailableError("model path 'no-such-model' does not exist"),
    FloatingPointError("EM iteration 3: non-finite scores"),
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
])
def test_an_error_a_rerun_repeats_is_not_retried(error, caplog):
    stage = Flaky(error)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name), pytest.raises(type(error)) as raised:
        run_stage("ingest", stage, retries=3, delay_seconds=0, logger=LOGGER)
    assert stage.calls == 1
    assert raised.value.__notes__ == ["moplex pipeline stage: ingest"]
    assert "retry" not in caplog.text


def test_the_pipeline_log_says_whether_a_stage_wrote_its_version_or_reused_it(tmp_path, fixtures_dir):
    # `prefect flow-run logs <pipeline run>` shows the pipeline's own lines, not its subflows': each stage
    # ends with one there naming its version, its folder and whether this run wrote it.
    from datetime import datetime, timedelta, timezone

    from flows.pipeline import stage_outcome
    from moplex_core.artifacts import ArtifactStore
    from moplex_core.config import IngestConfig
    from moplex_core.ingest import run_ingest

    before = datetime.now(timezone.utc) - timedelta(seconds=5)
    result = run_ingest(IngestConfig(dataset="persona", path=str(fixtures_dir / "persona.jsonl")),
                        ArtifactStore(tmp_path))
    path = str(result.path)
    assert stage_outcome(path, before) == (False, f"{result.ref} written by this run at {path}")
    later = datetime.now(timezone.utc) + timedelta(seconds=5)  # a rerun's stage: found complete
    finished = json.loads((result.path / "manifest.json").read_text())["finished"]
    assert stage_outcome(path, later) == (True, f"{result.ref} reused (complete since {finished}) at {path}")
    # another run on the same root finished it while this one waited for its lock: reused, though finished
    # since this stage started
    manifest = json.loads((result.path / "manifest.json").read_text())
    (result.path / "manifest.json").write_text(json.dumps({**manifest, "process": "another process's mark"}))
    assert stage_outcome(path, before) == (True, f"{result.ref} reused (complete since {finished}) at {path}")


@pytest.fixture
def stop_signals_restored() -> Iterator[None]:
    """`local_run_settings` stops on SIGTERM, SIGHUP and SIGINT until the process exits, which in a test
    worker is every later test's process: each test that enters it gives the handlers back."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    for signum in handlers:  # as a test worker normally has them (not under nohup, which ignores SIGHUP)
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def test_local_run_settings_turn_heartbeats_off_on_a_temporary_server_and_keep_them_on_a_real_one(
        stop_signals_restored):
    # The setting only: test_zombie_runs watches a real server receive (and miss) a run's heartbeats.
    # Prefect's default (180 s), set here: the session's Prefect fixture runs without heartbeats.
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
        with temporary_settings(updates={PREFECT_API_URL: None}), local_run_settings():
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
        with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}), local_run_settings():
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 180
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 180


def test_local_run_settings_patch_prefects_server_module_for_the_run_and_stop_on_signals_until_exit(
        stop_signals_restored):
    from prefect.server.api import server

    from moplex_core.processes import StopSignal

    _check_local_run_settings(server, StopSignal)


def _check_local_run_settings(server, StopSignal) -> None:
    import pickle

    before = server.subprocess
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}), local_run_settings():
        assert server.subprocess is before  # against a real server nothing changes
    with temporary_settings(updates={PREFECT_API_URL: None}), local_run_settings():
        command = [sys.executable, "-c", "import time; time.sleep(60)"]
        child = server.subprocess.Popen(command)
        try:
            assert os.getsid(child.pid) == child.pid  # a session of its own
            deadline = time.monotonic() + 30  # on Linux, a wrapper asks for the parent-death signal, then execs
            while Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")[:-1] != [c.encode() for c in command] \
                    and time.monotonic() < deadline and sys.platform.startswith("linux"):
                time.sleep(0.05)
            assert child.poll() is None
            if sys.platform.startswith("linux"):
                assert Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")[:-1] == [c.encode() for c in command]
        finally:
            child.kill()
            child.wait()
    assert server.subprocess is before
    # SIGTERM, SIGHUP and SIGINT unwind the process until its exit hooks (Prefect's server stop) have run.
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with pytest.raises(StopSignal) as stop:
            signal.getsignal(signum)(signum, None)
        assert stop.value.status == 128 + signum
    assert pickle.loads(pickle.dumps(StopSignal(15))).status == 143


def _temporary_servers(home: Path | None) -> list[int]:
    """Pids of Prefect temporary servers whose PREFECT_HOME is ``home`` (any, for None)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if b"prefect.server.api.server:create_app" in (proc / "cmdline").read_bytes() and (
                    home is None or f"PREFECT_HOME={home}".encode() in (proc / "environ").read_bytes().split(b"\0")):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def _as_from_a_terminal(command: list[str], ignoring: tuple[signal.Signals, ...] = ()) -> list[str]:
    """``command`` started with SIGINT, SIGTERM and SIGHUP at their defaults, as a terminal starts it,
    but for those in ``ignoring`` (`nohup` ignores SIGHUP): this test process may have been started
    ignoring some (a shell script's background job ignores SIGINT), and a child inherits that. An exec
    shim, since preexec_fn is unsafe in a process with threads."""
    shim = ("import os, signal, sys\n"
            "for name in ('SIGINT', 'SIGTERM', 'SIGHUP'):\n"
            "    ignored = name in sys.argv[1].split(',')\n"
            "    signal.signal(getattr(signal, name), signal.SIG_IGN if ignored else signal.SIG_DFL)\n"
            "os.execv(sys.argv[2], sys.argv[2:])\n")
    return [sys.executable, "-c", shim, ",".join(s.name for s in ignoring), *command]


def _signal_moplex_run_in_train(tmp_path: Path, signum: int, wait_for_server: float = 0.0
                                ) -> tuple[int, str, list[int]]:
    """Start `moplex run synthetic-demo` (SMALLER_DEMO) in a process group of its own, send ``signum`` to the group
    once the train stage has begun, and return the run's status, its stderr and the pids of its
    PREFECT_HOME's temporary servers still running when it has ended, or up to ``wait_for_server``
    seconds later (killed then, so none is left behind)."""
    import subprocess

    home = tmp_path / "prefect-home"
    env = prefect_environment(home)
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        sets = [part for setting in SMALLER_DEMO for part in ("--set", setting)]
        run = subprocess.Popen(_as_from_a_terminal([sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo",
                                                    *sets, "--threads", "1", "--root", str(tmp_path / "artifacts")]),
                               stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while "for flow 'moplex-train'" not in log.read_text() and run.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            assert run.poll() is None, log.read_text()[-3000:]
            assert _temporary_servers(home), (f"the run's temporary server is not running (servers of any PREFECT_HOME: "
                                              f"{_temporary_servers(None)}); its stderr ends:\n{log.read_text()[-3000:]}")
            os.killpg(run.pid, signum)
            status = run.wait(timeout=120)  # before the own-session server: minutes of retries against a dead one
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
            deadline = time.monotonic() + wait_for_server
            while _temporary_servers(home) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = _temporary_servers(home)
            for pid in left:  # asserted by the callers; killed here so a failing run leaves nothing behind
                os.kill(pid, signal.SIGKILL)
    return status, log.read_text(), left


@pytest.mark.slow  # a pipeline run up to its train stage: ~20 s on 2 cores
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_stops_moplex_run_at_once_and_its_server_with_it(tmp_path, stop):
    """`timeout`, systemd and a terminal's Ctrl-C signal the whole process group. Prefect's temporary
    server runs in a session of its own, so it is still there to record the crash; then the run ends
    with one line and the signal's status, and the server is stopped, not left behind."""
    status, text, left = _signal_moplex_run_in_train(tmp_path, getattr(signal, stop))
    assert status == 128 + getattr(signal, stop), text[-3000:]
    overrides = [*SMALLER_DEMO, f"root={tmp_path / 'artifacts'}"]
    assert f"preset synthetic-demo with overrides {overrides}" in text  # the run's parameters
    assert "moplex run: interrupted. Finished stages" in text
    assert "Traceback" not in text and "Error logging to API" not in text and "Connection refused" not in text
    assert "Finished in state Crashed" in text  # Prefect recorded the crash on its live server
    assert left == []


@pytest.mark.slow  # as above
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server's parent-death signal is Linux's prctl")
def test_a_sigkill_of_moplex_run_takes_its_server_down_too(tmp_path):
    # Nothing unwinds: the server learns of its parent's end by a signal of its own and stops in a moment.
    status, text, left = _signal_moplex_run_in_train(tmp_path, signal.SIGKILL, wait_for_server=30)
    assert status == -signal.SIGKILL, text[-3000:]
    assert left == []
    # Nothing recorded the end either: the next moplex command on this PREFECT_HOME marks the runs the
    # killed one left Running (the pipeline's and its train stage's) Crashed, and says so.
    read_back = ("import json\nfrom prefect import get_client\n"
                 "from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags\n"
                 "from flows.pipeline import LOCAL_RUN_TAG, local_run_settings\n"
                 "with local_run_settings(), get_client(sync_client=True) as client:\n"
                 "    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[LOCAL_RUN_TAG])))\n"
                 "print(json.dumps([[run.name, run.state.type.value, run.state.message] for run in runs]))\n")
    after = subprocess.run([sys.executable, "-c", read_back], capture_output=True, text=True, timeout=300,
                           env=prefect_environment(tmp_path / "prefect-home"))
    assert after.returncode == 0, after.stderr[-3000:]
    runs = json.loads(after.stdout.splitlines()[-1])
    crashed = [run for run in runs if run[1] != "COMPLETED"]
    assert [state for _, state, _ in crashed] == ["CRASHED", "CRASHED"] and len(runs) > 2, runs
    assert all("ended without recording an end (SIGKILL, out of memory)" in message for _, _, message in crashed)
    assert "marked Crashed 2 flow run(s) that a moplex process on this PREFECT_HOME left" in after.stderr


def test_only_the_runs_of_ended_processes_are_marked_crashed(prefect_env):
    from prefect import flow, get_client
    from prefect.states import Completed, Running

    from flows.pipeline import LOCAL_RUN_TAG, OWNER_TAG, crash_runs_of_ended_processes
    from moplex_core.processes import process_identity, process_running

    ended = subprocess.Popen(["true"])
    ended.wait()

    @flow(name="moplex-test-left-running")
    def left_running() -> None:
        pass

    owners = {"ended": process_identity(ended.pid), "alive": process_identity(), "elsewhere": "another-host/1/1"}
    with get_client(sync_client=True) as client:
        runs = {name: client.create_flow_run(left_running, tags=[LOCAL_RUN_TAG, OWNER_TAG + owner], state=Running())
                for name, owner in owners.items()}
        runs["not local"] = client.create_flow_run(left_running, tags=[OWNER_TAG + owners["ended"]], state=Running())
        marked = crash_runs_of_ended_processes()
        states = {name: client.read_flow_run(run.id).state for name, run in runs.items()}
        for run in runs.values():  # nothing left Running for the session's other tests
            client.set_flow_run_state(run.id, Completed(), force=True)
    assert marked == [f"{runs['ended'].name} ({runs['ended'].id})"]
    assert {name: state.type.value for name, state in states.items()} == \
        {"ended": "CRASHED", "alive": "RUNNING", "elsewhere": "RUNNING", "not local": "RUNNING"}
    assert f"its process ({owners['ended']}) ended without recording an end" in states["ended"].message
    # a process is its pid and its start: a later process given the same pid is not the one that ran
    host, pid, start = process_identity().split("/")
    assert process_running(f"{host}/{pid}/{start}") is True and process_running(f"{host}/{pid}/{int(start) + 1}") is False


def test_the_pipeline_stops_right_after_ingest_when_a_split_it_needs_is_empty(prefect_env, tmp_path, fixtures_dir):
    # 15 UltraFeedback rankings split by prompt leave 'test' empty: found before any model work, not by
    # the evaluate stage after training.
    from flows.pipeline import moplex_pipeline
    from moplex_core.config import pipeline_preset, with_overrides

    config = with_overrides(pipeline_preset("ultrafeedback-paper"), [
        f"root={tmp_path}", f"ingest.path={fixtures_dir / 'ultrafeedback.jsonl'}", "ingest.split.sizes=null"])
    state = moplex_pipeline(config=config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"have none of split\(s\) \['test'\] \(\{'train': 11, 'validation': 4\}\)"):
        state.result()
    assert [p.name for p in tmp_path.iterdir()] == ["ingest"]


@pytest.mark.slow  # ~16 s: Prefect tries the address for a while before it gives up
def test_a_prefect_server_that_does_not_answer_is_one_line_saying_what_to_do(tmp_path):
    """PREFECT_API_URL left pointing at a server that is not running (`prefect config set` is saved in
    the profile, so a later `make demo` meets it): one line, not Prefect's chained tracebacks."""
    import socket
    import subprocess

    with socket.socket() as probe:  # a port nothing listens on: bound, not listening, so no server takes it meanwhile
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        env = prefect_environment(tmp_path / "prefect-home", PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
        run = subprocess.run([sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo", "--root",
                              str(tmp_path / "artifacts")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"no Prefect server answers at http://127.0.0.1:{port}/api (PREFECT_API_URL)" in run.stderr
    assert f"`prefect server start --port {port}`" in run.stderr  # the port the URL names, not 4200
    assert "prefect config unset PREFECT_API_URL" in run.stderr


def test_a_fault_in_a_run_without_a_deployment_names_the_retry_command_that_works(prefect_env, tmp_path):
    # `prefect flow-run retry ID` alone refuses a run that has no deployment: it needs the entrypoint.
    from flows.pipeline import moplex_pipeline
    from moplex_core.config import pipeline_preset, with_overrides
    from tasks.pipeline import InjectedFault

    config = with_overrides(pipeline_preset("synthetic-demo"), [f"root={tmp_path}", "fault.stage=ingest"])
    state = moplex_pipeline(config=config, return_state=True)
    with pytest.raises(InjectedFault) as err:
        state.result()
    entrypoint = f"--entrypoint {Path('flows/pipeline.py').resolve()}:moplex_pipeline"
    assert (f"(CLI: PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 prefect flow-run retry {state.state_details.flow_run_id} "
            f"{entrypoint})") in str(err.value)  # the heartbeat `moplex run` sets: the automation's window is 90 s
    assert "UI: Retry" not in str(err.value)  # no deployment: no worker would take a retry pressed in the UI


@pytest.mark.timeout(120)
def test_the_moplex_command_stops_on_sigterm_as_on_ctrl_c_and_leaves_an_ignored_sighup_ignored(tmp_path):
    # A long study; its progress bar on stderr says it has started. nohup ignores SIGHUP before it starts.
    command = [sys.executable, "-m", "moplex_core.cli", "experiment", "identifiability", "--out", str(tmp_path),
               "--n", "100000", "--n-test", "1000", "--k", "2", "--m", "4", "--seeds", "1", "--restarts", "1"]
    study = subprocess.Popen(_as_from_a_terminal(command, ignoring=(signal.SIGHUP,)), stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        while "identifiability:" not in said and study.poll() is None:  # its progress bar: running
            said += study.stderr.read(1)
        study.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            study.wait(timeout=1)  # still running
        study.send_signal(signal.SIGTERM)
        assert study.wait(timeout=60) == 128 + signal.SIGTERM
        assert "moplex experiment identifiability: interrupted. Nothing was written" in study.stderr.read()
    finally:
        study.kill()
        study.wait()
        study.stderr.close()


def test_the_report_artifact_inlines_only_the_plots_its_evaluate_version_lists(tmp_path):
    # report.md of an evaluate version from elsewhere (or a label in it) may name any "plots/....png": the
    # Prefect artifact must not carry a file from outside the version, nor fail on one that is not there.
    evaluation = tmp_path / "root" / "evaluate" / "0123456789ab"
    (evaluation / "plots").mkdir(parents=True)
    (evaluation / "plots" / "em_log_likelihood.png").write_bytes(b"the plot")
    (tmp_path / "secret.png").write_bytes(b"a file of the machine's")
    (evaluation / "report.md").write_text("![EM](plots/em_log_likelihood.png)\n| ![x](plots/../../../../secret.png) |\n"
                                          "![gone](plots/missing.png)\n")
    embedded = _embed_plots(evaluation, {"report.md": {}, "plots/em_log_likelihood.png": {}})
    assert embedded.splitlines() == ["![EM](data:image/png;base64,dGhlIHBsb3Q=)",
                                     "| ![x](plots/../../../../secret.png) |", "![gone](plots/missing.png)"]
