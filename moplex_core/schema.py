"""The canonical `rankings` table (DESIGN.md 3) and the checks every ingested row must pass.

One row is one ranking instance: a prompt, its m original responses, and a ranking of ALL of them as
ordered tiers (best first; a tier holds tied responses). Partial observation is expressed by
``ranked_prefix`` (only the first l tiers are observed), never by leaving responses out of the
ranking. Generated responses (the augmented stage's ``generated`` column) are never in ``ranking``
and never in this table.

`check_rankings` returns the rows as an Arrow table in the canonical schema or raises a
`SchemaError` naming every bad row (row number, example_id, field, reason); `split_rejected` keeps
the good rows and returns the bad ones with their reasons instead.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, get_args

import pandas as pd
import pyarrow as pa

from moplex_core.config.base import SplitName
from moplex_core.hashing import short_hash
from moplex_core.pl import UNRANKED, encode_tiers

SPLITS: tuple[str, ...] = get_args(SplitName)

RANKINGS_SCHEMA = pa.schema(
    [
        pa.field("example_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_messages", pa.string()),
        pa.field("responses", pa.list_(pa.string()), nullable=False),
        pa.field("ranking", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("ranked_prefix", pa.int32(), nullable=False),
        pa.field("cluster", pa.string()),
        pa.field("split", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
    ]
)
OPTIONAL_COLUMNS = frozenset({"prompt_messages"})

REJECTED_SCHEMA = pa.schema(
    [
        pa.field("row", pa.int64()),  # the adapter's row number; null for a source record that could not be read
        pa.field("where", pa.string()),  # where the source record was read, e.g. "data.jsonl line 3", when known
        pa.field("example_id", pa.string()),
        pa.field("field", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("record", pa.string()),  # the row (a generic source's record as read) as JSON, to fix and re-ingest
    ]
)

_MESSAGE_ROWS = 5
_ADAPTER_NAME = re.compile(r"adapter c\d+")  # evaluate's name of an EM cluster (diagnostics rows)


@dataclass(frozen=True)
class RowIssue:
    """One reason a row (or, with ``row`` None, the whole table) breaks the contract."""

    row: int | None
    example_id: str | None
    field: str
    reason: str
    where: str | None = None  # where the row was read, e.g. "data.jsonl line 3"

    @property
    def place(self) -> str:
        """The row, where it was read and its example_id: "row 3 (data.jsonl line 4, example_id 'e3')"."""
        about = ", ".join(([self.where] if self.where else [])
                          + ([f"example_id {self.example_id!r}"] if self.example_id else []))
        return f"row {self.row}{f' ({about})' if about else ''}"

    def __str__(self) -> str:
        if self.row is None:
            return f"column {self.field!r}: {self.reason}"
        return f"{self.place}, field {self.field!r}: {self.reason}"


DROP_MODE = ("`moplex ingest ... --set validation=drop` (`--set ingest.validation=drop` with `moplex run`; "
             "IngestConfig(validation='drop') in Python)")
"""How to ingest in drop mode, from each entry point: every error that suggests it says it so."""


class SchemaError(ValueError):
    """Rows or columns that break the `rankings` contract; ``issues`` lists all of them."""

    def __init__(self, issues: Sequence[RowIssue], what: str = "rankings"):
        self.issues = list(issues)
        rows = sorted({i.row for i in self.issues if i.row is not None})
        listed = _MESSAGE_ROWS + (len(self.issues) == _MESSAGE_ROWS + 1)  # not "... and 1 more"
        shown = "\n  ".join(str(i) for i in self.issues[:listed])
        more = len(self.issues) - listed
        if more > 0:  # every field at fault named, though not every row
            shown += f"\n  ... and {more} more: " + issues_by_field(
                [(i.field, f"{i.place}: {i.reason}" if i.row is not None else i.reason) for i in self.issues[listed:]])
        head = (
            f"{what}: {len(rows)} invalid row(s)" if rows else f"{what}: the table does not have the canonical schema"
        )
        tail = (
            f"Fix the source rows, or ingest in drop mode to keep the valid rows and record these in "
            f"rejected.parquet: {DROP_MODE}."
            if rows
            else "Produce the columns of moplex_core.schema.RANKINGS_SCHEMA with those types."
        )
        super().__init__(f"{head}:\n  {shown}\n{tail}")


def issues_by_field(issues: Sequence[tuple[str | None, str]]) -> str:
    """How many of ``issues`` ((field, the issue as a user reads it, with its row); field None: a record
    that could not be read) each field has, with the first of them: the end of a message that cannot
    list every row but must name every field at fault."""
    groups: dict[str | None, list[str]] = {}
    for field, text in issues:
        groups.setdefault(field, []).append(text)
    return "; ".join(f"{len(texts)} x {'an unreadable record' if field is None else f'field {field!r}'} "
                     f"({'the first: ' if len(texts) > 1 else ''}{texts[0]})" for field, texts in groups.items())


def check_rankings(
    data: pa.Table | pd.DataFrame | Sequence[dict[str, Any]],
    labels: Collection[str] | None = None,
    require_split: bool = True,
    where: Sequence[str] | None = None,
    made_ids: bool = False,
) -> pa.Table:
    """The rows in the canonical schema, or `SchemaError` listing every bad row.

    ``labels``, when given, is the declared cluster label set; a non-null cluster outside it is an
    error. With ``require_split=False`` a null split is accepted (rows validated before splitting).
    ``where``, one entry per row (e.g. "data.jsonl line 3"), is named beside each bad row. With
    ``made_ids`` (ingest: its sources make the ids a record leaves out, from its prompt and
    ranking) an absent example_id or prompt_id is not named in a row with other faults: it is
    absent because of them.
    """
    table, issues = _validate(data, labels, require_split, where, made_ids)
    if issues:
        raise SchemaError(issues)
    return _cast(table, require_split)


def split_rejected(
    data: pa.Table | pd.DataFrame | Sequence[dict[str, Any]],
    labels: Collection[str] | None = None,
    require_split: bool = True,
    where: Sequence[str] | None = None,
    originals: Sequence[dict[str, Any]] | None = None,
    made_ids: bool = False,
) -> tuple[pa.Table, pa.Table]:
    """(valid rows in the canonical schema, one `REJECTED_SCHEMA` row per issue of the others).

    A rejected row's ``record`` is the row as JSON, or its source record as read where ``originals``
    gives one per row (`AdapterOutput.originals`). Table-level problems (missing columns, a column of
    the wrong type) cannot be fixed by dropping rows and still raise `SchemaError`. ``made_ids``: as
    `check_rankings`'s.
    """
    table, issues = _validate(data, labels, require_split, where, made_ids)
    table_level = [i for i in issues if i.row is None]
    if table_level:
        raise SchemaError(table_level)
    bad_rows = {i.row for i in issues}
    keep = pa.array([r not in bad_rows for r in range(table.num_rows)], pa.bool_())
    records = _records_as_json(data if originals is None else originals, sorted(bad_rows))
    rejected = pa.Table.from_pylist(
        [
            {"row": i.row, "where": i.where, "example_id": i.example_id, "field": i.field, "reason": i.reason,
             "record": records[i.row]}
            for i in issues
        ],
        schema=REJECTED_SCHEMA,
    )
    return _cast(table.filter(keep), require_split), rejected


def _cast(table: pa.Table, require_split: bool) -> pa.Table:
    """The canonical schema; before splitting, ``split`` stays nullable (it is all null)."""
    if require_split:
        return table.cast(RANKINGS_SCHEMA)
    return table.cast(RANKINGS_SCHEMA.set(RANKINGS_SCHEMA.get_field_index("split"),
                                          RANKINGS_SCHEMA.field("split").with_nullable(True)))


def ranking_row(
    example_id: str,
    prompt: str,
    responses: list[str],
    ranking: list[list[int]],
    cluster: str | None,
    source: str,
) -> dict[str, Any]:
    """One canonical row, fully observed (``ranked_prefix`` = number of tiers), not yet split."""
    return {
        "example_id": example_id,
        "prompt_id": prompt_id(prompt),
        "prompt": prompt,
        "prompt_messages": None,
        "responses": responses,
        "ranking": ranking,
        "ranked_prefix": len(ranking),
        "cluster": cluster,
        "split": None,
        "source": source,
    }


def prompt_id(prompt: str) -> str:
    """The id splits group by: a hash of the prompt text, so the same prompt never lands in two splits."""
    return short_hash(prompt)


def ranking_from_scores(scores: Sequence[float]) -> list[list[int]]:
    """Tiers of indices, best (highest score) first; equal scores share a tier ("ties become tiers")."""
    levels = sorted(set(scores), reverse=True)
    return [[j for j, s in enumerate(scores) if s == level] for level in levels]


def _validate(
    data: pa.Table | pd.DataFrame | Sequence[dict[str, Any]],
    labels: Collection[str] | None,
    require_split: bool,
    where: Sequence[str] | None = None,
    made_ids: bool = False,
) -> tuple[pa.Table, list[RowIssue]]:
    columns, n = _columns(data)
    missing = [f.name for f in RANKINGS_SCHEMA if f.name not in columns and f.name not in OPTIONAL_COLUMNS]
    extra = [c for c in columns if RANKINGS_SCHEMA.get_field_index(c) < 0]
    issues = [RowIssue(None, None, c, "is missing") for c in missing]
    issues += [
        RowIssue(None, None, c, "is not a rankings column (generated responses belong to the augmented stage)"
                 if c == "generated" else "is not a rankings column; drop it")
        for c in extra
    ]
    if issues:
        return pa.table({}), issues

    arrays: dict[str, pa.Array] = {}
    values: dict[str, list[Any]] = {}  # the same columns as Python values, for the row checks
    for f in RANKINGS_SCHEMA:
        if f.name not in columns:
            arrays[f.name], values[f.name] = pa.nulls(n, f.type), [None] * n
            continue
        arrays[f.name], values[f.name], col_issues = _convert(columns[f.name], f)
        issues += col_issues
    if any(i.row is None for i in issues):
        return pa.table({}), [i for i in issues if i.row is None]

    # A value of the wrong type was nulled by _convert; do not report it a second time as missing.
    typed = {(i.row, i.field) for i in issues}
    issues += [i for i in _row_issues(values, n, labels, require_split, where, {row for row, _ in typed})
               if (i.row, i.field) not in typed]
    if made_ids:  # an id the source would have made is absent because of another fault of its row
        def unmade(i: RowIssue) -> bool:
            return (i.field in ("example_id", "prompt_id") and values[i.field][i.row] is None
                    and (i.row, i.field) not in typed)
        faulty = {i.row for i in issues if not unmade(i)}
        issues = [i for i in issues if not (unmade(i) and i.row in faulty)]
    issues = [RowIssue(i.row, values["example_id"][i.row] if i.example_id is None else i.example_id, i.field,
                       i.reason, None if where is None else where[i.row])
              for i in issues]
    order = {f.name: k for k, f in enumerate(RANKINGS_SCHEMA)}
    issues.sort(key=lambda i: (i.row, order[i.field]))
    return pa.table(arrays, schema=pa.schema([f.with_nullable(True) for f in RANKINGS_SCHEMA])), issues


def _columns(data: pa.Table | pd.DataFrame | Sequence[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """Column name -> an Arrow array or a Python list of values, and the row count."""
    if isinstance(data, pa.Table):
        return {name: data.column(name).combine_chunks() for name in data.column_names}, data.num_rows
    if isinstance(data, pd.DataFrame):
        return {name: [_plain(v) for v in data[name].tolist()] for name in data.columns}, len(data)
    names: dict[str, None] = {}
    for row in data:
        names.update(dict.fromkeys(row))
    return {name: [_plain(row.get(name)) for row in data] for name in names}, len(data)


def _plain(value: Any) -> Any:
    """numpy arrays and scalars from pandas/pyarrow round trips as plain Python values; NaN as None."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def _convert(values: Any, f: pa.Field) -> tuple[pa.Array, list[Any], list[RowIssue]]:
    """A column as an Arrow array of the canonical type and as Python values; values that do not fit
    become null, with an issue each."""
    if isinstance(values, pa.Array):
        if not _compatible(values.type, f.type):
            return values, [], [RowIssue(None, None, f.name, f"has type {values.type}, expected {f.type}")]
        try:
            array = values.cast(f.type)
        except pa.ArrowInvalid as err:
            return values, [], [RowIssue(None, None, f.name, f"does not fit {f.type}: {err}")]
        return array, array.to_pylist(), []
    if all(_fits(v, f.type) for v in values):
        try:
            array = pa.array(values, type=f.type)
            return array, (array.to_pylist() if _holds_integers(f.type) else values), []  # 2.0 read as 2
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            pass
    converted, issues = [], []
    for r, v in enumerate(values):
        try:
            if not _fits(v, f.type):
                raise TypeError
            converted.append(pa.array([v], type=f.type).to_pylist()[0])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            converted.append(None)
            issues.append(RowIssue(r, None, f.name, f"expected {f.type}, got {type(v).__name__} {_short(v)}"
                                   + _type_hint(f, v)))
    return pa.array(converted, type=f.type), converted, issues


def _fits(value: Any, type_: pa.DataType) -> bool:
    """Whether Arrow's conversion to ``type_`` keeps ``value``: it would read a string as a list of
    characters (a list field must hold lists), and truncate 2.7 to the integer 2 (an integer field
    takes integers, or floats that are whole: 2.0, as a pandas column with a gap writes them)."""
    if value is None:
        return True
    if pa.types.is_list(type_):
        return isinstance(value, (list, tuple)) and all(_fits(v, type_.value_type) for v in value)
    if pa.types.is_integer(type_):  # numpy and Python integers; whole floats and decimals
        return not isinstance(value, bool) and (isinstance(value, numbers.Integral) or _whole(value))
    return True


def _holds_integers(type_: pa.DataType) -> bool:
    """An integer field, or lists of them: where Arrow's value can differ from the one given (2.0 -> 2)."""
    return pa.types.is_integer(type_) or (pa.types.is_list(type_) and _holds_integers(type_.value_type))


def _whole(value: Any) -> bool:
    """A finite number without a fraction (2, 2.0, Decimal("2"))."""
    return isinstance(value, (numbers.Real, Decimal)) and math.isfinite(value) and value == int(value)


def _type_hint(f: pa.Field, value: Any) -> str:
    """What a value of the wrong type for field ``f`` was probably meant as, or ""."""
    if _has_fraction(value):
        return "; indices and counts are whole numbers"
    if isinstance(value, str) and pa.types.is_list(f.type):
        return "; give the list itself, not its text"
    flat = isinstance(value, (list, tuple)) and value and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value)
    if f.name == "ranking" and flat:  # an order without tiers
        return (f"; a ranking is a list of tiers, best first, each a list of response indices: "
                f"{[[v] for v in value]} for {' > '.join(map(str, value))}")
    return ""


def _has_fraction(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_fraction(v) for v in value)
    return isinstance(value, (numbers.Real, Decimal)) and math.isfinite(value) and not _whole(value)


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Types that hold the same values (int64 for int32, large_string for string, ...)."""
    if actual == expected or pa.types.is_null(actual):
        return True
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    if pa.types.is_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    if pa.types.is_list(expected):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and _compatible(
            actual.value_type, expected.value_type
        )
    return False


def _row_issues(
    columns: dict[str, list[Any]], n: int, labels: Collection[str] | None, require_split: bool,
    where: Sequence[str] | None = None, typed: Collection[int] = (),
) -> list[RowIssue]:
    """Each row's own checks, then the checks across rows (a unique example_id, one split per prompt).

    The rows valid by themselves (with no value of the wrong type either: ``typed``) claim, in order,
    an id and their prompt's split, each unless an earlier kept row holds it, which rejects the row;
    so a row that drop mode rejects never costs a later valid row its place. Each rejected row is then
    checked against the kept rows' claims and against the rejected rows before it, so that its
    reasons, and strict mode's error, still name every conflict."""
    issues: list[RowIssue] = []
    label_set = None if labels is None else set(labels)
    rows = [{name: values[r] for name, values in columns.items()} for r in range(n)]
    for r, row in enumerate(rows):
        issues += [RowIssue(r, row["example_id"], field, reason)
                   for field, reason in _own_issues(row, label_set, require_split)]
    rejected = {i.row for i in issues} | set(typed)
    kept, among_rejected = _Claims(rows, where), _Claims(rows, where)
    for r in range(n):
        if r in rejected:
            continue
        found = kept.conflicts(r, rows[r])
        if found:
            rejected.add(r)
            issues += [RowIssue(r, rows[r]["example_id"], field, reason) for field, reason in found]
        else:
            kept.claim(r, rows[r])
    reported = {(i.row, i.field) for i in issues}
    for r in sorted(rejected):
        found = kept.conflicts(r, rows[r])
        found += [(field, reason) for field, reason in among_rejected.conflicts(r, rows[r])
                  if field not in {f for f, _ in found}]
        issues += [RowIssue(r, rows[r]["example_id"], field, reason) for field, reason in found
                   if (r, field) not in reported]
        among_rejected.claim(r, rows[r])
    return issues


class _Claims:
    """The first row that holds each example_id, and each prompt's split with the first row that put
    it there (by prompt_id and by prompt text: a source's own ids may give one text two ids)."""

    def __init__(self, rows: Sequence[dict[str, Any]], where: Sequence[str] | None) -> None:
        self.rows, self.where = rows, where
        self.row_of_id: dict[str, int] = {}
        self.split_of_prompt: dict[Any, tuple[str, int]] = {}  # prompt_id or ("text", prompt) -> (split, row)

    def row_at(self, r: int) -> str:  # another row a reason points to, with its file and line where known
        return f"row {r}" if self.where is None else f"row {r} ({self.where[r]})"

    def conflicts(self, r: int, row: dict[str, Any]) -> list[tuple[str, str]]:
        """(field, reason) for each claim of another row that ``row`` contradicts."""
        found = []
        other = self.row_of_id.get(row["example_id"])
        if other is not None and other != r:
            same = all(row[name] == self.rows[other][name] for name in _CONTENT)
            found.append(("example_id", f"is also the example_id of {self.row_at(other)}; ids must be unique"
                          + ("; the two rows are the same ranking: give each row its own example_id to keep "
                             "both" if same else "")))
        for key, what in _prompt_keys(row):
            seen = self.split_of_prompt.get(key)
            if seen is not None and seen[0] != row["split"]:
                found.append(("split", f"{what} is in {row['split']!r} here and in {seen[0]!r} at "
                                       f"{self.row_at(seen[1])}; a prompt must stay in one split (the rows would be "
                                       "trained and tested on)"))
                break
        return found

    def claim(self, r: int, row: dict[str, Any]) -> None:
        eid = row["example_id"]
        if eid is not None and eid.strip():
            self.row_of_id.setdefault(eid, r)
        for key, _ in _prompt_keys(row):
            self.split_of_prompt.setdefault(key, (row["split"], r))


_CONTENT = ("prompt_id", "prompt", "responses", "ranking", "cluster")
"""What two rows hold the same ranking in (a generic source's missing example_id is made from it)."""


def _prompt_keys(row: dict[str, Any]) -> list[tuple[Any, str]]:
    """The keys a row with a known split holds its prompt's split under, each with how a reason names it."""
    keys: list[tuple[Any, str]] = []
    if row["split"] in SPLITS:
        if row["prompt_id"] is not None:
            keys.append((row["prompt_id"], f"prompt_id {row['prompt_id']!r}"))
        if row["prompt"] is not None:
            keys.append((("text", row["prompt"]), "its prompt text"))
    return keys


def _own_issues(row: dict[str, Any], label_set: set[str] | None, require_split: bool) -> list[tuple[str, str]]:
    """(field, reason) for what is wrong with one row by itself."""
    found: list[tuple[str, str]] = []

    def bad(field: str, reason: str) -> None:
        found.append((field, reason))

    for name in ("example_id", "prompt_id", "prompt", "source"):
        if row[name] is None or not row[name].strip():
            bad(name, "is missing or empty")
    if row["prompt_messages"] is not None:
        reason = _messages_issue(row["prompt_messages"])
        if reason:
            bad("prompt_messages", reason)
    responses = row["responses"]
    if responses is None:
        bad("responses", "is missing")
    else:
        if len(responses) < 2:
            bad("responses", f"has {len(responses)} response(s); a ranking needs at least 2")
        for j, text in enumerate(responses):
            if text is None or not text.strip():
                bad("responses", f"response {j} is empty or whitespace-only")
    ranking = row["ranking"]
    if ranking is None:
        bad("ranking", "is missing")
    elif responses is not None:
        for reason in _ranking_issues(ranking, len(responses)):
            bad("ranking", reason)
    prefix = row["ranked_prefix"]
    if prefix is None and ranking is not None:  # without a ranking, its prefix is that error's, not one more
        bad("ranked_prefix", "is missing")
    elif ranking and not 1 <= prefix <= len(ranking):
        bad("ranked_prefix", f"is {prefix}; it counts observed tiers, so 1..{len(ranking)} for this ranking")
    cluster = row["cluster"]
    if cluster is not None and not cluster.strip():
        bad("cluster", f"is {cluster!r}; leave it out (null) for a ranking without a label")
    elif cluster is not None and (cluster == "all" or _ADAPTER_NAME.fullmatch(cluster)):
        bad("cluster", f"{cluster!r} is reserved: the evaluation's rows name the average over a split's rankings "
                       "'all' and EM's clusters 'adapter cN'; rename this label")
    elif cluster is not None and label_set is not None and cluster not in label_set:
        bad("cluster", f"{cluster!r} is not in the declared label set {sorted(label_set)}")
    split = row["split"]
    if split is None:
        if require_split:
            bad("split", "is missing")
    elif split not in SPLITS:
        bad("split", f"is {split!r}; expected one of {', '.join(SPLITS)}")
    return found


def _ranking_issues(ranking: list[list[int] | None], m: int) -> list[str]:
    if not ranking:
        return ["has no tiers"]
    reasons = []
    tier_of: dict[int, int] = {}
    for t, tier in enumerate(ranking):
        if not tier:
            reasons.append(f"tier {t} is empty")
            continue
        for j in tier:
            if j is None or not 0 <= j < m:
                reasons.append(f"index {j} in tier {t} is outside 0..{m - 1} (the row has {m} responses)")
            elif j in tier_of:
                reasons.append(f"index {j} appears twice (tiers {tier_of[j]} and {t})")
            else:
                tier_of[j] = t
    if reasons:
        return reasons
    unplaced = [j for j, code in enumerate(encode_tiers(ranking, m)) if code == UNRANKED]
    if unplaced:
        reasons.append(
            f"responses {unplaced} are in no tier; a ranking must place all {m} responses "
            "(express partial observation with ranked_prefix)"
        )
    return reasons


def _messages_issue(text: str) -> str | None:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as err:
        return f"is not valid JSON ({err})"
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        return 'must be a JSON list of {"role": str, "content": str} messages'
    if not messages or messages[-1]["role"] == "assistant":
        return ("must end before the answers: a non-empty conversation whose last message is not the assistant's "
                "(the responses are the assistant's next turn)")
    return None


def _records_as_json(data: pa.Table | pd.DataFrame | Sequence[dict[str, Any]], rows: list[int]) -> dict[int, str]:
    if isinstance(data, pa.Table):
        picked = data.take(pa.array(rows, pa.int64())).to_pylist() if rows else []
    elif isinstance(data, pd.DataFrame):
        picked = [{k: _plain(v) for k, v in data.iloc[r].items()} for r in rows]
    else:
        picked = [{k: _plain(v) for k, v in data[r].items()} for r in rows]
    return {r: json_text(rec) for r, rec in zip(rows, picked, strict=True)}


def json_text(record: dict[str, Any]) -> str:
    """A record as JSON text for rejected.parquet's ``record`` column: readable (no escapes for
    non-ASCII text), and whatever is not JSON as its str()."""
    return json.dumps(record, default=str, ensure_ascii=False)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
