"""`moplex inspect`: readable reports of versions, manifests, Parquet files and listings."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moplex_core.artifacts import ArtifactStore
from moplex_core.cli import main
from moplex_core.config import IngestConfig
from moplex_core.ingest import run_ingest
from moplex_core.inspect import inspect_path, stage_section


@pytest.fixture
def rankings(tmp_path, fixtures_dir):
    return run_ingest(IngestConfig(dataset="ultrafeedback", path=str(fixtures_dir / "ultrafeedback.jsonl")),
                      ArtifactStore(tmp_path))


def test_a_rankings_version_reports_manifest_schema_counts_and_rows(rankings):
    report = inspect_path(rankings.path, rows=2)
    for expected in (
        f"artifact {rankings.ref}", "status:   complete", "rows:     15 in 1 shard(s)", "code:     ingest-1",
        "inputs:   reader = local-2, source = sha256:", '  dataset: "ultrafeedback"', "summary:", "part-00000.parquet",
        "ranking: list<element: list<element: int32>> not null", "rows per cluster x split:",
        "truthfulness", "row 1:", "responses per ranking (m): 4: 15", "rankings with ties:",
    ):
        assert expected in report, expected
    assert "row 2:" not in report
    assert inspect_path(rankings.path / "manifest.json", rows=2) == report


def test_a_parquet_file_an_incomplete_version_and_listings(rankings, tmp_path):
    single = inspect_path(rankings.path / "part-00000.parquet", rows=1)
    assert single.startswith("-- part-00000.parquet: 15 rows --") and "row 0:" in single

    listing = inspect_path(tmp_path)
    assert f"{rankings.ref}" in listing and "complete" in listing and "15 rows" in listing
    assert inspect_path(tmp_path / "ingest").splitlines()[1:] == listing.splitlines()[1:]

    (rankings.path / "manifest.json").unlink()
    (rankings.path / ".started").write_text("2026-11-24T00:00:00+00:00")  # what a killed writer leaves
    unfinished = inspect_path(rankings.path)
    assert "INCOMPLETE (no manifest.json): 1 finished shard(s)" in unfinished and "row 0:" in unfinished
    assert "INCOMPLETE" in inspect_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="nothing exists there"):
        inspect_path(tmp_path / "nope")


def test_a_listing_says_what_each_version_was_made_from_and_checkpoints_are_summed_up(rankings, tmp_path):
    store = ArtifactStore(tmp_path)
    with store.writer("train", "t1", config={}, inputs={"cache": "cache/abcdef123456"}) as w:
        w.write_shard(0, pa.table({"x": [1]}))
        for t in range(3):
            (w.path / "em" / "restart-00" / f"iter-{t:04d}").mkdir(parents=True)
            pq.write_table(pa.table({"gamma": [0.5]}), w.path / "em" / "restart-00" / f"iter-{t:04d}" / "p.parquet")
    lines = {line.split()[0]: line for line in inspect_path(tmp_path).splitlines()[1:]}
    assert lines[str(rankings.ref)].endswith("ultrafeedback ultrafeedback.jsonl")
    assert lines["train/t1"].endswith("from cache/abcd (gone)")  # no such cache under the root
    report = inspect_path(w.path)
    assert "em/restart-00/iter-0000/p.parquet" not in report and "-- em/" not in report
    assert f"in 3 files: every EM iteration's checkpoint (`moplex inspect {w.path / 'em'}` lists them" in report
    # several versions of one stage: the settings they differ in tell them apart, not those they share
    config = {"k": 3, "lr": 0.003, "em": {"iterations": 6, "tol": 1e-4}, "seed": 0,
              "path": "/home/me/data/raters_2026_a.jsonl"}
    for version, changes in (("t2", {"k": 2, "em": {"iterations": 6, "tol": 1e-3}}), ("t3", {})):
        with store.writer("train", version, config=config | changes, inputs={"cache": "cache/abcdef123456"},
                          code_version="train-2") as w:
            w.write_shard(0, pa.table({"x": [1]}))
    lines = {line.split()[0]: line for line in inspect_path(tmp_path).splitlines()[1:]}
    assert lines["train/t2"].endswith(
        'from cache/abcd (gone)  '
        '[code="train-2" em.iterations=6 em.tol=0.001 k=2 lr=0.003 path="...raters_2026_a.jsonl" (+1 more)]')
    assert lines["train/t3"].endswith(
        'from cache/abcd (gone)  '
        '[code="train-2" em.iterations=6 em.tol=0.0001 k=3 lr=0.003 path="...raters_2026_a.jsonl" (+1 more)]')
    # t1 has none of these settings (a version of an older moplex lacks a setting added since): "-", not null
    assert lines["train/t1"].endswith('[code="" em.iterations=- em.tol=- k=- lr=- path=- (+1 more)]')
    assert lines[str(rankings.ref)].endswith("ultrafeedback.jsonl")  # the only ingest version: nothing to tell apart
    with store.writer("train", "t1b", config=config, inputs={}, code_version="train-2") as w:  # t3's config
        w.write_shard(0, pa.table({"x": [1]}))
    shutil.rmtree(tmp_path / "train" / "t1")
    lines = {line.split()[0]: line for line in inspect_path(tmp_path).splitlines()[1:]}
    assert lines["train/t2"].endswith("[em.tol=0.001 k=2]") and lines["train/t1b"].endswith("[em.tol=0.0001 k=3]")


def test_a_version_whose_files_are_not_its_manifests_is_reported_damaged(rankings, tmp_path):
    shard = rankings.path / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated copy
    report = inspect_path(rankings.path)
    assert "status:   DAMAGED: part-00000.parquet missing or not the size manifest.json records" in report
    assert "status:   complete" not in report
    assert f"{rankings.ref}" in (line := inspect_path(tmp_path).splitlines()[1]) and "DAMAGED" in line
    shard.unlink()
    assert "DAMAGED: part-00000.parquet" in inspect_path(rankings.path)


def test_verify_finds_a_changed_byte_that_the_size_check_cannot_and_a_damaged_version_lists_its_bytes_on_disk(
        rankings, tmp_path, capsys):
    shard = rankings.path / "part-00000.parquet"
    original = shard.read_bytes()
    assert "status:   complete; every file the stages read has the sha256" in inspect_path(rankings.path, verify=True)
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # the same size: only its sha256 tells
    shard.write_bytes(bytes(data))
    assert "status:   complete" in inspect_path(rankings.path)
    assert main(["inspect", str(rankings.path)]) == 0  # the size check alone sees nothing
    for where in ([str(rankings.path)], ["--root", str(tmp_path)], ["ingest", "--root", str(tmp_path)]):
        assert main(["inspect", *where, "--verify"]) == 1  # a check that a script can use
        assert capsys.readouterr().err == "moplex inspect: 1 version(s) DAMAGED\n"
    damaged: list[str] = []
    report = inspect_path(rankings.path, verify=True, damaged=damaged)
    assert damaged == [str(rankings.path)]
    assert "status:   DAMAGED: part-00000.parquet missing or not the size or sha256 manifest.json records" in report
    listing = inspect_path(tmp_path, verify=True).splitlines()
    assert listing[0].endswith("on disk, every file's sha256 checked):")
    line = next(line for line in listing if str(rankings.ref) in line)
    on_disk = sum(p.stat().st_size for p in rankings.path.rglob("*") if p.is_file())
    assert line.split()[1] == "DAMAGED" and f"{on_disk / 1000:.1f} kB" in line  # what deleting it frees
    shard.write_bytes(bytes(data[:-10]))
    line = next(line for line in inspect_path(tmp_path).splitlines() if str(rankings.ref) in line)
    assert f"{(on_disk - 10) / 1000:.1f} kB" in line  # a cut file's bytes count as they are
    shard.write_bytes(original)
    assert main(["inspect", str(rankings.path), "--verify"]) == 0
    assert "status:   complete; every file the stages read has the sha256" in capsys.readouterr().out


def test_a_cluster_column_of_integers_with_nulls_and_an_empty_table_are_counted_as_text(tmp_path):
    pq.write_table(pa.table({"cluster": pa.array([10, 0, None, 1, 1, 2], pa.int64()), "split": ["train"] * 6}),
                   tmp_path / "ints.parquet")
    report = inspect_path(tmp_path / "ints.parquet", rows=0)
    table = report.split("rows per cluster x split:\n")[1].splitlines()
    assert [line.split() for line in table] == [["split", "train", "(total)"], ["cluster"], ["0", "1", "1"],
                                                ["1", "2", "2"], ["2", "1", "1"], ["10", "1", "1"],
                                                ["<null>", "1", "1"], ["(total)", "6", "6"]]
    pq.write_table(pa.table({"cluster": pa.array([10, 2, None], pa.int32())}), tmp_path / "one.parquet")
    assert inspect_path(tmp_path / "one.parquet", rows=0).split("rows per cluster:\n")[1].split() == [
        "cluster", "2", "1", "10", "1", "<null>", "1"]
    pq.write_table(pa.table({"cluster": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    assert inspect_path(tmp_path / "empty.parquet", rows=3).splitlines()[0] == "-- empty.parquet: 0 rows --"
    assert "Empty" not in inspect_path(tmp_path / "empty.parquet", rows=3)


def test_many_shards_are_listed_in_one_line(tmp_path):
    store = ArtifactStore(tmp_path)
    for version, shards in (("few", 8), ("many", 9)):
        with store.writer("demo", version, config={}, inputs={}, code_version="demo-1") as writer:
            for i in range(shards):
                writer.write_shard(i, pa.table({"row": [i, i]}))
    few, many = (inspect_path(tmp_path / "demo" / v, rows=0) for v in ("few", "many"))
    assert few.count("part-0000") == 8 and "rows (part-*.parquet): 16 rows" in few
    files = many.split("files:\n")[1].splitlines()[0].split()
    assert files[:3] == ["part-00000.parquet", "..", "part-00008.parquet"] and files[5:7] == ["in", "9"]
    assert int(files[3].replace(",", "")) == sum(p.stat().st_size for p in (tmp_path / "demo" / "many").glob("part-*"))
    assert "rows (part-*.parquet): 18 rows" in many


def test_an_unfinished_version_names_the_code_that_can_resume_it(tmp_path):
    """After an upgrade that changed a stage's code version, rerunning never resumes an unfinished
    version the older code left (it builds another): the report says which code resumes it."""
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError), store.writer("demo", "old111", config={"k": 4}, inputs={"rankings": "ingest/abc"},
                                                   code_version="demo-1") as w:
        w.write_shard(0, pa.table({"x": [1]}))
        raise RuntimeError("killed")
    report = inspect_path(w.path)
    assert "inputs:   rankings = ingest/abc\nconfig:\n  k: 4" in report  # what it ran with, as a finished one says
    assert ("INCOMPLETE (no manifest.json): 1 finished shard(s); rerun the stage with the same config to resume, "
            "on a moplex whose stage writes demo-1: one whose stage code changed since (an upgrade) builds another "
            "version and never finishes this one") in report
    assert "code:     demo-1 (that of the last run that worked on it)" in report
    (w.path / ".started").write_text("2026-11-24T00:00:00+00:00\n")  # an older moplex's marker: no code version
    report = inspect_path(w.path)
    assert "on a moplex whose stage writes the same code version: one whose stage code changed" in report
    assert "code:" not in report


def test_odd_folders_are_reported_not_crashed_on(tmp_path):
    store = ArtifactStore(tmp_path)
    running = store.path("train", "bbb222")
    (running / "em" / "restart-00").mkdir(parents=True)  # a train run under way: no shards, no manifest yet
    (running / ".started").write_text("2026-11-24T00:00:00+00:00")
    assert inspect_path(tmp_path / "train").splitlines()[1].split()[:2] == ["train/bbb222", "INCOMPLETE"]
    assert "INCOMPLETE (no manifest.json): no finished EM iteration;" in inspect_path(running)
    (running / "em" / "restart-00" / "state.json").write_text("{}")
    inside = inspect_path(running / "em")  # a folder of an artifact: its files, and where its report is
    assert inside.splitlines()[0] == (f"{running / 'em'}: a folder of the artifact train/bbb222 "
                                      f"(`moplex inspect {running}` reports it; a Parquet file here opens on its own)")
    assert inside.splitlines()[1].split() == ["restart-00/state.json", "2", "B"]
    pq.write_table(pa.table({"gamma": [0.25]}), running / "em" / "restart-00" / "posteriors.parquet")
    assert "-- em/restart-00/posteriors.parquet: 1 rows --" in inspect_path(running)  # a killed run's last EM state
    for t in range(2):  # a train run killed after its second EM iteration: counted, and its last one shown
        iteration = running / "em" / "restart-00" / f"iter-{t:04d}"
        iteration.mkdir()
        pq.write_table(pa.table({"gamma": [0.5, 0.5]}), iteration / "posteriors.parquet")
        (iteration / "state.json").write_text("{}")
    (running / "em" / "restart-00" / "iter-0002").mkdir()  # the third, under way: no state.json yet
    so_far = "2 finished EM iteration(s), the last em/restart-00/iter-0001"
    assert f"{so_far} so far, started 2026-11-24T00:00:00+00:00" in inspect_path(tmp_path / "train")
    report = inspect_path(running)
    assert f"INCOMPLETE (no manifest.json): {so_far}; rerun" in report
    assert "-- em/restart-00/iter-0001/posteriors.parquet: 2 rows --" in report and "iter-0000/" not in report
    user = tmp_path / "mine"
    user.mkdir()
    (user / "manifest.json").write_text('{"name": "my dataset"}')  # a user's own manifest, not moplex's
    assert inspect_path(user) == f"{user}: no artifacts"
    with pytest.raises(FileNotFoundError, match="not an artifact folder"):
        inspect_path(user / "manifest.json")
    with store.writer("demo", "v1", config={}) as w:
        w.write_shard(0, pa.table({"split": ["train"], "score": [0.5]}))
    (w.path / "manifest.json").unlink()
    (w.path / ".started").write_text("2026-11-24T00:00:00+00:00")
    (w.path / "part-00000.parquet").write_bytes(b"PAR1 cut short by a kill")
    assert "-- rows (part-*.parquet): unreadable:" in inspect_path(w.path)
    with pytest.raises(ValueError, match="part-00000.parquet is not a readable Parquet file"):
        inspect_path(w.path / "part-00000.parquet")  # asked for by name: `moplex inspect` exits 1


def test_other_stages_plug_in_their_own_section(tmp_path, monkeypatch):
    import moplex_core.inspect

    # registered in a copy of the registry, which the test's end puts back
    monkeypatch.setattr(moplex_core.inspect, "_STAGE_SECTIONS", dict(moplex_core.inspect._STAGE_SECTIONS))
    store = ArtifactStore(tmp_path)
    with store.writer("demo-kind", "v1", config={}) as w:
        w.write_shard(0, pa.table({"split": ["train", "test"], "score": [0.5, 0.25]}))
        w.write_table("extra/posteriors.parquet", pa.table({"example_id": ["a"], "assigned": [0]}))

    @stage_section("demo-kind")
    def _demo(version_dir, shards):
        return [f"-- demo: {len(shards)} shard(s) --"]

    report = inspect_path(w.path)
    assert "-- demo: 1 shard(s) --" in report and "rows per split:" in report
    assert "-- extra/posteriors.parquet: 1 rows --" in report


def test_a_version_of_named_files_counts_its_files_not_zero_rows(tmp_path):
    """Stages such as train and evaluate write named files, not row shards: "0 rows" would mislead."""
    store = ArtifactStore(tmp_path)
    with store.writer("named-kind", "v1", config={}) as w:
        w.write_table("metrics.parquet", pa.table({"metric": ["a", "b"], "value": [0.5, 0.25]}))
        w.write_file("report.md", "# report")
    report = inspect_path(w.path)
    assert "rows:     no part-*.parquet shards: the stage writes the 2 named files below" in report
    assert "-- metrics.parquet: 2 rows --" in report
    assert "named-kind/v1" in (listing := inspect_path(tmp_path)) and "2 files" in listing and "0 rows" not in listing


def test_a_metrics_table_shows_its_values_over_all_rankings_by_metric_and_split(tmp_path):
    rows = [("m", "validation", "accuracy", "all", 0.5, 0), ("m", "test", "accuracy", "all", 0.75, 0),
            ("m", "test", "accuracy", "all", 0.25, 1), ("m", "test", "accuracy", "c0", 0.0, 0),
            ("m", "train_em", "ari_final", "all", 0.125, 0), ("m", "test", "rankings", "all", 60.0, 0),
            ("m", "test", "rankings", "all", 60.0, 1), ("m", "test", "ari", "all", float("nan"), 0),
            ("m", "validation", "ranking_accuracy", "all", 1.0, 0), ("m", "test", "ranking_accuracy", "all", 0.0, 0)]
    path = tmp_path / "metrics.parquet"
    pq.write_table(pa.table(dict(zip(("method", "split", "metric", "cluster", "value", "seed"), zip(*rows)))), path)
    report = inspect_path(path)
    assert "values over all rankings (metric x split; mean of 2 seeds):" in report
    lines = report.splitlines()
    assert lines[lines.index("  split            validation    test train_em") + 2:][:5] == [  # a count as a count
        "  accuracy             0.5000  0.5000        -", "  ari_final                 -       -   0.1250",
        "  rankings                  -      60        -", "  ari                       -       -        -",
        "  ranking_accuracy     1.0000  0.0000        -"]  # undefined everywhere, and fractions that are whole
    assert "rows per cluster x split" not in report  # counts of metric rows would say nothing
    two = [("k1", *row[1:]) for row in rows] + rows
    pq.write_table(pa.table(dict(zip(("method", "split", "metric", "cluster", "value", "seed"), zip(*two)))), path)
    assert "values over all rankings (method x metric x split; mean of 2 seeds):" in inspect_path(path)
    two = [("a", "test", "accuracy", "all", 0.5, 0), ("a", "test", "ari", "all", float("nan"), 0),
           ("b", "test", "accuracy", "all", 0.75, 0), ("b", "test", "rankings", "all", 60.0, 0)]
    pq.write_table(pa.table(dict(zip(("method", "split", "metric", "cluster", "value", "seed"), zip(*two)))), path)
    lines = inspect_path(path).splitlines()
    start = lines.index("  method metric          ") + 1
    assert lines[start:start + 4] == ["  a      accuracy  0.5000", "         ari            -",  # a's own metrics only
                                      "  b      accuracy  0.7500", "         rankings      60"]


def test_text_from_the_data_reaches_the_terminal_escaped(tmp_path):
    # A label that would retitle the terminal and recolour it, a carriage return, a bidi override.
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"cluster": ["c0\x1b]0;pwned\x07\x1b[41m", "c1\r", "c2\u202e"], "split": ["train"] * 3}), path)
    report = inspect_path(path)
    assert "\x1b" not in report and "\r" not in report and "\u202e" not in report
    assert "c0\\x1b]0;pwned\\x07\\x1b[41m" in report and "c1\\r" in report and "c2\\u202e" in report


def test_values_are_counted_a_batch_at_a_time_across_files(tmp_path, monkeypatch):
    from moplex_core import inspect

    monkeypatch.setattr(inspect, "_COUNT_BATCH", 2)  # every file is several batches
    for i, clusters in enumerate((["c1", "c0", "c1"], ["c0", None, "c1", "c1"])):
        pq.write_table(pa.table({"cluster": clusters, "split": ["train", "test"] * 2 if i else ["test"] * 3}),
                       tmp_path / f"part-{i:05d}.parquet")
    report = inspect._readable_table_report("t", sorted(tmp_path.glob("*.parquet")), rows=0)
    table = report[report.index("rows per cluster x split:") + 1].splitlines()
    assert [line.split() for line in table] == [
        ["split", "test", "train", "(total)"], ["cluster"], ["c0", "1", "1", "2"], ["c1", "3", "1", "4"],
        ["<null>", "1", "0", "1"], ["(total)", "5", "2", "7"]]
