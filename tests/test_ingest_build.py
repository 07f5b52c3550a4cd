"""Ingest as a whole: the generic and synthetic sources, build_rankings' checks and warnings, the local
readers, a strict ingest reading on past unreadable records, and the splits (each dataset's adapter:
test_ingest_adapters)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from moplex_core.artifacts import ArtifactStore
from moplex_core.config import IngestConfig, SplitConfig
from moplex_core.data.sources import (
    DatasetUnavailableError,
    RawSchemaError,
    iter_local_records,
    source_fingerprint,
)
from moplex_core.data.splits import assign_splits, split_groups
from moplex_core.hashing import short_hash
from moplex_core import ingest
from moplex_core.ingest import build_rankings, check_rankings_fit, code_version, plan_ingest, run_ingest
from moplex_core.schema import RANKINGS_SCHEMA, SPLITS, SchemaError


# --- generic, synthetic, ingest-level --------------------------------------------------------------


def test_generic_fills_derivable_columns_and_keeps_the_source_split(fixtures_dir):
    config = IngestConfig(dataset="generic", path=str(fixtures_dir / "generic.jsonl"),
                          split=SplitConfig(from_source=True))
    built = build_rankings(config)
    rows = built.table.to_pylist()
    assert [r["split"] for r in rows] == ["train", "train", "test", "validation"]
    assert rows[2]["prompt_id"] == short_hash("Which sentence is clearer?") and rows[2]["ranked_prefix"] == 2
    assert rows[2]["example_id"] and rows[2]["source"].startswith("generic@local-")
    assert rows[0]["source"] == "handmade" and rows[1]["ranked_prefix"] == 1
    assert built.summary["adapter"]["dropped_column:notes"] == 1


def test_generic_reads_a_nan_ranked_prefix_as_null_every_tier(tmp_path):
    # Python's json.dumps writes float("nan") as NaN, which json.loads reads back: absent, as null is.
    row = {"prompt": "p", "responses": ["a", "b", "c"], "ranking": [[0], [2], [1]], "ranked_prefix": float("nan")}
    (tmp_path / "nan.jsonl").write_text(json.dumps(row) + "\n")
    built = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "nan.jsonl"), labels=None))
    assert built.table.column("ranked_prefix").to_pylist() == [3]


def test_generic_rows_that_repeat_a_ranking_without_ids_are_rankings_of_their_own(tmp_path, caplog):
    # Two raters who agree on a slate write the same row; without example_ids both are kept.
    agree = {"prompt": "p", "responses": ["a", "b", "c"], "ranking": [[0], [1], [2]]}
    rows = [agree, agree | {"ranking": [[2], [1], [0]]}, agree, agree, agree | {"example_id": "mine"}]
    (tmp_path / "raters.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "raters.jsonl"), labels=None))
    ids = built.table.column("example_id").to_pylist()
    first = ids[0]
    assert ids[2:] == [f"{first}-2", f"{first}-3", "mine"] and len(set(ids)) == 5
    assert built.summary["adapter"]["repeated_rankings"] == 2
    assert "2 ranking(s) of the source repeat an earlier row's" in caplog.text
    # ids given to some rows (an exported artifact, with new rows after it) are never taken by a made one
    rows = [agree | {"example_id": first}, agree | {"example_id": f"{first}-2"}, agree, agree]
    (tmp_path / "raters.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "raters.jsonl"), labels=None))
    assert built.table.column("example_id").to_pylist() == [first, f"{first}-2", f"{first}-3", f"{first}-4"]
    caplog.clear()
    (tmp_path / "raters.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    built = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "raters.jsonl"), labels=None))
    assert "repeated_rankings" not in built.summary["adapter"] and "repeat an earlier" not in caplog.text


@pytest.mark.parametrize("change, error", [
    ({1: "test"}, "a prompt must stay in one split"),  # rows 0 and 1 share prompt p1; row 0 is train
    ({2: "dev"}, "'dev'"),
])
def test_a_generic_split_column_that_is_not_kept_is_not_checked_either(tmp_path, fixtures_dir, change, error,
                                                                       caplog):
    # Without split.from_source the ingest assigns the splits, so the source's own can neither be kept
    # nor reject a row; kept, they are checked.
    rows = [json.loads(line) for line in (fixtures_dir / "generic.jsonl").read_text().splitlines()]
    for row, split in change.items():
        rows[row]["split"] = split
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for validation in ("strict", "drop"):
        built = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"), validation=validation))
        assert built.table.num_rows == len(rows) and built.summary["rejected_rows"] == 0
        assert set(built.table.column("split").to_pylist()) <= set(SPLITS)
        assert built.summary["adapter"]["ignored_column:split"] == sum(1 for row in rows if row.get("split"))
    assert "name a split, which ingest does not keep" in caplog.text and "set split.from_source=true" in caplog.text
    with pytest.raises(SchemaError, match=error):
        build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"),
                                    split=SplitConfig(from_source=True)))


def test_rankings_that_cannot_make_a_run_are_refused_with_what_to_change(tmp_path, caplog):
    rankings = run_ingest(IngestConfig(dataset="synthetic", synthetic={"n": 30, "k": 3, "m": 3}),
                          ArtifactStore(tmp_path)).path  # 24 / 3 / 3 rankings
    check_rankings_fit(rankings, k=3, splits=("validation", "test"))
    check_rankings_fit(rankings, k=1, splits=("validation", "test"))  # one model (a baseline): no clustering
    assert "cluster label(s)" not in caplog.text
    for k in (2, 4):  # labels other than k, fewer or more: a warning
        caplog.clear()
        check_rankings_fit(rankings, k=k, splits=("validation", "test"))
        assert f"the rankings carry 3 cluster label(s) (c0, c1, c2) and train.k = {k}" in caplog.text
        assert "Set train.k=3 for one adapter per label" in caplog.text
    manifest = json.loads((rankings / "manifest.json").read_text())  # as written before 2026-11-24, unlabelled:
    manifest["summary"]["rows_per_cluster"] = {"None": 30}  # the unlabelled rankings counted under "None"
    del manifest["summary"]["unlabelled_rows"]
    (rankings / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    check_rankings_fit(rankings, k=2, splits=("validation", "test"))
    assert "cluster label(s)" not in caplog.text
    with pytest.raises(ValueError, match="train.k = 25 clusters, but the rankings at .* have only 24 training"):
        check_rankings_fit(rankings, k=25, splits=("validation", "test"))
    with pytest.raises(ValueError, match=r"have none of split\(s\) \['holdout'\]"):
        check_rankings_fit(rankings, k=3, splits=("holdout",))
    # EM to start from the labels: every training ranking labelled, and k of them
    check_rankings_fit(rankings, k=3, splits=("validation", "test"), labelled=True)
    with pytest.raises(ValueError, match=r"the rankings artifact at .* carry 3 label\(s\) \(c0, c1, c2\) and train.k = 2"):
        check_rankings_fit(rankings, k=2, splits=("validation", "test"), labelled=True)


def test_adapter_changes_change_only_their_datasets_versions():
    assert code_version("generic") == "ingest-1+generic-8"
    assert code_version("ultrafeedback") == "ingest-1+ultrafeedback-3"
    assert code_version("persona") == "ingest-1+persona-2"
    assert code_version("prism") == "ingest-1+prism-2"
    assert code_version("helpsteer2") == "ingest-1+helpsteer2-2"
    assert code_version("synthetic") == "ingest-1"  # the demo's kept


def test_a_json_array_file_reads_like_jsonl(tmp_path, fixtures_dir):
    lines = (fixtures_dir / "generic.jsonl").read_text().splitlines()
    (tmp_path / "rows.json").write_text(json.dumps([json.loads(line) for line in lines]))
    assert [r.data for r in iter_local_records(tmp_path / "rows.json")] == [
        r.data for r in iter_local_records(fixtures_dir / "generic.jsonl")]
    (tmp_path / "object.json").write_text('{"rows": []}')
    with pytest.raises(RawSchemaError, match="must hold a JSON array of records"):
        list(iter_local_records(tmp_path / "object.json"))


def test_every_dataset_builds_a_valid_split_rankings_table(fixtures_dir):
    for dataset, path in [("ultrafeedback", "ultrafeedback.jsonl"), ("persona", "persona.jsonl"),
                          ("helpsteer2", "helpsteer2.jsonl"), ("prism", "prism")]:
        config = IngestConfig(dataset=dataset, path=str(fixtures_dir / path),
                              split=SplitConfig(fractions=(0.5, 0.25, 0.25)))
        table = build_rankings(config).table
        assert table.schema == RANKINGS_SCHEMA and table.num_rows > 0
        splits_of_prompt: dict[str, set[str]] = {}
        for pid, split in zip(table.column("prompt_id").to_pylist(), table.column("split").to_pylist()):
            splits_of_prompt.setdefault(pid, set()).add(split)
        assert all(len(s) == 1 for s in splits_of_prompt.values())
        assert set(table.column("split").to_pylist()) <= set(SPLITS)
        assert table.column("source")[0].as_py().startswith(f"{config.hub_source()[0]}@local-")


def test_synthetic_ingest_has_originals_only_and_true_labels():
    config = IngestConfig(dataset="synthetic", synthetic={"n": 40, "k": 2, "m": 3})
    table = build_rankings(config).table
    assert "generated" not in table.column_names and table.num_rows == 40
    assert set(table.column("cluster").to_pylist()) == {"c0", "c1"}
    assert {len(r) for r in table.column("responses").to_pylist()} == {3}


def test_loading_by_name_offline_says_how_to_pass_a_local_path(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetUnavailableError) as err:
        build_rankings(IngestConfig(dataset="ultrafeedback"))
    message = str(err.value)
    assert "'openbmb/UltraFeedback' (revision 40b436560ca83a8dba36114c22ab3c66e43f6d5e)" in message
    assert "moplex ingest --dataset ultrafeedback --path DIR" in message and "path='DIR'" in message
    assert "moplex run ... --set ingest.path=DIR" in message
    # the download command it suggests is one the installed huggingface_hub provides
    assert "`hf download openbmb/UltraFeedback --repo-type dataset --revision 40b4365" in message
    assert "`hf auth login`" in message and entry_points(group="console_scripts", name="hf")
    with pytest.raises(DatasetUnavailableError) as err:  # a dataset of several configs names the one it tried
        build_rankings(IngestConfig(dataset="prism"))
    assert "'HannahRoseKirk/prism-alignment' (name 'survey', revision 18ab5cf" in str(err.value)
    assert "moplex ingest --dataset prism --path DIR" in str(err.value)
    assert IngestConfig(dataset="helpsteer2", helpsteer2={"data": "preference"}).hub_parts() == (
        {"data_dir": "preference"},)


def test_local_sources_are_fingerprinted_by_content_not_location(tmp_path, fixtures_dir, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(fixtures_dir / "helpsteer2.jsonl", a / "train.jsonl")
    shutil.copy(fixtures_dir / "helpsteer2.jsonl", b / "train.jsonl")
    assert source_fingerprint(a) == source_fingerprint(b)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(fixtures_dir / "helpsteer2.jsonl", renamed / "test.jsonl")  # the same bytes as another split's file
    assert source_fingerprint(renamed) != source_fingerprint(a)
    plan = plan_ingest(IngestConfig(dataset="helpsteer2", path=str(a)), ArtifactStore(tmp_path / "artifacts"))
    monkeypatch.setattr(ingest, "LOCAL_READER", "local-next")  # a change to how local files are read
    assert plan_ingest(IngestConfig(dataset="helpsteer2", path=str(a)), ArtifactStore(tmp_path / "artifacts")).ref \
        != plan.ref
    with open(b / "train.jsonl", "a") as f:
        f.write("\n")
    assert source_fingerprint(a) != source_fingerprint(b)
    with pytest.raises(DatasetUnavailableError, match="does not exist"):
        list(iter_local_records(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetUnavailableError, match="not a data file"):
        list(iter_local_records(tmp_path / "notes.txt"))


def test_a_data_folder_skips_moplex_artifacts_below_it_but_not_the_users_own_manifests(tmp_path, fixtures_dir):
    # data/raw beside data/artifacts (the default root): --path data reads the raw records only.
    data = tmp_path / "data"
    (data / "raw" / "listing").mkdir(parents=True)
    shutil.copy(fixtures_dir / "helpsteer2.jsonl", data / "raw" / "train.jsonl")
    first = (fixtures_dir / "helpsteer2.jsonl").read_text().splitlines()[0]
    (data / "raw" / "listing" / "manifest.json").write_text(f"[{first}]")  # records, named manifest.json
    before = list(iter_local_records(data))
    fingerprint = source_fingerprint(data)
    store = ArtifactStore(data / "artifacts")
    with store.writer("ingest", "finished", config={}) as w:
        w.write_shard(0, pa.table({"prompt": ["p"]}))
    with pytest.raises(RuntimeError), store.writer("ingest", "underway", config={}) as w:
        w.write_shard(0, pa.table({"prompt": ["p"]}))
        raise RuntimeError("killed")
    assert (data / "artifacts" / "ingest" / "underway" / "part-00000.parquet").is_file()
    after = list(iter_local_records(data))
    assert [r.where for r in after] == [r.where for r in before]
    assert [str(data / "raw" / "listing" / "manifest.json") in r.where for r in after].count(True) == 1
    assert source_fingerprint(data) == fingerprint
    with pytest.raises(DatasetUnavailableError, match=r"only moplex artifacts: 2 version folder\(s\)"):
        list(iter_local_records(data / "artifacts"))
    with pytest.raises(DatasetUnavailableError, match="is a moplex artifact, not a dataset"):
        list(iter_local_records(data / "artifacts" / "ingest" / "finished"))
    (data / "raw" / "gone.jsonl").symlink_to(data / "nowhere.jsonl")  # a dangling link is not a data file
    assert [r.where for r in iter_local_records(data)] == [r.where for r in before]


def test_a_data_folder_says_which_files_it_does_not_read(tmp_path, fixtures_dir, caplog):
    shutil.copy(fixtures_dir / "generic.jsonl", tmp_path / "a.jsonl")
    (tmp_path / "b.csv").write_text("prompt,responses\n")  # a user's other export: not read, and said so
    (tmp_path / ".hidden").write_text("x")
    assert {Path(r.where.split(" line ")[0]).name for r in iter_local_records(tmp_path)} == {"a.jsonl"}
    assert f"{tmp_path}: 1 file(s) that are not .jsonl, .jsonl.gz, .json, .parquet files are not read, e.g. b.csv" \
        in caplog.text



def test_a_folder_without_data_files_names_the_files_it_holds_and_a_suffix_in_capitals(tmp_path):
    (tmp_path / "A.JSONL").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetUnavailableError) as err:
        list(iter_local_records(tmp_path))
    assert str(err.value) == (f"{tmp_path} holds no .jsonl, .jsonl.gz, .json, .parquet files; it holds 2 other file(s), "
                              "e.g. A.JSONL, notes.txt (a suffix is matched as written: rename A.JSONL with its suffix "
                              "in lower case)")
    with pytest.raises(DatasetUnavailableError, match="rename A.JSONL with its suffix in lower case"):
        list(iter_local_records(tmp_path / "A.JSONL"))
    with pytest.raises(DatasetUnavailableError) as err:
        list(iter_local_records(tmp_path / "notes.txt"))
    assert "lower case" not in str(err.value)


# --- splits ----------------------------------------------------------------------------------------


def test_splits_are_by_prompt_seeded_and_independent_of_row_order():
    prompt_ids = [f"p{i // 3}" for i in range(300)]  # 100 prompts x 3 rankings
    splits = assign_splits(prompt_ids, SplitConfig(), seed=0)
    per_prompt = {pid: s for pid, s in zip(prompt_ids, splits)}
    assert all(per_prompt[pid] == s for pid, s in zip(prompt_ids, splits))
    assert Counter(per_prompt.values()) == {"train": 80, "validation": 10, "test": 10}
    assert assign_splits(prompt_ids[::-1], SplitConfig(), seed=0) == splits[::-1]
    assert assign_splits(prompt_ids, SplitConfig(), seed=1) != splits


def test_one_prompt_text_under_several_ids_lands_in_one_split(tmp_path):
    assert split_groups(["b", "a", "c", "d", "e"], ["x", "x", "y", "z", "y"]) == ["a", "a", "c", "d", "c"]
    assert split_groups(["b", "a", "c"], ["t1", "t2", "t1"]) == ["b", "a", "b"]  # ids of their own texts: kept
    rows = [{"prompt_id": f"conv{i}-{copy}", "prompt": f"prompt {i}", "responses": ["a", "b"], "ranking": [[0], [1]],
             "example_id": f"e{i}-{copy}"} for i in range(30) for copy in "ab"]  # a generic source's own ids
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"))).table
    splits_of_prompt: dict[str, set[str]] = {}
    for prompt, split in zip(table.column("prompt").to_pylist(), table.column("split").to_pylist(), strict=True):
        splits_of_prompt.setdefault(prompt, set()).add(split)
    assert len(splits_of_prompt) == 30 and all(len(s) == 1 for s in splits_of_prompt.values())
    assert len({next(iter(s)) for s in splits_of_prompt.values()}) == 3


def test_split_sizes_deal_whole_prompts_to_exact_ranking_counts():
    prompt_ids = [f"p{i // 4}" for i in range(4 * 1200)]  # like UltraFeedback: 4 rankings per prompt
    splits = assign_splits(prompt_ids, SplitConfig(sizes=(3612, 448, 452)), seed=0)
    assert Counter(splits) == {"train": 3612, "validation": 448, "test": 452, None: 4800 - 4512}
    with pytest.raises(ValueError, match="ask for 4512 rankings but the source gives 400"):
        assign_splits(prompt_ids[:400], SplitConfig(sizes=(3612, 448, 452)), seed=0)


def test_a_source_too_small_for_a_split_says_which_split_got_nothing(tmp_path, caplog):
    rows = [{"prompt": f"prompt {i}", "responses": ["a", "b"], "ranking": [[0], [1]]} for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"))).table
    assert set(table.column("split").to_pylist()) == {"train"}
    assert ("split validation and test got no rankings: 3 prompt(s) are too few for split.fractions [0.8, 0.1, 0.1]"
            in caplog.text)
    caplog.clear()
    build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"),
                                split=SplitConfig(fractions=(0.4, 0.3, 0.3))))
    build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"),  # the sizes' own warning
                                split=SplitConfig(sizes=(1, 0, 0))))
    assert "got no rankings" not in caplog.text


def test_a_ranking_that_orders_two_equal_texts_is_warned_about_and_a_tie_of_them_is_not(tmp_path, caplog):
    rows = [{"prompt": "p1", "responses": ["a", "b", "a"], "ranking": [[0, 2], [1]]},  # equal texts tied: fine
            {"prompt": "p2", "responses": ["a", "a", "b"], "ranking": [[0], [1], [2]]},
            {"prompt": "p3", "responses": ["b", "a", "a"], "ranking": [[0], [1], [2]], "ranked_prefix": 1}]  # unordered
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"))).table
    second = table.column("example_id")[[r["prompt"] for r in table.to_pylist()].index("p2")].as_py()
    assert table.num_rows == 3  # kept: legal data, only worth knowing
    assert f"1 ranking(s) put one response text in two tiers (the first: example_id {second!r})" in caplog.text


def test_strict_ingest_names_every_unreadable_record_in_one_error_up_to_a_limit(tmp_path, monkeypatch):
    good = json.dumps({"prompt": "p", "responses": ["a", "b"], "ranking": [[0], [1]]})
    (tmp_path / "rows.jsonl").write_text("\n".join([good, "{not json", good, "[1, 2]", "{cut", good]) + "\n")
    config = IngestConfig(dataset="generic", path=str(tmp_path / "rows.jsonl"))
    with pytest.raises(RawSchemaError) as err:
        build_rankings(config)
    lines = str(err.value).splitlines()
    assert lines[0] == "3 source record(s) cannot be read or lack the dataset's fields:"
    assert [line.split(" is ")[0].strip() for line in lines[1:4]] == [
        f"{tmp_path / 'rows.jsonl'} line {n}" for n in (2, 4, 5)]
    assert "ingest in drop mode" in lines[4]
    monkeypatch.setattr("moplex_core.data.sources.READ_ON_LIMIT", 2)
    with pytest.raises(RawSchemaError, match=r"^the first 2 \(reading stopped there\) source record"):
        build_rankings(config)


def test_every_dataset_has_an_adapter_and_every_block_and_hub_source_a_dataset():
    # What a new dataset needs: a name in DatasetName, an entry in ADAPTERS, and (if it has settings or
    # a hub home) a DatasetOptions block named after it and a HUB_SOURCES entry.
    from typing import get_args

    from moplex_core.config import HUB_SOURCES
    from moplex_core.config.ingest import DATASET_BLOCKS, DatasetName
    from moplex_core.ingest import ADAPTERS

    names = set(get_args(DatasetName))
    assert set(ADAPTERS) == names
    assert set(DATASET_BLOCKS) <= names and set(HUB_SOURCES) <= names
    assert names - set(DATASET_BLOCKS) == {"generic"}
