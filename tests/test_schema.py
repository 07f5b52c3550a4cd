"""The rankings contract: every bad-row kind is named by row, example_id, field and reason."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pytest

from moplex_core.schema import (
    RANKINGS_SCHEMA,
    REJECTED_SCHEMA,
    SchemaError,
    check_rankings,
    ranking_from_scores,
    split_rejected,
)


def row(**changes) -> dict:
    base = {
        "example_id": "e0",
        "prompt_id": "p0",
        "prompt": "Which answer is best?",
        "prompt_messages": None,
        "responses": ["first", "second", "third"],
        "ranking": [[1], [0, 2]],
        "ranked_prefix": 2,
        "cluster": "helpfulness",
        "split": "train",
        "source": "test",
    }
    return {**base, **changes}


def good_rows(n: int = 3) -> list[dict]:
    return [row(example_id=f"e{i}", prompt_id=f"p{i}") for i in range(n)]


def test_valid_rows_come_back_in_the_canonical_schema():
    for data in (good_rows(), pd.DataFrame(good_rows()), pa.Table.from_pylist(good_rows())):
        table = check_rankings(data, labels=["helpfulness", "honesty"])
        assert table.schema == RANKINGS_SCHEMA
        assert table.column("ranking").to_pylist()[0] == [[1], [0, 2]]


def test_a_canonical_table_round_trips_through_pandas_and_parquet_types():
    table = check_rankings(good_rows())
    assert check_rankings(table.to_pandas()).equals(table)  # numpy arrays inside object columns
    wide = table.cast(pa.schema([f.with_type(pa.large_string()) if f.type == pa.string() else f
                                 for f in RANKINGS_SCHEMA]))
    assert check_rankings(wide).equals(table)


BAD_ROWS = [
    ("ranking", {"ranking": [[1], [0]]}, "responses [2] are in no tier"),
    ("ranking", {"ranking": [[1], [0, 2, 1]]}, "index 1 appears twice (tiers 0 and 1)"),
    ("ranking", {"ranking": [[1], [0, 3], [2]]}, "index 3 in tier 1 is outside 0..2"),
    ("ranking", {"ranking": [[1], [], [0, 2]]}, "tier 1 is empty"),
    ("ranking", {"ranking": []}, "has no tiers"),
    ("responses", {"responses": ["only one"], "ranking": [[0]], "ranked_prefix": 1}, "has 1 response(s); a ranking needs at least 2"),
    ("responses", {"responses": ["first", "", "third"]}, "response 1 is empty or whitespace-only"),
    ("responses", {"responses": ["first", " \n\t", "third"]}, "response 1 is empty or whitespace-only"),
    ("ranked_prefix", {"ranked_prefix": 3}, "is 3; it counts observed tiers, so 1..2"),
    ("ranked_prefix", {"ranked_prefix": 0}, "is 0"),
    ("cluster", {"cluster": "verbosity"}, "'verbosity' is not in the declared label set"),
    ("cluster", {"cluster": " "}, "is ' '; leave it out (null) for a ranking without a label"),
    ("cluster", {"cluster": "all"}, "'all' is reserved: the evaluation's rows name the average over"),
    ("cluster", {"cluster": "adapter c3"}, "'adapter c3' is reserved"),
    ("split", {"split": "dev"}, "is 'dev'; expected one of train, validation, test"),
    ("prompt", {"prompt": "   "}, "is missing or empty"),
    ("prompt_messages", {"prompt_messages": "not json"}, "is not valid JSON"),
    ("prompt_messages", {"prompt_messages": json.dumps([{"role": "user"}])}, "must be a JSON list of"),
    ("prompt_messages", {"prompt_messages": "[]"}, "must end before the answers"),
    ("prompt_messages", {"prompt_messages": json.dumps([{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a"}])},
     "last message is not the assistant's"),
    ("responses", {"responses": "first"}, "expected list<item: string>, got str 'first'"),
    ("ranked_prefix", {"ranked_prefix": "2"}, "expected int32, got str '2'"),
    ("ranked_prefix", {"ranked_prefix": 1.5}, "expected int32, got float 1.5; indices and counts are whole numbers"),
    ("ranking", {"ranking": [[1], [0.5, 2]]}, "got list [[1], [0.5, 2]]; indices and counts are whole numbers"),
    ("ranking", {"ranking": [[True], [0, 2]]}, "expected list<item: list<item: int32>>, got list [[True], [0, 2]]"),
    ("ranking", {"ranking": [2, 0, 1]}, "got list [2, 0, 1]; a ranking is a list of tiers, best first, each a list "
                                        "of response indices: [[2], [0], [1]] for 2 > 0 > 1"),
    ("ranking", {"ranking": "[[0], [1, 2]]"}, "got str '[[0], [1, 2]]'; give the list itself, not its text"),
    ("ranking", {"ranking": None, "ranked_prefix": None}, "is missing"),  # and nothing of its prefix
    ("ranking", {"ranking": 3}, "expected list<item: list<item: int32>>, got int 3"),
    ("ranking", {"ranking": [True, False]}, "got list [True, False]"),
]


@pytest.mark.parametrize(("field", "change", "reason"), BAD_ROWS, ids=[f"{f}:{r[:28]}" for f, _, r in BAD_ROWS])
def test_each_bad_row_kind_is_named_by_row_example_id_field_and_reason(field, change, reason):
    rows = good_rows()
    rows[1] = row(example_id="bad-one", prompt_id="p1", **change)
    with pytest.raises(SchemaError) as err:
        check_rankings(rows, labels=["helpfulness"])
    issues = err.value.issues
    assert {(i.row, i.example_id, i.field) for i in issues} == {(1, "bad-one", field)}
    assert any(reason in i.reason for i in issues), [i.reason for i in issues]
    message = str(err.value)
    assert "row 1 (example_id 'bad-one')" in message and repr(field) in message and reason in message
    assert "validation='drop'" in message  # says what to do
    assert isinstance(err.value, ValueError)


def test_duplicate_example_ids_and_a_prompt_in_two_splits_name_both_rows():
    rows = good_rows()
    rows[2] = row(example_id="e0", prompt_id="p0", split="test")
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    reasons = {(i.row, i.field): i.reason for i in err.value.issues}
    assert "is also the example_id of row 0" in reasons[(2, "example_id")]
    assert "'test' here and in 'train' at row 0; a prompt must stay in one split" in reasons[(2, "split")]


def test_a_rejected_row_claims_neither_its_id_nor_its_prompts_split():
    rows = good_rows()
    rows[0] = row(example_id="e0", ranking=[[7], [0, 2]])  # rejected for its ranking, in train
    rows[1] = row(example_id="e0", prompt_id="p0", split="test")  # valid, but it shares row 0's id and prompt
    rows[2] = row(example_id="e2", prompt_id="p0", split="test")
    kept, rejected = split_rejected(rows)
    assert kept.column("example_id").to_pylist() == ["e0", "e2"] and kept.column("split").to_pylist() == ["test"] * 2
    reasons = {(r["row"], r["field"]): r["reason"] for r in rejected.to_pylist()}
    assert set(reasons) == {(0, "ranking"), (0, "example_id"), (0, "split")}  # row 0 says everything
    assert "is also the example_id of row 1" in reasons[(0, "example_id")]
    assert "is in 'train' here and in 'test' at row 1;" in reasons[(0, "split")]
    with pytest.raises(SchemaError) as err:  # strict mode names the same three
        check_rankings(rows)
    assert {(i.row, i.field) for i in err.value.issues} == set(reasons)


@pytest.mark.parametrize("rows, kept_ids, rejected", [
    ([row(example_id="e0", prompt_id="p0", prompt="P"),  # a row rejected for its id still claims nothing
      row(example_id="e0", prompt_id="q", prompt="Q", split="test"),
      row(example_id="e2", prompt_id="q", prompt="Q")],
     ["e0", "e2"], {(1, "example_id"), (1, "split")}),
    ([row(example_id="e0", prompt_id="p0", prompt="T"),  # nor one rejected for its prompt text's split
      row(example_id="e1", prompt_id="p1", prompt="T", split="test"),
      row(example_id="e2", prompt_id="p1", prompt="U")],
     ["e0", "e2"], {(1, "split")}),
    ([row(example_id="e0", prompt_id="p0", ranking=[[7], [0, 2]]),  # two rejected rows still name their conflicts
      row(example_id="e0", prompt_id="p0", ranking=[[7], [0, 2]], split="test"),
      row(example_id="e9", prompt_id="p9", prompt="other")],
     ["e9"], {(0, "ranking"), (1, "ranking"), (1, "example_id"), (1, "split")}),
])
def test_rows_rejected_for_a_conflict_claim_nothing_either(rows, kept_ids, rejected):
    kept, reasons = split_rejected(rows)
    assert kept.column("example_id").to_pylist() == kept_ids
    assert {(r["row"], r["field"]) for r in reasons.to_pylist()} == rejected
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    assert {(i.row, i.field) for i in err.value.issues} == rejected


def test_two_identical_rankings_under_one_id_are_told_to_take_their_own_ids():
    rows = good_rows()
    rows[1] = dict(rows[0])  # the same ranking again, under the same id
    rows[2] = row(example_id="e0", prompt_id="p2", ranking=[[0], [1, 2]])  # the same id on another ranking
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    reasons = {(i.row, i.field): i.reason for i in err.value.issues}
    assert "give each row its own example_id to keep both" in reasons[(1, "example_id")]
    assert reasons[(2, "example_id")].endswith("ids must be unique")


def test_the_error_lists_a_last_issue_rather_than_saying_one_more():
    rows = [row(example_id=f"e{i}", prompt_id=f"p{i}", ranking=[[9], [0]]) for i in range(6)]
    message = str(pytest.raises(SchemaError, check_rankings, rows).value)
    assert "row 5" in message and "more" not in message
    rows.append(row(example_id="e6", prompt_id="p6", ranking=[[9], [0]]))
    rows.append(row(example_id="e7", prompt_id="p7", prompt=""))
    message = str(pytest.raises(SchemaError, check_rankings, rows).value)
    assert "row 6" not in message.split("... and")[0]  # five listed, then what they leave out by field
    assert ("... and 3 more: 2 x field 'ranking' (the first: row 5 (example_id 'e5'): "
            in message and "; 1 x field 'prompt' (row 7 (example_id 'e7'): " in message)


def test_one_prompt_text_under_two_prompt_ids_stays_in_one_split():
    rows = good_rows()  # one prompt text under the ids p0, p1, p2
    rows[1] = row(example_id="e1", prompt_id="p1", split="test")
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    assert [(i.row, i.field) for i in err.value.issues] == [(1, "split")]
    assert "its prompt text is in 'test' here and in 'train' at row 0;" in err.value.issues[0].reason


def test_whole_floats_are_read_as_the_integers_they_are():
    # a pandas column with a gap holds floats: 2.0 is 2, where 2.5 is refused (above)
    rows = good_rows()
    rows[0] = row(ranking=[[1.0], [0.0, 2.0]], ranked_prefix=2.0)
    table = check_rankings(rows)
    assert table.column("ranking").to_pylist()[0] == [[1], [0, 2]] and table.column("ranked_prefix")[0].as_py() == 2


def test_missing_extra_and_mistyped_columns_are_table_errors():
    rows = [{k: v for k, v in r.items() if k != "ranking"} | {"generated": ["x"]} for r in good_rows()]
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    assert {(i.row, i.field) for i in err.value.issues} == {(None, "ranking"), (None, "generated")}
    assert "column 'generated': is not a rankings column (generated responses belong to the augmented stage)" in str(err.value)

    mistyped = pa.Table.from_pylist(good_rows()).set_column(6, "ranked_prefix", pa.array(["2", "2", "2"]))
    with pytest.raises(SchemaError, match="column 'ranked_prefix': has type string, expected int32"):
        check_rankings(mistyped)
    with pytest.raises(SchemaError, match="ranked_prefix"):
        split_rejected(mistyped)  # dropping rows cannot fix a column


def test_prompt_messages_is_optional_and_validated_when_present():
    rows = [{k: v for k, v in r.items() if k != "prompt_messages"} for r in good_rows()]
    assert check_rankings(rows).column("prompt_messages").null_count == 3
    messages = json.dumps([{"role": "user", "content": "Which answer is best?"}])
    assert check_rankings([row(prompt_messages=messages)]).column("prompt_messages")[0].as_py() == messages


def test_all_bad_rows_are_listed_and_the_message_shows_the_first_few():
    rows = [row(example_id=f"e{i}", prompt_id=f"p{i}", responses=["a", ""]) for i in range(9)]
    with pytest.raises(SchemaError) as err:
        check_rankings(rows)
    assert len(err.value.issues) >= 9
    assert "9 invalid row(s)" in str(err.value) and "... and" in str(err.value)


def test_drop_mode_keeps_valid_rows_and_reports_the_others_with_their_record():
    rows = good_rows(4)
    rows[1] = row(example_id="dup", prompt_id="p1", ranking=[[0], [0, 1, 2]])
    rows[3] = row(example_id="empty", prompt_id="p3", responses=["a", "b", ""], cluster="other")
    kept, rejected = split_rejected(rows, labels=["helpfulness"])
    assert kept.schema == RANKINGS_SCHEMA
    assert kept.column("example_id").to_pylist() == ["e0", "e2"]
    assert rejected.schema == REJECTED_SCHEMA
    got = {(r["row"], r["example_id"], r["field"]) for r in rejected.to_pylist()}
    assert got == {(1, "dup", "ranking"), (3, "empty", "responses"), (3, "empty", "cluster")}
    record = json.loads(rejected.to_pylist()[0]["record"])
    assert record["example_id"] == "dup" and record["ranking"] == [[0], [0, 1, 2]]


def test_rows_may_be_checked_before_they_are_split():
    rows = [row(example_id=f"e{i}", prompt_id=f"p{i}", split=None) for i in range(2)]
    table = check_rankings(rows, require_split=False)
    assert table.column("split").null_count == 2
    with pytest.raises(SchemaError, match="field 'split': is missing"):
        check_rankings(rows)


def test_ranking_from_scores_turns_ties_into_tiers():
    assert ranking_from_scores([3, 5, 3, 1]) == [[1], [0, 2], [3]]
    assert ranking_from_scores([2.0, 2.0]) == [[0, 1]]


def test_a_dataframe_or_arrow_table_is_split_as_its_rows_are_and_rejected_records_are_the_rows():
    """split_rejected takes what check_rankings takes: a DataFrame (numpy arrays in list cells) and an
    Arrow table name the same issues, and record the same rejected rows as JSON, as the rows as dicts."""
    rows = good_rows()
    rows[1] = row(example_id="e1", prompt_id="p1", ranking=[[7], [0, 2]])
    expected_kept, expected = split_rejected(rows)
    assert expected.num_rows == 1 and json.loads(expected.column("record")[0].as_py())["ranking"] == [[7], [0, 2]]
    for data in (pd.DataFrame(rows), pa.Table.from_pylist(rows)):
        kept, rejected = split_rejected(data)
        assert kept.equals(expected_kept) and rejected.equals(expected)
