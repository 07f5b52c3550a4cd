"""A real Prefect server for the tests that run the pipeline as users deploy it (test_deployment,
test_zombie_runs): a private PREFECT_HOME, Prefect's own server, worker and CLI in subprocesses, and
the REST API to watch them. Every process a test starts is registered with the fixture, which stops
it (by its PID, with its process group), also on failure. A flow-run process has a session of its
own (Prefect 3.8.8's process worker starts it so): a stopping worker ends it, and a test that kills
the worker kills that process by the run's infrastructure_pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
RETRY_STATUSES = (429, 502, 503)


def prefect_environment(home: Path, **settings: str) -> dict[str, str]:
    """This process's environment for a Prefect subprocess of a test's own: without the tests' PREFECT_*
    settings, ``home`` as PREFECT_HOME, no analytics, the hub offline, then ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", **settings)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str], list[subprocess.Popen]]]:
    """(api url, environment for Prefect subprocesses, list to register started processes in)."""
    env = prefect_environment(tmp_path / "prefect-home", PREFECT_WORKER_QUERY_SECONDS="2", OMP_NUM_THREADS="1")
    started: list[subprocess.Popen] = []
    try:
        # Another process may take the free port before the server binds it; the server then exits (and
        # the other one may answer meanwhile: ours is known by its PREFECT_HOME), and starts on another.
        for _ in range(3):
            port = free_port()
            api = env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
            started.append(start([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                                  tmp_path / "server.log"))
            deadline = time.monotonic() + 150
            while started[-1].poll() is None and not serves(api, env["PREFECT_HOME"]) and time.monotonic() < deadline:
                time.sleep(1)
            if started[-1].poll() is None:
                break
        if started[-1].poll() is not None or not serves(api, env["PREFECT_HOME"]):
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


class RetryingTransport(httpx.HTTPTransport):
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


def start(command: list[str], env: dict[str, str] | None, log: Path) -> subprocess.Popen:
    """``command`` in the repository, in a session of its own, its output and errors into ``log``
    (``env`` None: this process's environment)."""
    with log.open("w") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def cli(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([*PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def serves(api: str, home: str) -> bool:
    """Whether the Prefect server with PREFECT_HOME ``home`` answers at ``api``."""
    try:
        answer = httpx.get(f"{api}/admin/settings", timeout=2)
        return answer.status_code == 200 and answer.json()["home"] == home
    except httpx.HTTPError:
        return False


def wait_for_end(client: httpx.Client, run_id: str, tmp_path: Path, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.get(f"/flow_runs/{run_id}").raise_for_status().json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(2)
    pytest.fail(f"flow run {run_id} did not finish in {timeout} s; worker log:\n"
                f"{(tmp_path / 'worker.log').read_text()[-4000:]}")


def log_tails(tmp_path: Path) -> str:
    """The ends of the worker's and `moplex run`'s logs, those there are."""
    return "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in (tmp_path / "worker.log",
                                                                          tmp_path / "moplex-run.log") if log.exists())
