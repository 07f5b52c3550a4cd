"""A local stand-in for the Hugging Face hub's HTTP API, for probes that run the real huggingface_hub,
datasets and transformers in a child process (they read HF_ENDPOINT when imported): `run_probe`
runs a probe's code with this module importable, `serve` answers each request as the probe says."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

Answer = tuple[int, dict[str, str], dict[str, Any]]  # status, headers, JSON body

NOT_FOUND: Answer = (404, {"X-Error-Code": "RepoNotFound"}, {"error": "Repository not found"})  # as huggingface.co says it
# as a busy server may say it: huggingface_hub then waits 1 s a retry, not 1 + 2 + 4 + 8 + 8 s
BUSY: Answer = (503, {"Retry-After": "0"}, {"error": "Service unavailable"})


def serve(answer: Callable[[str], Answer]) -> str:
    """Answer every GET and HEAD with ``answer(path)`` (its query left out) on a free port of
    127.0.0.1, from a daemon thread; returns the endpoint."""

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, headers, body = answer(self.path.split("?")[0])
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {**headers, "Content-Type": "application/json", "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def closed_endpoint() -> str:
    """An endpoint on a port nothing listens on: a hub that does not answer at all."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.server_close()
    return f"http://127.0.0.1:{server.server_address[1]}"


def use(endpoint: str, home: str, offline: bool = False) -> None:
    """Point huggingface_hub (and datasets) at ``endpoint``, with its cache under ``home``; call it
    before they are imported."""
    flag = "1" if offline else "0"
    os.environ.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE=flag, HF_DATASETS_OFFLINE=flag, HF_HOME=home,
                      HF_HUB_DISABLE_TELEMETRY="1")


def run_probe(code: str, *args: str) -> list[Any]:
    """Run ``code`` in a child process of this interpreter (with the repository and this folder
    importable, argv ``args``) and return the JSON value of each line it prints."""
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=tests.parent, env={**os.environ, "PYTHONPATH": f"{tests.parent}{os.pathsep}{tests}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]
