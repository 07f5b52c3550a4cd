"""Any Parquet/JSONL already in the canonical `rankings` schema (DESIGN.md 3).

Convenience defaults for columns a hand-made file may leave out: ``prompt_id`` = hash of the prompt,
``example_id`` = hash of (prompt_id, responses, ranking, cluster), with the first free ``-2``,
``-3``, ... where an earlier row or a given example_id holds the hash (a row that repeats another is
a ranking of its own, as two raters who agree are; the stats count them as ``repeated_rankings``),
``ranked_prefix`` = all tiers,
``cluster`` = null, ``source`` = the source label given by the caller. ``split`` is set to null (the
ingest assigns one) unless ``keep_split`` (``split.from_source``): a split column that is not kept is
not checked either. Other columns are dropped and counted. Values are not checked here;
`moplex_core.schema` does that with row numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from moplex_core.data.sources import AdapterOutput, Record
from moplex_core.hashing import canonical_json, short_hash
from moplex_core.schema import RANKINGS_SCHEMA, prompt_id

COLUMNS = tuple(RANKINGS_SCHEMA.names)


def to_rankings(records: Iterable[Record], *, source: str, keep_split: bool = False) -> AdapterOutput:
    rows, where, originals = [], [], []
    stats: Counter[str] = Counter()
    made: list[tuple[int, str]] = []  # (row, content hash) of each row whose example_id is made
    for record in records:
        stats["records"] += 1
        data = record.data
        for name in data:
            if name not in COLUMNS:
                stats[f"dropped_column:{name}"] += 1
        row = {name: data.get(name) for name in COLUMNS}
        if isinstance(row["prompt"], bytes):  # a Parquet binary column: text where UTF-8, as the validator reads it
            try:
                row["prompt"] = row["prompt"].decode()
            except UnicodeDecodeError:
                pass  # left for the validator to name
        if row["prompt_id"] is None and isinstance(row["prompt"], str):
            row["prompt_id"] = prompt_id(row["prompt"])
        prefix = row["ranked_prefix"]
        if (prefix is None or prefix != prefix) and isinstance(row["ranking"], list):  # null or NaN: every tier
            row["ranked_prefix"] = len(row["ranking"])
        if row["example_id"] is None and row["prompt_id"] is not None:
            try:
                content = canonical_json([row["responses"], row["ranking"], row["cluster"]])
            except (TypeError, ValueError):  # not JSON values: left for the validator to name
                content = None
            if content is not None:
                made.append((len(rows), short_hash("generic", str(row["prompt_id"]), content)))
        if row["source"] is None:
            row["source"] = source
        if not keep_split and row["split"] is not None:
            row["split"] = None
            stats["ignored_column:split"] += 1
        rows.append(row)
        where.append(record.where)
        originals.append(data)
    # A made id is the content hash, or, where a row before it or a given id holds that, the hash with
    # the first free -2, -3, ...: a repeat is a ranking of its own, and never takes a given id.
    taken = {row["example_id"] for row in rows if isinstance(row["example_id"], str)}
    tried: dict[str, int] = {}  # per hash, the suffix its last repeat took: the next is free beyond it
    for r, content_hash in made:
        example_id, n = content_hash, tried.get(content_hash, 1)
        if n > 1:
            example_id = f"{content_hash}-{n}"
        while example_id in taken:
            n += 1
            example_id = f"{content_hash}-{n}"
        tried[content_hash] = n
        taken.add(example_id)
        rows[r]["example_id"] = example_id
        if n > 1:
            stats["repeated_rankings"] += 1
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats), where, originals)
