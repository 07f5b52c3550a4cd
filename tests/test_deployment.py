"""The pipeline as users run it: a real Prefect server (prefect_server_fixtures), process work pools,
`prefect deploy --all` from prefect.yaml, a worker, a deployment run, a failure on purpose and a retry
of that flow run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from prefect_server_fixtures import PREFECT, RetryingTransport, cli, prefect_server, start, wait_for_end  # noqa: F401

SMALL = ["ingest.synthetic.n=60", "train.em_iterations=2", "train.first_epochs=1", "tiny_model.pretrain_steps=20",
         "stage_retries=0"]
EARLY_STAGES = ("ingest", "model", "augment", "cache")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_deployed_pipeline_runs_fails_on_purpose_and_a_retry_reuses_finished_stages(prefect_server, tmp_path):
    api, env, started = prefect_server
    root = tmp_path / "artifacts"
    for pool in ("cpu", "gpu"):
        cli(["work-pool", "create", pool, "--type", "process"], env)
    cli(["--no-prompt", "deploy", "--all"], env)
    started.append(start([*PREFECT, "worker", "start", "--pool", "cpu", "--type", "process"], env,
                          tmp_path / "worker.log"))

    with httpx.Client(base_url=api, timeout=30, transport=RetryingTransport()) as client:
        deployment = client.get("/deployments/name/moplex-pipeline/synthetic-demo").raise_for_status().json()
        # max_response_tokens=4 cuts responses: the cache's warning must reach the server's log (the
        # deployments' PREFECT_LOGGING_EXTRA_LOGGERS), once
        overrides = [*SMALL, f"root={root}", "fault.stage=train", "cache.max_response_tokens=4"]
        run = client.post(f"/deployments/{deployment['id']}/create_flow_run",  # a key: a retried POST makes one run
                          json={"parameters": {"preset": "synthetic-demo", "overrides": overrides},
                                "idempotency_key": "pipeline"}).raise_for_status().json()

        failed = wait_for_end(client, run["id"], tmp_path)
        assert failed["state"]["type"] == "FAILED", failed["state"]
        assert "fails on purpose" in failed["state"]["message"] or _task_failed(client, run["id"], "injected-fault")
        finished = {stage: _manifest(root, stage) for stage in EARLY_STAGES}
        assert not (root / "train").exists()

        cli(["flow-run", "retry", run["id"]], env)
        retried = wait_for_end(client, run["id"], tmp_path)
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
        deployment = client.get("/deployments/name/moplex-ingest/ingest").raise_for_status().json()
        run = client.post(f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {
            "config": {"dataset": "synthetic", "synthetic": {"n": 30}}, "root": str(tmp_path / "alone")},
            "idempotency_key": "ingest"}).raise_for_status().json()
        assert wait_for_end(client, run["id"], tmp_path)["state"]["type"] == "COMPLETED"
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


def _task_failed(client: httpx.Client, run_id: str, name: str) -> bool:
    tasks = client.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}).raise_for_status().json()
    return any(t["name"].startswith(name) and t["state"]["type"] == "FAILED" for t in tasks)


def _manifest(root: Path, stage: str) -> tuple[Path, dict, int]:
    """The one complete version of ``stage`` under ``root``: (folder, manifest, manifest mtime in ns)."""
    versions = [p for p in (root / stage).iterdir() if (p / "manifest.json").is_file()]
    assert len(versions) == 1, f"{stage}: expected one complete version, found {versions}"
    path = versions[0] / "manifest.json"
    return versions[0], json.loads(path.read_text()), path.stat().st_mtime_ns
