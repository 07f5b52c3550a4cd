"""The kill schedule (chaos.kills): one seed fixes the kill points, and every stage killed at the short
schedule's points reruns to the artifact of an uninterrupted run, reusing what was finished."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chaos.kills import compare_artifacts, kill_schedule, run_schedule
from moplex_core.artifacts import ArtifactStore, shard_name


def test_one_seed_fixes_the_kill_points_and_the_short_schedule_is_part_of_the_full_one():
    assert kill_schedule(3) == kill_schedule(3) != kill_schedule(4)
    full, short = kill_schedule(0), kill_schedule(0, short=True)
    assert len(full) >= 10 and set(short) <= set(full)
    assert {(p.case, p.phase) for p in short} == {
        ("ingest", "shard"), ("augment", "shard"), ("cache", "shard"),
        ("train-anchored", "M-step"), ("train-anchored", "E-step"),
    }
    assert {(p.case, p.phase) for p in full} >= {("train-exact", "M-step"), ("train-exact", "E-step")}


def one_shard_artifact(root: Path, table: pa.Table, compression: str = "snappy") -> Path:
    store = ArtifactStore(root)
    with store.writer("ingest", "v1", config={}) as writer:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=compression)
        writer.write_file(shard_name(0), sink.getvalue().to_pybytes())
    return store.path("ingest", "v1")


def test_artifacts_compare_by_their_bytes_then_by_their_values(tmp_path):
    table = pa.table({"score": [0.25, -1.5]})
    reference = one_shard_artifact(tmp_path / "reference", table)
    problems: list[str] = []
    assert compare_artifacts(reference, one_shard_artifact(tmp_path / "same", table), problems) == "bytes (1 files)"
    recompressed = one_shard_artifact(tmp_path / "zstd", table, "zstd")
    assert compare_artifacts(reference, recompressed, problems).startswith("values") and not problems
    other = one_shard_artifact(tmp_path / "other", pa.table({"score": [0.25, -1.0]}))
    assert compare_artifacts(reference, other, problems) == "DIFFERS"
    assert problems == ["part-00000.parquet differs from the reference's"]


@pytest.mark.slow
def test_every_stage_killed_at_the_short_schedule_reruns_to_the_uninterrupted_artifact(tmp_path):
    results = run_schedule(kill_schedule(0, short=True), tmp_path)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    # Seed 0 kills every stage after some of its work is finished, so every rerun had something to reuse.
    assert all(r.reused.split()[0] != "0" and r.reused != "nothing was finished" for r in results)
    assert all(r.equal.startswith(("bytes", "values")) for r in results)
