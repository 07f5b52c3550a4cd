"""Flow runs that die without a word (SIGKILL, the OOM killer, a lost machine) on a real Prefect server
(prefect_server_fixtures): the worker's report, and prefect-automations.yaml marking the rest Crashed
from their missing heartbeats (docs/reliability.md, "Runs that die without a word").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from prefect_server_fixtures import (PREFECT, REPO, RetryingTransport, cli, log_tails, prefect_server,  # noqa: F401
                                     start, wait_for_end)

from moplex_core.processes import FLOW_HEARTBEAT_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_runs_killed_without_a_word_are_marked_crashed_by_the_heartbeat_automation(prefect_server, tmp_path):
    """Three pipeline runs die in their model stage (a subflow, in the run's process): a deployed one as
    the OOM killer kills, its flow-run process alone; a deployed one as a lost machine does, the
    process and the worker; and a `moplex run` against the server. The worker reports the first
    pipeline run Crashed itself (its process ended with -9); the stage in it, and all of the other two,
    nothing reports: prefect-automations.yaml marks them Crashed when their heartbeats stop, which
    prefect.yaml's job variables and `moplex run` send every 30 s, so that the live runs are still
    Running a window after their first heartbeat. Another project's flow run on the same server, alive
    with Prefect's default 180 s heartbeats, is left alone: the automation watches moplex's flows only,
    by their names, moplex-..., and the other project's flow is called train, as moplex's train stage
    was (its live runs were marked Crashed then)."""
    api, env, started = prefect_server
    automation_file = REPO / "prefect-automations.yaml"
    automation = yaml.safe_load(automation_file.read_text())
    window = automation["trigger"]["within"]
    heartbeat = int(yaml.safe_load((REPO / "prefect.yaml").read_text())["definitions"]["env"][
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
    assert window >= 3 * heartbeat  # Prefect's advice: a late heartbeat is not taken for a death
    assert heartbeat == FLOW_HEARTBEAT_SECONDS  # what `moplex run` and its retry command set
    cli(["automation", "create", "--from-file", str(automation_file)], env)
    cli(["work-pool", "create", "cpu", "--type", "process"], env)
    cli(["--no-prompt", "deploy", "--name", "synthetic-demo"], env)
    worker = start([*PREFECT, "worker", "start", "--pool", "cpu", "--type", "process"], env, tmp_path / "worker.log")
    started.append(worker)
    # a model stage that would pretrain for hours
    overrides = ["ingest.synthetic.n=60", "tiny_model.pretrain_steps=1000000"]
    moplex_run = start([sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo", "--root",
                         str(tmp_path / "moplex-run"), *(f"--set={o}" for o in overrides)], env,
                        tmp_path / "moplex-run.log")
    started.append(moplex_run)
    other_project = start([sys.executable, "-c", OTHER_PROJECT], {**env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "180"},
                           tmp_path / "train.log")
    started.append(other_project)

    runs: dict[str, str] = {}
    with httpx.Client(base_url=api, timeout=30, transport=RetryingTransport()) as client:
        try:
            deployment = client.get("/deployments/name/moplex-pipeline/synthetic-demo").raise_for_status().json()
            for case in ("oom", "lost"):
                runs[case] = client.post(f"/deployments/{deployment['id']}/create_flow_run", json={
                    "parameters": {"preset": "synthetic-demo", "overrides": [f"root={tmp_path / case}", *overrides]},
                    "idempotency_key": case}).raise_for_status().json()["id"]
            runs["moplex run"] = _run_without_deployment(client, tmp_path)
            other = _wait_for_running(client, "train", tmp_path)
            other_started = time.monotonic()
            stages = {case: _stage_sending_heartbeats(client, run, "model/", tmp_path) for case, run in runs.items()}
            heartbeats_began = time.monotonic()  # every run and stage above has sent one by now
            pids = {case: int(client.get(f"/flow_runs/{runs[case]}").raise_for_status().json()["infrastructure_pid"])
                    for case in ("oom", "lost")}

            os.kill(pids["oom"], signal.SIGKILL)
            oom = wait_for_end(client, runs["oom"], tmp_path, timeout=120)
            assert oom["state"]["type"] == "CRASHED" and "status code: -9" in oom["state"]["message"], oom["state"]
            # a live run is not taken for a dead one: a window past their first heartbeats (with Prefect's 180 s
            # between two, the automation would have marked them Crashed by then), the live runs are Running,
            # the other project's too
            time.sleep(max(0.0, max(heartbeats_began, other_started) + window + 15 - time.monotonic()))
            for run in (runs["lost"], stages["lost"], runs["moplex run"], stages["moplex run"], other):
                alive = client.get(f"/flow_runs/{run}").raise_for_status().json()["state"]
                assert alive["type"] == "RUNNING", alive
            os.kill(worker.pid, signal.SIGKILL)  # the flow-run process has a session of its own: killed apart
            os.kill(pids["lost"], signal.SIGKILL)
            os.kill(moplex_run.pid, signal.SIGKILL)
            for run in (stages["oom"], runs["lost"], stages["lost"], runs["moplex run"], stages["moplex run"]):
                dead = wait_for_end(client, run, tmp_path, timeout=window + 120)
                assert dead["state"]["type"] == "CRASHED", dead["state"]
                assert dead["state"]["message"] == automation["actions"][0]["message"]
        finally:  # flow-run processes are in sessions of their own: the fixture's group signals miss them
            for case in ("oom", "lost"):
                with contextlib.suppress(KeyError, httpx.HTTPError, TypeError, ProcessLookupError):
                    os.kill(int(client.get(f"/flow_runs/{runs[case]}").json()["infrastructure_pid"]), signal.SIGKILL)


# A flow of another project on the same server: alive for 15 minutes, a heartbeat every 180 s (Prefect's default).
OTHER_PROJECT = """
import time
from prefect import flow

@flow(name="train")
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
    pytest.fail(f"`moplex run` started no flow run in 300 s:\n{log_tails(tmp_path)}")


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
    pytest.fail(f"no {prefix} subflow of {run_id} sent a heartbeat in 300 s:\n{log_tails(tmp_path)}")


def _heartbeats(client: httpx.Client, run_id: str) -> list[datetime]:
    """When the flow run ``run_id`` sent the heartbeats the server has, in order."""
    events = client.post("/events/filter", json={"filter": {
        "event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]},
        "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}).raise_for_status().json()["events"]
    return sorted(datetime.fromisoformat(event["occurred"]) for event in events)
