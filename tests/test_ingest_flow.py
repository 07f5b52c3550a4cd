"""The ingest stage end to end: core, CLI, and the Prefect flow on the ephemeral local server."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moplex_core.artifacts import ArtifactStore, load_table
from moplex_core.cli import main
from moplex_core.config import IngestConfig
from moplex_core.ingest import STAGE, plan_ingest, run_ingest
from moplex_core.schema import REJECTED_SCHEMA, SchemaError

BAD_GENERIC = [
    '{"prompt": "Good?", "responses": ["yes", "no"], "ranking": [[0], [1]], "cluster": "a"}',
    '{"prompt": "Partition?", "responses": ["x", "y", "z"], "ranking": [[0], [1]], "cluster": "a"}',
    '{"prompt": "Empty?", "responses": ["x", "  "], "ranking": [[0], [1]], "cluster": "a"}',
    '{"prompt": "Label?", "responses": ["x", "y"], "ranking": [[1], [0]], "cluster": "zzz"}',
    '{"prompt": "Also good?", "responses": ["x", "y"], "ranking": [[1, 0]], "cluster": "a"}',
]


def test_a_second_run_with_the_same_config_does_nothing(tmp_path, fixtures_dir):
    store = ArtifactStore(tmp_path / "artifacts")
    config = IngestConfig(dataset="ultrafeedback", path=str(fixtures_dir / "ultrafeedback.jsonl"))
    first = run_ingest(config, store)
    assert first.built and first.rows == 15 and first.path == store.path(STAGE, first.ref.version)
    manifest = store.manifest(STAGE, first.ref.version)
    assert manifest["inputs"]["source"].startswith("sha256:") and manifest["config"]["path"] == config.path
    assert manifest["summary"]["rows_per_cluster"]["truthfulness"] == 3
    second = run_ingest(config, store)
    assert not second.built and second.ref == first.ref and second.rows == 15
    assert store.manifest(STAGE, first.ref.version)["finished"] == manifest["finished"]

    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(fixtures_dir / "ultrafeedback.jsonl", moved)
    assert plan_ingest(config.model_copy(update={"path": str(moved)}), store).complete  # content, not place
    assert run_ingest(IngestConfig(dataset="ultrafeedback", path=config.path, seed=1), store).ref != first.ref


def test_strict_mode_writes_nothing_when_a_row_is_bad(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(BAD_GENERIC) + "\n")
    store = ArtifactStore(tmp_path / "artifacts")
    config = IngestConfig(dataset="generic", path=str(source), labels=("a",))
    with pytest.raises(SchemaError, match="3 invalid row"):
        run_ingest(config, store)
    assert not (tmp_path / "artifacts").exists()


def test_the_summary_counts_unlabelled_rows_apart_from_a_label_named_none(tmp_path):
    source = tmp_path / "labels.jsonl"
    source.write_text("\n".join([
        '{"prompt": "One?", "responses": ["x", "y"], "ranking": [[0], [1]], "cluster": "None"}',
        '{"prompt": "Two?", "responses": ["x", "y"], "ranking": [[1], [0]]}',
        '{"prompt": "Three?", "responses": ["x", "y"], "ranking": [[1], [0]], "cluster": "a"}',
    ]) + "\n")
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_ingest(IngestConfig(dataset="generic", path=str(source), labels=("None", "a")), store)
    summary = store.manifest(STAGE, result.ref.version)["summary"]
    assert summary["rows_per_cluster"] == {"None": 1, "a": 1} and summary["unlabelled_rows"] == 1


def test_drop_mode_writes_valid_rows_and_rejected_parquet(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(BAD_GENERIC) + "\n")
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_ingest(IngestConfig(dataset="generic", path=str(source), labels=("a",), validation="drop"), store)
    assert result.rows == 2
    rejected = pq.read_table(result.path / "rejected.parquet")
    assert rejected.schema == REJECTED_SCHEMA
    assert sorted((r["row"], r["field"], r["where"]) for r in rejected.to_pylist()) == [
        (1, "ranking", "line 2"), (2, "responses", "line 3"), (3, "cluster", "line 4")
    ]  # the source file unnamed, as in the version: the same bytes wherever it lies and whatever its name
    assert not any(str(tmp_path) in (r["reason"] or "") for r in rejected.to_pylist())
    manifest = store.manifest(STAGE, result.ref.version)
    assert "rejected.parquet" in manifest["files"] and manifest["summary"]["rejected_rows"] == 3
    assert result.rejected == 3
    clean = tmp_path / "clean.jsonl"  # drop mode always lists what it set aside: none is an empty table
    clean.write_text("\n".join(line for i, line in enumerate(BAD_GENERIC) if i not in (1, 2, 3)) + "\n")
    kept = run_ingest(IngestConfig(dataset="generic", path=str(clean), labels=("a",), validation="drop"), store)
    assert kept.rejected == 0 and pq.read_table(kept.path / "rejected.parquet").num_rows == 0


def test_the_cli_says_how_many_rows_drop_mode_left_out(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(BAD_GENERIC) + "\n")
    argv = ["ingest", "--dataset", "generic", "--path", str(source), "--root", str(tmp_path / "artifacts"),
            "--set", 'labels=["a"]']
    assert main(argv) == 1
    assert "`moplex ingest ... --set validation=drop`" in capsys.readouterr().err  # the way out, as typed
    for done in ("wrote 2 rankings", "is already complete"):
        assert main([*argv, "--set", "validation=drop"]) == 0
        out = capsys.readouterr().out
        assert done in out and "3 source row(s) rejected, listed in rejected.parquet" in out


def test_cli_ingest_and_inspect(tmp_path, fixtures_dir, capsys):
    root = tmp_path / "artifacts"
    argv = ["ingest", "--dataset", "helpsteer2", "--path", str(fixtures_dir / "helpsteer2.jsonl"),
            "--root", str(root), "--set", "helpsteer2.min_gap=2", "--set", "split.fractions=[0.5,0.25,0.25]"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("ingest/") and "wrote" in out
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "is already complete" in out and "nothing to do" in out
    (version_dir,) = [p for p in (root / STAGE).iterdir() if p.is_dir()]
    assert main(["inspect", str(version_dir), "--rows", "1"]) == 0
    report = capsys.readouterr().out
    assert '"min_gap": 2' in report and "rows per cluster x split:" in report and "row 0:" in report
    assert main(["inspect", f"{STAGE}/{version_dir.name[:4]}", "--root", str(root), "--rows", "1"]) == 0
    assert capsys.readouterr().out == report  # stage/version under --root, as augment --rankings takes it
    assert main(["inspect", f"{STAGE}/ffffffff", "--root", str(root)]) == 1
    assert f"no artifact {STAGE}/ffffffff under {root}" in capsys.readouterr().err
    assert main(["inspect", STAGE, "--root", str(root)]) == 0  # a stage's name: its versions
    assert f"{STAGE}/{version_dir.name}" in capsys.readouterr().out
    assert main(["inspect", "--root", str(root)]) == 0  # no path: the root's listing
    assert f"artifacts under {root}" in capsys.readouterr().out
    (root / "notes.md").write_text("hello")
    assert main(["inspect", str(root / "notes.md")]) == 1
    assert "(it exists: open it with a viewer of its own kind)" in capsys.readouterr().err
    assert main(["ingest", "--dataset", "helpsteer2", "--set", "helpsteer2.typo=1", "--root", str(root)]) == 1
    assert "helpsteer2.typo" in capsys.readouterr().err
    assert main(["ingest", "--root", str(root)]) == 1
    assert "give --dataset NAME or --preset NAME" in capsys.readouterr().err
    assert main(["ingest", "--dataset", "generic", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "moplex ingest: invalid settings:\n  dataset 'generic' reads canonical Parquet/JSONL from a local path; " \
        "set path" in err and "pydantic" not in err


@pytest.mark.slow  # starts Prefect's ephemeral server: ~25 s on 2 cores
def test_ingest_flow_twice_on_the_local_prefect_server(prefect_env, tmp_path, fixtures_dir, caplog):
    from flows.ingest import ingest_flow

    root = str(tmp_path / "artifacts")
    config = IngestConfig(dataset="persona", path=str(fixtures_dir / "persona.jsonl"))
    # Prefect configures the root logger when imported, dropping pytest's handler; listen on its own
    # and on moplex_core's, whose INFO lines the flows let through (tasks/__init__.py).
    loggers = [logging.getLogger("prefect"), logging.getLogger("moplex_core")]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    try:
        first = ingest_flow(config, root=root)
        assert any(r.name == "moplex_core.ingest" and r.getMessage().startswith("wrote 7 rankings")
                   for r in caplog.records)
        caplog.clear()
        written = {p.name: p.stat().st_mtime_ns for p in Path(first).iterdir()}
        second = ingest_flow(config, root=root)
        assert "is already complete" in caplog.text and "nothing to do" in caplog.text
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in Path(first).iterdir()} == written  # nothing was written again
    assert load_table(first).to_pandas()["cluster"].nunique() == 4


def test_a_stage_run_is_named_after_its_version_and_a_run_of_its_own_publishes_it(prefect_env, tmp_path,
                                                                                  fixtures_dir):
    # Prefect names a flow run with two random words; the UI, `prefect flow-run ls` and the pipeline's
    # subflow list should say which stage and version a run is about. A stage's own run (a stage
    # deployment) shows its version in the run's Artifacts tab, as a pipeline run does for every stage.
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.ingest import ingest_flow

    config = IngestConfig(dataset="persona", path=str(fixtures_dir / "persona.jsonl"))
    ref = plan_ingest(config, ArtifactStore(tmp_path)).ref
    with get_client(sync_client=True) as client:
        for this_run in ("wrote", "reused"):
            state = ingest_flow(config, root=str(tmp_path), return_state=True)
            assert state.is_completed()
            run_id = state.state_details.flow_run_id
            assert client.read_flow_run(run_id).name == str(ref) == f"ingest/{ref.version}"
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            tables = [json.loads(a.data) for a in artifacts if a.type == "table"]
            assert [[(row["stage"], row["version"], row["this run"], row["rows"]) for row in table] for table in tables] \
                == [[("ingest", ref.version, this_run, 7)]]
            files = [a.data for a in artifacts if a.type == "markdown"]
            assert len(files) == 1 and f"`{tmp_path / 'ingest' / ref.version / 'part-00000.parquet'}`" in files[0]
            assert all(a.key is None for a in artifacts)  # the Artifacts page's latest moplex-stages stays a pipeline's


def test_a_stage_run_inside_another_flow_is_named_after_its_version_but_leaves_publishing_to_its_parent(
        prefect_env, tmp_path, fixtures_dir):
    # A pipeline's stage subflows: Prefect gives each a parent task run; their artifacts are the pipeline's to
    # publish (once, for every stage), so the subflow publishes none, but its run still names its version.
    from prefect import flow, get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.ingest import ingest_flow

    config = IngestConfig(dataset="persona", path=str(fixtures_dir / "persona.jsonl"))
    ref = plan_ingest(config, ArtifactStore(tmp_path)).ref

    @flow(name="parent-of-ingest")
    def parent() -> str:
        return ingest_flow(config, root=str(tmp_path), return_state=True).state_details.flow_run_id

    run_id = parent()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        assert run.parent_task_run_id is not None and run.name == str(ref)
        assert client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run_id]))) == []


def test_the_ingest_flow_warns_of_what_drop_mode_left_out_also_when_the_version_exists(prefect_env, tmp_path,
                                                                                    caplog):
    from flows.ingest import ingest_flow

    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(BAD_GENERIC) + "\n")
    config = IngestConfig(dataset="generic", path=str(source), labels=("a",), validation="drop")
    prefect_logger = logging.getLogger("prefect")
    prefect_logger.addHandler(caplog.handler)
    try:
        for _ in range(2):  # written, then found complete
            caplog.clear()
            path = ingest_flow(config, root=str(tmp_path / "artifacts"))
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert f"left out 3 source row(s) or record(s); each, with its reason and the record to fix, is in " \
                   f"{Path(path) / 'rejected.parquet'}" in "\n".join(warnings)
        caplog.clear()
        clean = tmp_path / "clean.jsonl"
        clean.write_text(BAD_GENERIC[0] + "\n")
        ingest_flow(config.model_copy(update={"path": str(clean)}), root=str(tmp_path / "artifacts"))
        assert "left out" not in caplog.text
    finally:
        prefect_logger.removeHandler(caplog.handler)


def test_moplex_runs_summary_says_what_drop_mode_left_out(tmp_path):
    from flows.pipeline import completed_run_summary

    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(BAD_GENERIC) + "\n")
    store = ArtifactStore(tmp_path / "artifacts")
    report = tmp_path / "report.md"
    report.write_text("# the report\n")
    for lines, said in ((BAD_GENERIC, True), (BAD_GENERIC[:1], False)):
        source.write_text("\n".join(lines) + "\n")
        config = IngestConfig(dataset="generic", path=str(source), labels=("a",), validation="drop")
        ingested = run_ingest(config, store).path
        dirs = {"ingest": str(ingested), "train": str(tmp_path / "train"), "report": str(report)}
        summary = completed_run_summary(dirs, str(store.root), "run-id")
        assert summary.startswith("# the report") and f"  ingest    {ingested}" in summary
        assert (f"left out 3 source row(s) or record(s); each, with its reason and the record to fix, is in "
                f"{ingested / 'rejected.parquet'}" in summary) is said
        assert ("left out" in summary) is said
        assert (f"--root {store.root}, then moplex assign {tmp_path / 'train'} ingest/<version>\n\nPrefect flow run "
                "run-id (stage versions, metrics, report and file paths under Artifacts):\n  ") in summary
