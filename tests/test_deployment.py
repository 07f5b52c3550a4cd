"""The pipeline as users run it: a real Prefect server, process work pools, `prefect deploy --all`
from prefect.yaml, a worker, a deployment run, a failure on purpose and a retry of that flow run.

Everything runs in subprocesses against a private PREFECT_HOME, so the server and the worker are
Prefect's own; the test talks to the server's REST API and stops every process it started (by its
PID, with its process group), also on failure. A flow-run process has a session of its own (Prefect
3.8.8's process worker starts it so): a stopping worker ends it, and a test that kills the worker
kills that process by the run's infrastructure_pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
SMALL = ["ingest.synthetic.n=60", "train.em_iterations=2", "train.first_epochs=1", "tiny_model.pretrain_steps=20",
         "stage_retries=0"]
EARLY_STAGES = ("ingest", "model", "augment", "cache")
RETRY_STATUSES = (429, 502, 503)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str], list[subprocess.Popen]]]:
    """(api url, environment for Prefect subprocesses, list to register started processes in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    })
    started: list[subprocess.Popen] = []
    try:
        # Another process may take the free port before the server binds it; the server then exits (and
        # the other one may answer meanwhile: ours is known by its PREFECT_HOME), and starts on another.
        for _ in range(3):
            port = _free_port()
            api = env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
            started.append(_start([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                                  tmp_path / "server.log"))
            deadline = time.monotonic() + 150
            while started[-1].poll() is None and not _serves(api, env["PREFECT_HOME"]) and time.monotonic() < deadline:
                time.sleep(1)
            if started[-1].poll() is None:
                break
        if started[-1].poll() is not None or not _serves(api, env["PREFECT_HOME"]):
            pytest.fail(f"the Prefect server did not come up:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
        yield api, env, started
    finally:
        for process in reversed(started):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: the worker waits out SIGTERM for 20 s
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def test_deployed_pipeline_runs_fails_on_purpose_and_a_retry_reuses_finished_stages(prefect_server, tmp_path):
    api, env, started = prefect_server
    root = tmp_path / "artifacts"
    for pool in ("cpu", "gpu"):
        _cli(["work-pool", "create", pool, "--type", "process"], env)
    _cli(["--no-prompt", "deploy", "--all"], env)
    started.append(_start([*PREFECT, "worker", "start", "--pool", "cpu", "--type", "process"], env,
                          tmp_path / "worker.log"))

    with httpx.Client(base_url=api, timeout=30, transport=_RetryingTransport()) as client:
        deployment = client.get("/deployments/name/moplex-pipeline/synthetic-demo").raise_for_status().json()
        # max_response_tokens=4 cuts responses: the cache's warning must reach the server's log (the
        # deployments' PREFECT_LOGGING_EXTRA_LOGGERS), once
        overrides = [*SMALL, f"root={root}", "fault.stage=train", "cache.max_response_tokens=4"]
        run = client.post(f"/deployments/{deployment['id']}/create_flow_run",  # a key: a retried POST makes one run
                          json={"parameters": {"preset": "synthetic-demo", "overrides": overrides},
                                "idempotency_key": "pipeline"}).raise_for_status().json()

        failed = _wait_for_end(client, run["id"], tmp_path)
        assert failed["state"]["type"] == "FAILED", failed["state"]
        assert "fails on purpose" in failed["state"]["message"] or _task_failed(client, run["id"], "injected-fault")
        finished = {stage: _manifest(root, stage) for stage in EARLY_STAGES}
        assert not (root / "train").exists()

        _cli(["flow-run", "retry", run["id"]], env)
        retried = _wait_for_end(client, run["id"], tmp_path)
        assert retried["state"]["type"] == "COMPLETED", retried["state"]
        assert retried["run_count"] == 2

        # the retry reused what the failed attempt finished: same versions, manifests untouched
        for stage, (path, manifest, mtime) in finished.items():
            again = _manifest(root, stage)
            assert again[0] == path and again[1]["finished"] == manifest["finished"] and again[2] == mtime, stage
        evaluation = _manifest(root, "evaluate")[0]
        metrics = pd.read_parquet(evaluation / "metrics.parquet")
        assert list(metrics.columns) == ["method", "split", "metric", "cluster", "value", "seed"]
        assert {"clustering_accuracy", "ranking_accuracy_posterior", "ranking_accuracy_oracle",
                "ranking_accuracy_marginal", "heldout_log_likelihood"} <= set(metrics.metric)
        assert (evaluation / "report.md").is_file() and list((evaluation / "plots").glob("*.png"))

        artifacts = client.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
                                ).raise_for_status().json()
        by_key = {a["key"]: a for a in artifacts if a["key"]}
        assert {"moplex-stages", "moplex-metrics", "moplex-report"} <= set(by_key)
        stages = json.loads(by_key["moplex-stages"]["data"])
        assert [row["stage"] for row in stages] == [*EARLY_STAGES, "train", "evaluate"]
        assert {row["stage"]: row["rows"] for row in stages}["ingest"] == 60
        # the retry found what the failed attempt finished and wrote the rest
        assert {row["stage"]: row["this run"] for row in stages} == {
            **{stage: "reused" for stage in EARLY_STAGES}, "train": "wrote", "evaluate": "wrote"}
        # each stage's flow run is named after its version; the pipeline's own log names every version
        refs = {f"{stage}/{_manifest(root, stage)[0].name}" for stage in (*EARLY_STAGES, "train", "evaluate")}
        names = {r["name"] for r in client.post("/flow_runs/filter", json={"limit": 50}).raise_for_status().json()}
        assert refs <= names, names
        train_ref = f"train/{_manifest(root, 'train')[0].name}"
        deadline = time.monotonic() + 60  # the run's process sends its logs in batches, after its state
        while True:
            lines = [log["message"] for log in client.post("/logs/filter", json={
                "logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200}).raise_for_status().json()]
            if any(line.startswith(f"train stage: {train_ref} written by this run") for line in lines) \
                    or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert any(line.startswith(f"train stage: {train_ref} written by this run at ") for line in lines), lines
        assert any(line.startswith("ingest stage: ingest/") and " reused (complete since " in line for line in lines)
        assert "data:image/png;base64," in by_key["moplex-report"]["data"]
        files = by_key["moplex-files"]["data"]
        assert f"| evaluate | {evaluation.name} | `{evaluation / 'metrics.parquet'}` |" in files
        assert f"moplex inspect {evaluation}" in files

        warnings = client.post("/logs/filter", json={"logs": {"level": {"ge_": 30}}, "limit": 200}).raise_for_status().json()
        truncation = [w for w in warnings if "longer than cache.max_response_tokens = 4" in w["message"]]
        assert len(truncation) == 1 and truncation[0]["flow_run_id"], [w["message"][:80] for w in warnings]

        # a stage's own deployment: the worker loads flows/ingest.py as a script, and moplex_core's INFO
        # lines (what it wrote, a resume, a wait for a lock) still reach the run's log
        deployment = client.get("/deployments/name/ingest/ingest").raise_for_status().json()
        run = client.post(f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {
            "config": {"dataset": "synthetic", "synthetic": {"n": 30}}, "root": str(tmp_path / "alone")},
            "idempotency_key": "ingest"}).raise_for_status().json()
        assert _wait_for_end(client, run["id"], tmp_path)["state"]["type"] == "COMPLETED"
        deadline = time.monotonic() + 60  # the run's process sends its logs in batches, after its state
        while True:
            logs = client.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200}
                               ).raise_for_status().json()
            wrote = any(log["name"] == "moplex_core.ingest" and log["message"].startswith("wrote 30 rankings")
                        for log in logs)
            # the flow run's own last line (its tasks log one too, possibly before the line looked for)
            finished = any(log["task_run_id"] is None and "Finished in state Completed" in log["message"]
                           for log in logs)
            if wrote or finished or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert wrote, [(log["name"], log["message"][:60]) for log in logs]


def test_runs_killed_without_a_word_are_marked_crashed_by_the_heartbeat_automation(prefect_server, tmp_path):
    """Three pipeline runs die in their model stage (a subflow, in the run's process): a deployed one as
    the OOM killer kills, its flow-run process alone; a deployed one as a lost machine does, the
    process and the worker; and a `moplex run` against the server. The worker reports the first
    pipeline run Crashed itself (its process ended with -9); the stage in it, and all of the other two,
    nothing reports: prefect-automations.yaml marks them Crashed when their heartbeats stop, which
    prefect.yaml's job variables and `moplex run` send every 30 s. Another project's flow run on the same
    server, alive with Prefect's default 180 s heartbeats, is left alone: the automation watches moplex's
    flows only."""
    api, env, started = prefect_server
    automation_file = REPO / "prefect-automations.yaml"
    automation = yaml.safe_load(automation_file.read_text())
    window = automation["trigger"]["within"]
    heartbeat = int(yaml.safe_load((REPO / "prefect.yaml").read_text())["definitions"]["env"][
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
    assert window >= 3 * heartbeat  # Prefect's advice: a late heartbeat is not taken for a death
    _cli(["automation", "create", "--from-file", str(automation_file)], env)
    _cli(["work-pool", "create", "cpu", "--type", "process"], env)
    _cli(["--no-prompt", "deploy", "--name", "synthetic-demo"], env)
    worker = _start([*PREFECT, "worker", "start", "--pool", "cpu", "--type", "process"], env, tmp_path / "worker.log")
    started.append(worker)
    # a model stage that would pretrain for hours
    overrides = ["ingest.synthetic.n=60", "tiny_model.pretrain_steps=1000000"]
    moplex_run = _start([sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo", "--root",
                         str(tmp_path / "moplex-run"), *(f"--set={o}" for o in overrides)], env,
                        tmp_path / "moplex-run.log")
    started.append(moplex_run)
    other_project = _start([sys.executable, "-c", OTHER_PROJECT], {**env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "180"},
                           tmp_path / "other-project.log")
    started.append(other_project)

    runs: dict[str, str] = {}
    with httpx.Client(base_url=api, timeout=30, transport=_RetryingTransport()) as client:
        try:
            deployment = client.get("/deployments/name/moplex-pipeline/synthetic-demo").raise_for_status().json()
            for case in ("oom", "lost"):
                runs[case] = client.post(f"/deployments/{deployment['id']}/create_flow_run", json={
                    "parameters": {"preset": "synthetic-demo", "overrides": [f"root={tmp_path / case}", *overrides]},
                    "idempotency_key": case}).raise_for_status().json()["id"]
            runs["moplex run"] = _run_without_deployment(client, tmp_path)
            other = _wait_for_running(client, "other-project", tmp_path)
            other_started = time.monotonic()
            stages = {case: _stage_sending_heartbeats(client, run, "model/", tmp_path) for case, run in runs.items()}
            for case in ("lost", "moplex run"):  # a live run is not taken for a dead one
                beats = _wait_for_heartbeats(client, runs[case], 2, tmp_path)
                assert (beats[1] - beats[0]).total_seconds() < window, (case, beats)
            pids = {case: int(client.get(f"/flow_runs/{runs[case]}").raise_for_status().json()["infrastructure_pid"])
                    for case in ("oom", "lost")}

            os.kill(pids["oom"], signal.SIGKILL)
            oom = _wait_for_end(client, runs["oom"], tmp_path, timeout=120)
            assert oom["state"]["type"] == "CRASHED" and "status code: -9" in oom["state"]["message"], oom["state"]
            os.kill(worker.pid, signal.SIGKILL)  # the flow-run process has a session of its own: killed apart
            os.kill(pids["lost"], signal.SIGKILL)
            os.kill(moplex_run.pid, signal.SIGKILL)
            for run in (stages["oom"], runs["lost"], stages["lost"], runs["moplex run"], stages["moplex run"]):
                dead = _wait_for_end(client, run, tmp_path, timeout=window + 120)
                assert dead["state"]["type"] == "CRASHED", dead["state"]
                assert dead["state"]["message"] == automation["actions"][0]["message"]
            time.sleep(max(0.0, other_started + window + 15 - time.monotonic()))  # past its first heartbeat's window
            alive = client.get(f"/flow_runs/{other}").raise_for_status().json()["state"]
            assert alive["type"] == "RUNNING", alive
        finally:  # flow-run processes are in sessions of their own: the fixture's group signals miss them
            for case in ("oom", "lost"):
                with contextlib.suppress(KeyError, httpx.HTTPError, TypeError, ProcessLookupError):
                    os.kill(int(client.get(f"/flow_runs/{runs[case]}").json()["infrastructure_pid"]), signal.SIGKILL)


# A flow of another project on the same server: alive for 15 minutes, a heartbeat every 180 s (Prefect's default).
OTHER_PROJECT = """
import time
from prefect import flow

@flow(name="other-project")
def other_project():
    time.sleep(900)

other_project()
"""


def _wait_for_running(client: httpx.Client, flow_name: str, tmp_path: Path) -> str:
    """The id of the flow run of the flow named ``flow_name``, once it is Running."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = client.post("/flow_runs/filter", json={"flows": {"name": {"any_": [flow_name]}}})
        runs = runs.raise_for_status().json()
        if runs and runs[0]["state"]["type"] == "RUNNING":
            return runs[0]["id"]
        time.sleep(1)
    pytest.fail(f"no Running flow run of {flow_name} in 120 s:\n{(tmp_path / f'{flow_name}.log').read_text()[-2000:]}")


def _run_without_deployment(client: httpx.Client, tmp_path: Path) -> str:
    """The id of the one top-level pipeline run without a deployment (`moplex run`'s), once it exists."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = client.post("/flow_runs/filter", json={"flows": {"name": {"any_": ["moplex-pipeline"]}}, "flow_runs": {
            "deployment_id": {"is_null_": True}, "parent_task_run_id": {"is_null_": True}}}).raise_for_status().json()
        if runs:
            assert len(runs) == 1, [run["name"] for run in runs]
            return runs[0]["id"]
        time.sleep(2)
    pytest.fail(f"`moplex run` started no flow run in 300 s:\n{_log_tails(tmp_path)}")


class _RetryingTransport(httpx.HTTPTransport):
    """Sends a request again when the server answers 429, 502 or 503, as Prefect's own client does: the
    server answers 503 to errors a client may retry on, such as its SQLite database being locked by a
    write of its services or the worker's on a busy machine (seen once in CI on create_flow_run)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in (1, 2, 4, 8, 16):
            response = super().handle_request(request)
            if response.status_code not in RETRY_STATUSES:
                return response
            response.close()
            time.sleep(delay)
        return super().handle_request(request)


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _cli(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([*PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _serves(api: str, home: str) -> bool:
    """Whether the Prefect server with PREFECT_HOME ``home`` answers at ``api``."""
    try:
        answer = httpx.get(f"{api}/admin/settings", timeout=2)
        return answer.status_code == 200 and answer.json()["home"] == home
    except httpx.HTTPError:
        return False


def _wait_for_end(client: httpx.Client, run_id: str, tmp_path: Path, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.get(f"/flow_runs/{run_id}").raise_for_status().json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(2)
    pytest.fail(f"flow run {run_id} did not finish in {timeout} s; worker log:\n"
                f"{(tmp_path / 'worker.log').read_text()[-4000:]}")


def _stage_sending_heartbeats(client: httpx.Client, run_id: str, prefix: str, tmp_path: Path) -> str:
    """The id of the subflow run of ``run_id`` whose name starts with ``prefix``, once it is running
    and the server has its first heartbeat."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        subflows = client.post("/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}}
                               ).raise_for_status().json()
        for run in subflows:
            if run["name"].startswith(prefix) and run["state"]["type"] == "RUNNING" and _heartbeats(client, run["id"]):
                return run["id"]
        time.sleep(2)
    pytest.fail(f"no {prefix} subflow of {run_id} sent a heartbeat in 300 s:\n{_log_tails(tmp_path)}")


def _heartbeats(client: httpx.Client, run_id: str) -> list[datetime]:
    """When the flow run ``run_id`` sent the heartbeats the server has, in order."""
    events = client.post("/events/filter", json={"filter": {
        "event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]},
        "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}).raise_for_status().json()["events"]
    return sorted(datetime.fromisoformat(event["occurred"]) for event in events)


def _wait_for_heartbeats(client: httpx.Client, run_id: str, count: int, tmp_path: Path) -> list[datetime]:
    """`_heartbeats` of ``run_id`` once the server has ``count`` of them (up to 120 s)."""
    deadline = time.monotonic() + 120
    while len(beats := _heartbeats(client, run_id)) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"flow run {run_id} sent {len(beats)} heartbeats in 120 s, not {count}:\n{_log_tails(tmp_path)}")
        time.sleep(2)
    return beats


def _log_tails(tmp_path: Path) -> str:
    """The ends of the worker's and `moplex run`'s logs, those there are."""
    return "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in (tmp_path / "worker.log",
                                                                          tmp_path / "moplex-run.log") if log.exists())


def _task_failed(client: httpx.Client, run_id: str, name: str) -> bool:
    tasks = client.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}).raise_for_status().json()
    return any(t["name"].startswith(name) and t["state"]["type"] == "FAILED" for t in tasks)


def _manifest(root: Path, stage: str) -> tuple[Path, dict, int]:
    """The one complete version of ``stage`` under ``root``: (folder, manifest, manifest mtime in ns)."""
    versions = [p for p in (root / stage).iterdir() if (p / "manifest.json").is_file()]
    assert len(versions) == 1, f"{stage}: expected one complete version, found {versions}"
    path = versions[0] / "manifest.json"
    return versions[0], json.loads(path.read_text()), path.stat().st_mtime_ns
