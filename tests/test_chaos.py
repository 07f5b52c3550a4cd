"""The kill schedule (chaos.kills): one seed fixes the kill points, and every stage killed at the short
schedule's points reruns to the artifact of an uninterrupted run, reusing what was finished."""

from __future__ import annotations

import pytest

from chaos.kills import kill_schedule, run_schedule


def test_one_seed_fixes_the_kill_points_and_the_short_schedule_is_part_of_the_full_one():
    assert kill_schedule(3) == kill_schedule(3) != kill_schedule(4)
    full, short = kill_schedule(0), kill_schedule(0, short=True)
    assert len(full) >= 10 and set(short) <= set(full)
    assert {(p.case, p.phase) for p in short} == {
        ("ingest", "shard"), ("augment", "shard"), ("cache", "shard"),
        ("train-anchored", "M-step"), ("train-anchored", "E-step"),
    }
    assert {(p.case, p.phase) for p in full} >= {("train-exact", "M-step"), ("train-exact", "E-step")}


@pytest.mark.slow
def test_every_stage_killed_at_the_short_schedule_reruns_to_the_uninterrupted_artifact(tmp_path):
    results = run_schedule(kill_schedule(0, short=True), tmp_path)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    # Seed 0 kills every stage after some of its work is finished, so every rerun had something to reuse.
    assert all(r.reused.split()[0] != "0" and r.reused != "nothing was finished" for r in results)
    assert all(r.equal.startswith(("bytes", "values")) for r in results)
