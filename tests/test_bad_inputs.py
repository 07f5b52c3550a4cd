"""Bad input is rejected with a sentence naming the file, row and field (issue 8, item 2).

The first test runs the short catalogue of chaos/bad_inputs.py through `moplex ingest` / `moplex run`
(the Prefect flow included); the others pin each fix it forced, one at a time and fast.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fake_hub import run_probe
from lm_fixtures import tiny_model_dir  # noqa: F401  (fixture)

from moplex_core.artifacts import ArtifactStore, read_manifest
from moplex_core.cache import run_cache, truncated_responses
from moplex_core.cli import main
from moplex_core.config import CacheConfig, IngestConfig, TrainConfig, pipeline_preset, with_overrides
from moplex_core.data.sources import RawRejects, RawSchemaError, iter_local_records
from moplex_core.ingest import build_rankings, run_ingest
from moplex_core.lm.tokenize import TokenizedResponse
from moplex_core.pl import PAD
from moplex_core.schema import SchemaError, check_rankings
from moplex_core.scorers.lora_policy import PolicyInputs
from moplex_core.train import check_config_fits_data, run_train

GOOD = {"example_id": "e0", "prompt": "Which is best?", "responses": ["a", "b", "c"], "ranking": [[0], [1], [2]]}


@pytest.mark.slow  # ~1.5 min: one Prefect test server, a tiny model, a cache and a short EM on 2 cores
@pytest.mark.timeout(600)
def test_the_short_catalogue_rejects_every_bad_input_cleanly():
    from chaos.bad_inputs import run_catalogue

    results = run_catalogue(short=True)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    names = {r.name for r in results}
    assert len(results) >= 20
    assert any(n.startswith("flow:") for n in names) and any(n.startswith("row:") for n in names)
    assert "flow: over-long responses truncated and reported" in names


# ---------------------------------------------------------------------------------------------------
# sources: the file and line of what cannot be read


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _error(path: Path) -> str:
    with pytest.raises(RawSchemaError) as err:
        list(RawRejects().readable(iter_local_records(path)))  # strict validation
    return str(err.value)


def test_non_utf8_jsonl_names_the_file_line_and_byte(tmp_path):
    path = _write(tmp_path / "x.jsonl", json.dumps(GOOD).encode() + b'\n{"prompt": "caf\xe9"}\n')
    assert _error(path) == (f"{path} line 2 is not UTF-8 text (byte 16 is b'\\xe9'); re-encode the file as UTF-8, "
                            "e.g. `iconv -f latin1 -t utf-8 IN > OUT`; to set such records aside in rejected.parquet "
                            "and read the rest, ingest in drop mode: `moplex ingest ... --set validation=drop` "
                            "(`--set ingest.validation=drop` with `moplex run`; IngestConfig(validation='drop') in "
                            "Python)")


@pytest.mark.parametrize("name", ["x.jsonl", "x.json"])
def test_a_utf8_byte_order_mark_is_read_as_windows_tools_write_it(tmp_path, name):
    text = json.dumps(GOOD) if name.endswith(".jsonl") else json.dumps([GOOD])
    path = _write(tmp_path / name, b"\xef\xbb\xbf" + text.encode() + b"\n")
    [record] = list(iter_local_records(str(path)))
    assert record.data == GOOD and record.unreadable is None


@pytest.mark.parametrize(("name", "encoding"), [("x.jsonl", "utf-16"), ("x.json", "utf-16"), ("x.jsonl", "utf-16-be"),
                                               ("x.jsonl.gz", "utf-16"), ("x.jsonl", "utf-32")])
def test_a_utf16_file_is_refused_whole_with_how_to_re_encode_it(tmp_path, name, encoding):
    text = (json.dumps(GOOD) + "\n" + json.dumps(GOOD) if ".jsonl" in name else json.dumps([GOOD])) + "\n"
    bom = "\ufeff" if encoding == "utf-16-be" else ""  # Python's utf-16 and utf-32 codecs write one themselves
    data = (bom + text).encode(encoding)  # as PowerShell 5's `>` writes (UTF-16 little-endian)
    path = _write(tmp_path / name, gzip.compress(data) if name.endswith(".gz") else data)
    family = encoding[:6]
    convert = f"iconv -f {family} -t utf-8"
    command = f"gunzip -c IN | {convert} | gzip > OUT" if name.endswith(".gz") else f"{convert} IN > OUT"
    assert _error(path) == (f"{path} is {family.upper()} text (it starts with a {family.upper()} byte-order mark); "
                            f"re-encode it as UTF-8, e.g. `{command}`, or write it with `Out-File -Encoding utf8`")


def test_json_nested_past_the_recursion_limit_names_its_line(tmp_path):
    deep = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    path = _write(tmp_path / "x.jsonl", b'{"a": 1}\n' + deep + b"\n")
    assert _error(path).startswith(f"{path} line 2 nests JSON arrays or objects too deeply to read")
    path = _write(tmp_path / "x.json", b"[" + deep + b"]")
    assert _error(path).startswith(f"{path} nests JSON arrays or objects too deeply to read")


def test_a_parquet_string_that_is_not_utf8_names_its_row_and_field(tmp_path):
    offsets = pa.py_buffer(bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]))
    cluster = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"a\xff")])  # row 1: 0xff
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"prompt": ["p", "q"], "cluster": cluster}), path)
    assert _error(path).startswith(f"{path} row 1 field 'cluster' is not UTF-8 text")


def test_non_utf8_json_names_the_line_within_the_file(tmp_path):
    path = _write(tmp_path / "x.json", b'[{"a": 1},\n {"b": "\xff"}]')
    assert f"{path} is not UTF-8 text (line 2, byte 9 is b'\\xff')" in _error(path)


def test_malformed_jsonl_names_the_line_and_where_in_it(tmp_path):
    path = _write(tmp_path / "x.jsonl", b'{"a": 1}\n\n{"a": 1, "b": [1, \n{"a": 1 "b": 2}\n')
    assert _error(path).startswith(f"{path} line 3 is not valid JSON (at the end of the line: Expecting value)")
    path = _write(tmp_path / "y.jsonl", b'{"a": 1 "b": 2}\n')
    assert _error(path).startswith(f"{path} line 1 is not valid JSON (column 9: Expecting ',' delimiter)")


def test_a_lone_surrogate_escape_names_the_line_and_field_and_drop_mode_sets_the_record_aside(tmp_path):
    good = json.dumps(GOOD)
    bad = json.dumps({**GOOD, "example_id": "e1", "responses": ["a", "b \\ud83d x", "c"]})  # half an emoji
    pair = json.dumps({**GOOD, "example_id": "e2", "prompt": "Which is best? \\ud83d\\ude00"})  # a whole one
    path = _write(tmp_path / "x.jsonl", f"{good}\n{bad}\n{pair}\n".replace("\\\\u", "\\u").encode())
    assert _error(path).startswith(f"{path} line 2, field 'responses[1]': character 2 is a lone UTF-16 surrogate "
                                   "(\\ud83d")
    built = build_rankings(IngestConfig(dataset="generic", path=str(path), validation="drop"))
    assert sorted(built.table.column("example_id").to_pylist()) == ["e0", "e2"]
    assert built.summary["unreadable_records"] == 1 and built.summary["rejected_rows"] == 0
    [rejected] = built.rejected.to_pylist()
    # named relative to the source, as its version is: rejected.parquet does not depend on where it lies
    assert rejected["row"] is None and rejected["where"] == "line 2" and rejected["field"] == "responses[1]"
    assert rejected["reason"].startswith("line 2, field 'responses[1]': character 2 is a lone UTF-16")
    assert json.loads(rejected["record"])["example_id"] == "e1"  # the line as it was, to fix and re-ingest
    key = '{"prompt": "p", "\\ud83d": 1}'  # in a key too: it would reach pyarrow in rejected.parquet
    path = _write(tmp_path / "k.jsonl", f"{key}\n".encode())
    assert _error(path).startswith(f"{path} line 1, field 'a key': character 0 is a lone UTF-16 surrogate")
    nested = '{"prompt": "p", "meta": {"\\ud83d": 1}}'  # rejected.parquet's field: where the key's object lies
    [record] = iter_local_records(_write(tmp_path / "n.jsonl", f"{nested}\n".encode()))
    assert record.unreadable.field == "meta" and "field 'meta (a key)': character 0" in str(record.unreadable)
    [record] = iter_local_records(_write(tmp_path / "l.jsonl", b'["\\ud83d"]\n'))  # no record: no field
    assert record.unreadable.field is None and "is a JSON list; records are JSON objects" in str(record.unreadable)
    path = _write(tmp_path / "x.json", f"[{good}, {bad}]".replace("\\\\u", "\\u").encode())
    assert _error(path).startswith(f"{path} record 1, field 'responses[1]': character 2 is a lone UTF-16 surrogate")


def test_a_bad_prompt_is_named_alone_not_with_the_ids_ingest_could_not_make_from_it(tmp_path):
    rows = [{**GOOD, "prompt": None}, {**GOOD, "prompt": 123}, {**GOOD, "prompt": ""}]
    rows = [{key: value for key, value in row.items() if key not in ("example_id", "prompt_id")} for row in rows]
    path = _write(tmp_path / "x.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())
    with pytest.raises(SchemaError) as raised:
        build_rankings(IngestConfig(dataset="generic", path=str(path)))
    assert [(i.row, i.field) for i in raised.value.issues] == [(0, "prompt"), (1, "prompt"), (2, "prompt")]
    binary = pa.table({"prompt": pa.array([b"p\xff", b"ok"], pa.binary()), "responses": [["a", "b"]] * 2,
                       "ranking": [[[0], [1]], [[1], [0]]]})  # a Parquet binary column, UTF-8 but in row 0
    pq.write_table(binary, tmp_path / "b.parquet")
    with pytest.raises(SchemaError) as raised:
        build_rankings(IngestConfig(dataset="generic", path=str(tmp_path / "b.parquet")))
    assert [(i.row, i.field) for i in raised.value.issues] == [(0, "prompt")]
    with pytest.raises(ValueError, match="every row was rejected") as raised:  # drop mode: the same reasons
        build_rankings(IngestConfig(dataset="generic", path=str(path), validation="drop"))
    assert "field 'prompt'" in str(raised.value) and "_id" not in str(raised.value).split("by field:")[1]
    # canonical rows (Python's check) must carry their ids: each absent one is named
    canonical = {**rows[0], "example_id": None, "prompt_id": None, "ranked_prefix": 1, "cluster": None, "source": "s",
                 "split": "train"}
    with pytest.raises(SchemaError) as raised:
        check_rankings([canonical])
    assert {i.field for i in raised.value.issues} >= {"example_id", "prompt_id", "prompt"}


def test_drop_mode_with_every_row_rejected_names_every_field_at_fault_with_its_first_row(tmp_path):
    lone = json.dumps({**GOOD, "example_id": "e1", "responses": ["only one"], "ranking": [[0]]})
    empty = json.dumps({**GOOD, "example_id": "e2", "prompt": ""})
    lone_too = lone.replace('"e1"', '"e3"')
    path = _write(tmp_path / "x.jsonl", f"{lone}\n{lone_too}\n{empty}\n{{not json\n".encode())
    with pytest.raises(ValueError) as raised:
        build_rankings(IngestConfig(dataset="generic", path=str(path), validation="drop"))
    message = str(raised.value)
    assert "every row was rejected (4 row(s), 4 reason(s)), by field: " in message
    assert "2 x field 'responses' (the first: line 1: has 1 response(s)" in message
    assert "1 x field 'prompt' (line 3: is missing or empty)" in message
    assert "1 x an unreadable record (line 4 is not valid JSON" in message
    assert "validation='strict'" not in message  # which would list five rows, not the fields


def test_drop_mode_sets_aside_unreadable_lines_and_records_without_the_raw_schema(tmp_path, fixtures_dir):
    lines = (fixtures_dir / "helpsteer2.jsonl").read_text().splitlines()
    out_of_range = json.dumps({**json.loads(lines[1]), "verbosity": 7})
    source = _write(tmp_path / "hs.jsonl", "\n".join([lines[0], out_of_range, '{"prompt": "p" "x"}', *lines[2:]]).encode())
    with pytest.raises(RawSchemaError, match=f"{source} line 2, field 'verbosity': rating 7 is not an integer in 0..4"):
        build_rankings(IngestConfig(dataset="helpsteer2", path=str(source)))
    dropped = build_rankings(IngestConfig(dataset="helpsteer2", path=str(source), validation="drop"))
    without = tmp_path / "without" / "hs.jsonl"
    without.parent.mkdir()
    _write(without, "\n".join([lines[0], *lines[2:]]).encode())
    clean = build_rankings(IngestConfig(dataset="helpsteer2", path=str(without))).table
    assert dropped.table.num_rows > 0 and dropped.table.drop(["source"]).equals(clean.drop(["source"]))
    assert dropped.summary["unreadable_records"] == 2 and dropped.summary["rejected_rows"] == 0
    # the field a record lacks or gets wrong, as in the raw schema; none where the line is no record
    assert [(r["row"], r["where"], r["field"], r["record"]) for r in dropped.rejected.to_pylist()] == [
        (None, "line 2", "verbosity", out_of_range), (None, "line 3", None, '{"prompt": "p" "x"}')]


def test_unreadable_parquet_and_gzip_name_the_file(tmp_path):
    assert "not a readable Parquet file" in _error(_write(tmp_path / "a.parquet", b"PAR1 not really"))
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 40), whole, row_group_size=5)
    cut = _write(tmp_path / "cut.parquet", whole.read_bytes()[:-200])
    assert _error(cut).startswith(f"{cut} is not a readable Parquet file")
    gz = _write(tmp_path / "cut.jsonl.gz", gzip.compress(json.dumps(GOOD).encode() * 30)[:30])
    assert _error(gz).startswith(f"{gz} is not a readable gzip file")
    stream = bytearray(gzip.compress(b"".join(b'{"a": %d, "b": "xyz"}\n' % i for i in range(5000))))
    stream[30:90] = bytes(b ^ 0x5A for b in stream[30:90])  # a corrupt deflate body: zlib.error, not EOF
    corrupt = _write(tmp_path / "corrupt.jsonl.gz", bytes(stream))
    assert _error(corrupt).startswith(f"{corrupt} is not a readable gzip file")


def test_bad_rows_of_a_generic_source_name_file_line_and_field(tmp_path):
    path = tmp_path / "rankings.jsonl"
    rows = [GOOD, {**GOOD, "example_id": "e1", "ranking": [[0], [4], [1, 2]]}, {**GOOD, "example_id": "e2"}]
    path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines: line numbers are the file's
    with pytest.raises(SchemaError) as err:
        build_rankings(IngestConfig(dataset="generic", path=str(path)))
    assert (f"row 1 ({path} line 3, example_id 'e1'), field 'ranking': index 4 in tier 1 is outside 0..2"
            in str(err.value))


def test_a_rejected_generic_record_is_the_line_as_read_so_its_fix_re_ingests_as_meant(tmp_path):
    # The adapter fills in ranked_prefix from the ranking (and ids, source); from a broken ranking
    # that default would survive its fix and make a full ranking partial.
    path = tmp_path / "rankings.jsonl"
    line = {"prompt": "q2", "responses": ["a", "b", "c"], "ranking": [[0], [1]]}
    path.write_text(json.dumps({"prompt": "q1", "responses": ["a", "b"], "ranking": [[1], [0]]}) + "\n"
                    + json.dumps(line) + "\n")
    built = build_rankings(IngestConfig(dataset="generic", path=str(path), validation="drop"))
    [rejected] = built.rejected.to_pylist()
    assert rejected["field"] == "ranking" and json.loads(rejected["record"]) == line
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(json.dumps({**json.loads(rejected["record"]), "ranking": [[0], [1], [2]]}) + "\n")
    again = build_rankings(IngestConfig(dataset="generic", path=str(fixed), split={"sizes": [1, 0, 0]}))
    assert again.table.column("ranked_prefix").to_pylist() == [3]


def test_parquet_rows_are_named_by_file_and_row(tmp_path):
    path = tmp_path / "rankings.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "example_id": "e1", "responses": ["a", " ", "c"]}]), path)
    with pytest.raises(SchemaError, match=f"row 1 \\({path} row 1, example_id 'e1'\\), field 'responses'"):
        build_rankings(IngestConfig(dataset="generic", path=str(path)))


def test_an_empty_source_names_its_path(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=f"the generic source at {path} gave no rankings"):
        run_ingest(IngestConfig(dataset="generic", path=str(path)), ArtifactStore(tmp_path / "root"))
    assert not (tmp_path / "root").exists()


HUB_PROBE = """
import json, sys
import fake_hub

status = {"now": 404}  # what the hub answers: an unknown repository, or a server error
fake_hub.use(fake_hub.serve(lambda path: fake_hub.NOT_FOUND if status["now"] == 404 else fake_hub.BUSY), sys.argv[1])
from moplex_core.data.sources import iter_hub_records  # the real datasets and huggingface_hub, imported online

for status["now"] in (404, 503):
    try:
        next(iter_hub_records("nobody/nothing", None, "generic"))
    except Exception as err:
        print(json.dumps([status["now"], type(err).__name__, str(err)]))
"""


@pytest.mark.slow  # ~8 s: huggingface_hub retries a server error 5 times (1 s apart: Retry-After 0) before it gives up
def test_a_hub_server_error_is_worth_retrying_and_an_unknown_dataset_is_not(tmp_path):
    """The real datasets library against a local hub: a 404 (unknown or gated repository) is
    DatasetUnavailableError, never retried; a 503 that outlasts huggingface_hub's own retries is
    HubUnreachableError, which the pipeline retries (datasets reports both as FileNotFoundError)."""
    answers = {status: (kind, message) for status, kind, message in run_probe(HUB_PROBE, str(tmp_path / "hf"))}
    assert answers[404][0] == "DatasetUnavailableError" and "doesn't exist on the Hub" in answers[404][1]
    assert answers[503][0] == "HubUnreachableError" and "--path DIR" in answers[503][1]


COMMIT_PROBE = """
import json, sys
import fake_hub

sha = {"now": "1" * 40}  # the commit PERSONA's main branch (and its tag v1) is at

def info(path):
    if path in ("/api/datasets/SynthLabsAI/PERSONA", "/api/datasets/SynthLabsAI/PERSONA/revision/v1"):
        return 200, {}, {"id": "SynthLabsAI/PERSONA", "sha": sha["now"]}
    return fake_hub.NOT_FOUND

mode = sys.argv[2]  # online, offline, or refused: a hub that does not answer
fake_hub.use(fake_hub.closed_endpoint() if mode == "refused" else fake_hub.serve(info), sys.argv[1],
             offline=mode == "offline")
from moplex_core.artifacts import ArtifactStore
from moplex_core.config import IngestConfig
from moplex_core.ingest import plan_ingest

for sha["now"], config in (("1" * 40, {}), ("2" * 40, {}), ("2" * 40, {"revision": "3" * 40}),
                           ("2" * 40, {"hub_name": "nobody/nothing"}), ("4" * 40, {"revision": "v1"})):
    try:
        plan = plan_ingest(IngestConfig(dataset="persona", **config), ArtifactStore(sys.argv[1]))
        print(json.dumps([plan.ref.version, plan.inputs]))
    except Exception as err:
        print(json.dumps([type(err).__name__, str(err)]))
"""


@pytest.mark.parametrize("mode", ["online", "offline", "refused"])
def test_an_unpinned_hub_source_is_versioned_at_the_commit_the_hub_names(tmp_path, mode):
    """PERSONA has no pinned revision: its version holds the commit the hub's main branch is at, so a
    dataset updated there is a new version, not the old rankings reused; offline, that cannot be
    known, and the ingest says how to pin it or read a local copy."""
    first, updated, pinned, unknown, tagged = run_probe(COMMIT_PROBE, str(tmp_path / "hf"), mode)
    assert pinned[1] == {}  # a pinned revision needs no hub
    if mode == "refused":  # not worth giving up on: the pipeline retries it
        for kind, message in (first, updated, unknown, tagged):
            assert kind == "HubUnreachableError" and "did not say which commit it is at" in message
        return
    if mode == "offline":
        for kind, message in (first, updated, unknown, tagged):
            assert kind == "DatasetUnavailableError" and "--set revision=COMMIT` on `moplex ingest`" in message
            assert "--repo-type dataset --local-dir DIR" in message
        return
    assert first[1] == {"revision": "1" * 40} and updated[1] == {"revision": "2" * 40}
    assert first[0] != updated[0] and pinned[0] not in (first[0], updated[0])
    assert unknown[0] == "DatasetUnavailableError" and "nobody/nothing (no revision named): " in unknown[1]
    assert tagged[1] == {"revision": "4" * 40}  # a tag or branch moves: read, and versioned, at its commit now


# ---------------------------------------------------------------------------------------------------
# config: one line per problem, naming the key


@pytest.mark.parametrize(("assignment", "expected"), [
    ("train.clusters=3", "train.clusters: unknown key (not a setting of this block; check the spelling)"),
    ("em_iterations=3", "em_iterations: unknown key (not a setting of this block; did you mean train.em_iterations?)"),
    ("train.em_iteration=3", "train.em_iteration: unknown key (not a setting of this block; did you mean "
                             "train.em_iterations?)"),
    ("trian.k=3", "trian.k: 'trian' is not a block of PipelineConfig; did you mean train?"),
    ("k=3", "k: unknown key (not a setting of this block; did you mean ingest.synthetic.k or train.k?)"),
    ("cache.batch_size=8", "cache.batch_size: unknown key (not a setting of this block; did you mean "
                           "cache.score_batch_size or augment.batch_size or train.batch_size?)"),
    ("cache.fractions=1", "did you mean cache.contractions or ingest.split.fractions?)"),
    ("ingest.splt.sizes=[1,1,1]", "ingest.splt.sizes: 'splt' is not a block of ingest; did you mean ingest.split?"),
    ("ingest.split.fractions=[0.9,0.2,0.1]", "must be >= 0 and sum to 1, got (0.9, 0.2, 0.1)\n"),
    ("train.k=0", "train.k: Input should be greater than or equal to 1 (got 0)"),
    ("train.beta=0", "train.beta: Input should be greater than 0 (got 0)"),
    ("augment.temperature=-0.5", "augment.temperature: Input should be greater than 0 (got -0.5)"),
    ("augment.n_generated=-1", "augment.n_generated: Input should be greater than or equal to 1 (got -1)"),
    ("train.anchors=7", "train.anchors a = 7 > m' = 6 responses per example (4 from synthetic + 2 generated)"),
    ("train.dtype=float16", "train.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float64' (got 'float16')"),
    ('ingest.labels=["a\udcff", "b", "c"]', "ingest.labels: holds bytes that are not UTF-8 text"),  # a latin-1 \xff
])
def test_config_errors_name_the_key_in_one_line(assignment, expected):
    with pytest.raises(ValueError) as err:
        with_overrides(pipeline_preset("synthetic-demo"), [assignment])
    assert expected in str(err.value) + "\n"
    assert "errors.pydantic.dev" not in str(err.value)


def test_a_mistyped_block_after_a_block_set_to_a_value_is_still_named():
    with pytest.raises(ValueError, match="'trian' is not a block of PipelineConfig; did you mean train"):
        with_overrides(pipeline_preset("synthetic-demo"), ["train=3", "trian.k=3"])


@pytest.mark.parametrize("command", [["run", "synthetic-demo"], ["experiment", "compare", "full"]])
def test_a_set_error_lists_only_what_was_set(command, tmp_path, capsys):
    assert main([*command, "--root", str(tmp_path), "--set", "train.kk=3"]) == 1
    err = capsys.readouterr().err
    assert "(overrides ['train.kk=3'])" in err and "did you mean train.k?" in err and "root=" not in err


def test_anchors_up_to_m_prime_and_generic_sources_pass_the_config_check():
    demo = pipeline_preset("synthetic-demo")
    assert with_overrides(demo, ["train.anchors=6"]).train.anchors == 6
    assert with_overrides(demo, ["augment=null", "train.anchors=4"]).train.anchors == 4
    generic = with_overrides(demo, ["ingest.dataset=generic", "ingest.path=x.jsonl", "train.anchors=50"])
    assert generic.responses_per_example() is None  # the train stage checks it against the data
    prism = pipeline_preset("prism")
    assert prism.responses_per_example() == 8 and with_overrides(prism, ["train.anchors=8"]).train.anchors == 8
    with pytest.raises(ValueError, match=r"a = 9 > m' = 8 responses per example \(4 from prism \+ 4 generated\)"):
        with_overrides(prism, ["train.anchors=9"])


# ---------------------------------------------------------------------------------------------------
# train: what only the data can show, refused before anything is written


def _policy_inputs(sizes: list[int], contractions: bool = True) -> PolicyInputs:
    n, width = len(sizes), max(sizes)
    tiers = torch.full((n, width), PAD, dtype=torch.int64)
    for i, m in enumerate(sizes):
        tiers[i, :m] = torch.arange(m)
    sequences = tuple(tuple(TokenizedResponse([1, 2, 3], 1) for _ in range(m)) for m in sizes)
    return PolicyInputs(tuple(f"e{i}" for i in range(n)), sequences, torch.zeros(n, width, dtype=torch.float64),
                        torch.zeros(n, width, width) if contractions else None, tiers)


def test_k_larger_than_the_training_rankings_is_refused():
    with pytest.raises(ValueError, match=r"train.k = 4 clusters, but the cache at C has only 3 training ranking\(s\)"):
        check_config_fits_data(TrainConfig(k=4), _policy_inputs([3, 3, 3]), "C")
    check_config_fits_data(TrainConfig(k=3, anchors=None), _policy_inputs([3, 3, 3]), "C")


def test_anchors_above_m_prime_are_refused_and_ragged_slates_name_the_range():
    with pytest.raises(ValueError, match=r"train.anchors a = 5 > m' = 4 responses per example in the cache at C"):
        check_config_fits_data(TrainConfig(k=1, anchors=5), _policy_inputs([4, 4]), "C")
    with pytest.raises(ValueError, match=r"a = 5 > m' = 2..4"):
        check_config_fits_data(TrainConfig(k=1, anchors=5), _policy_inputs([2, 4]), "C")
    check_config_fits_data(TrainConfig(k=1, anchors=3), _policy_inputs([2, 4]), "C")  # the 2-slate is exact


def test_anchors_on_a_cache_without_contractions_are_refused_and_exact_scores_pass():
    with pytest.raises(ValueError, match=r"the cache at C has none \(cache.contractions = false"):
        check_config_fits_data(TrainConfig(k=1, anchors=2), _policy_inputs([2, 4], contractions=False), "C")
    check_config_fits_data(TrainConfig(k=1, anchors=None), _policy_inputs([2, 4], contractions=False), "C")
    check_config_fits_data(TrainConfig(k=1, anchors=4), _policy_inputs([2, 4], contractions=False), "C")  # a = m'
    demo = pipeline_preset("synthetic-demo")
    assert not with_overrides(demo, ["cache.contractions=false"]).cache.contractions  # the demo is exact
    with pytest.raises(ValueError, match=r"the cache of this pipeline has none \(cache.contractions = false"):
        with_overrides(demo, ["cache.contractions=false", "train.anchors=2"])
    assert with_overrides(demo, ["cache.contractions=false", "train.anchors=6"]).train.anchors == 6  # a = m': exact


def test_run_train_refuses_before_writing_anything(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path)
    with store.writer("cache", "c1", config={"model": "unused"}) as writer:
        writer.write_file("note.txt", "a stand-in cache; its rows come from the patched loader")
    monkeypatch.setattr("moplex_core.train.load_policy_inputs", lambda cache_dir, split: (_policy_inputs([3] * 5), []))
    with pytest.raises(ValueError, match="train.anchors a = 4 > m' = 3"):
        run_train(TrainConfig(k=2, anchors=4), store.path("cache", "c1"), store, progress=False)
    assert not (tmp_path / "train").exists()


# ---------------------------------------------------------------------------------------------------
# cache: over-long responses are truncated as configured, counted and reported


def test_truncated_responses_counts_cut_responses_only():
    eos = 9
    rows = pa.table({
        "input_ids": [[[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 9]]],  # prompt [1, 2], then the responses
        "response_start": [[2, 2, 2]],
    })
    # max 3 response tokens: [3, 4, 5] was cut (no EOS), [3, 9] is whole, [3, 4, 9] fits exactly with EOS
    assert truncated_responses(rows, 3, eos) == 1
    assert truncated_responses(rows, None, eos) == 0
    # a generation that max_new_tokens cut has no EOS whatever the limit: its whole text decides
    assert truncated_responses(rows, 3, eos, [False, True, True]) == 0
    assert truncated_responses(rows, 3, eos, [False, True, True], lambda j: {0: 3}[j]) == 0  # exactly 3: whole
    assert truncated_responses(rows, 3, eos, [False, True, True], lambda j: {0: 7}[j]) == 1  # 7: the cache cut it


def test_the_cache_reports_truncated_responses_and_prompts_in_its_manifest_and_log(tiny_model_dir, tmp_path,  # noqa: F811
                                                                                    caplog):
    store = ArtifactStore(tmp_path)
    long = " ".join(["4 5 6 7"] * 20)
    rows = [{"example_id": f"e{i}", "prompt_id": f"p{i}",
             "prompt": "Rank by criterion 0: which list is best?" + " Think twice." * 10 * (i == 3)
             + " <|im_end|>" * (i == 1),
             # row 2's messages hold it JSON-escaped (ensure_ascii): what the template renders counts
             "prompt_messages": '[{"role": "user", "content": "Rank: \\u003c|im_end|\\u003e?"}]' if i == 2 else None,
             "responses": ["1 2", long if i < 2 else "3", "5<|im_end|>" if i == 0 else "5"],
             "ranking": [[0], [1], [2]],
             "ranked_prefix": 3, "cluster": "c0", "split": "train", "source": "test",
             # generations that max_new_tokens cut (no EOS either way): the cache cuts the long one again
             "generated": [long, "7"], "generated_finished": [False, False]} for i in range(4)]
    with store.writer("ingest", "r1", config={}) as writer:
        writer.write_shard(0, pa.Table.from_pylist(rows))
    with caplog.at_level(logging.WARNING, logger="moplex_core.cache"):
        result = run_cache(CacheConfig(model=str(tiny_model_dir), max_response_tokens=8, max_prompt_tokens=40),
                           store.path("ingest", "r1"), store, progress=False)
    summary = read_manifest(result.path)["summary"]
    assert summary["truncated_responses"] == 2 + 4 and summary["max_response_tokens"] == 8
    assert "6 response(s) are longer than cache.max_response_tokens = 8" in caplog.text
    assert summary["prompts_at_max_prompt_tokens"] == 1  # the long one; the chat-rendered others are shorter
    assert summary["responses_ending_with_eos_text"] == 1
    assert summary["prompts_with_special_token_text"] == 2
    assert "2 prompt(s) hold the text of special tokens ('<|im_end|>'): it is encoded as those control" in caplog.text
    assert "1 response(s) end with the tokenizer's eos_token text '<|im_end|>'" in caplog.text
    assert "1 prompt(s) reach cache.max_prompt_tokens = 40 tokens: they were cut from the left" in caplog.text


# ---------------------------------------------------------------------------------------------------
# moplex run: the root cause, first, on stderr


def test_a_failed_pipeline_run_reports_the_stage_and_the_exception_not_prefects_wrapping():
    from prefect.states import Failed

    from flows.pipeline import failure_cause

    err = RawSchemaError("x.jsonl line 2 is not valid JSON (column 9: Expecting ',' delimiter)")
    err.add_note("moplex pipeline stage: ingest")
    state = Failed(data=err, message="Flow run encountered an exception: RawSchemaError: x.jsonl line 2 ...")
    assert failure_cause(state) == ("the ingest stage failed: RawSchemaError: x.jsonl line 2 is not valid JSON "
                                    "(column 9: Expecting ',' delimiter)")
    assert failure_cause(Failed(message="the run crashed")) == "the run crashed"


def test_a_settings_check_between_stages_is_told_apart_from_a_stages_failure():
    # a retry of the flow run applies the same settings: only a stage's failure is worth retrying
    from prefect.states import Failed

    from flows.pipeline import refused_its_settings

    stage_failed = RawSchemaError("x.jsonl line 2 is not valid JSON")
    stage_failed.add_note("moplex pipeline stage: ingest")
    checked = ValueError("cache.max_prompt_tokens + cache.max_response_tokens = 512 + 512 exceeds the 128 positions")
    assert refused_its_settings(Failed(data=checked))
    assert not refused_its_settings(Failed(data=stage_failed))
    assert not refused_its_settings(Failed(data=OSError("NFS server not responding")))
    assert not refused_its_settings(Failed(message="the run crashed"))



def test_split_sizes_that_leave_rankings_out_say_so(tmp_path, caplog):
    # Prompts are placed whole, each in the first split with room for all its rankings: a two-ranking
    # prompt after a one-ranking one fits nowhere in sizes [2, 1, 1]. Left out, and counted.
    path = tmp_path / "rankings.jsonl"
    rows = [{**GOOD, "example_id": "a", "prompt": "one"}, {**GOOD, "example_id": "b", "prompt": "two"},
            {**GOOD, "example_id": "c", "prompt": "two", "ranking": [[2], [1], [0]]},
            {**GOOD, "example_id": "d", "prompt": "three"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    left_out = []
    for seed in range(8):  # the seed's prompt order decides whether the two-ranking prompt fits
        with caplog.at_level(logging.WARNING, logger="moplex_core.ingest"):
            caplog.clear()
            built = build_rankings(IngestConfig(dataset="generic", path=str(path), split={"sizes": [2, 1, 1]},
                                                seed=seed))
        outside = built.summary["left_out_by_split_sizes"]
        assert outside == len(rows) - built.table.num_rows
        assert bool(outside) == any("split.sizes [2, 1, 1] reached" in r.message for r in caplog.records)
        left_out.append(outside)
    assert 0 in left_out and 2 in left_out
