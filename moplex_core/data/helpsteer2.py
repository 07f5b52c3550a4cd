"""HelpSteer2 (nvidia/HelpSteer2) as rankings: m = 2, from its ratings or its preference annotations.

The release holds three kinds of record, told apart by their fields, so that a folder with all of it
(`hf download` brings ``train.jsonl.gz``, ``validation.jsonl.gz``, ``preference/`` and
``disagreements/``) reads as it is; records of the kinds not asked for are counted and skipped.

- ratings (the default config; ``data="ratings"``, cluster = attribute, k = 5): ``prompt``,
  ``response`` and integer ratings 0-4 for ``helpfulness``, ``correctness``, ``coherence``,
  ``complexity``, ``verbosity``; rows with the same prompt (consecutive in the release) are
  responses to one prompt. Every pair of distinct responses to a prompt (a repeated response is
  read once) gives one ranking per attribute whose ratings differ by at least ``min_gap``, the
  higher-rated response first. A pair keeps dataset order.
- preference (the ``preference`` data_dir; ``data="preference"``, no cluster label): ``prompt``,
  ``response_1``, ``response_2`` and ``preference_strength`` -3..3 (negative: response_1 is
  better), with ``split`` and the annotators' statements, which are not read. One ranking per pair
  with a strength of at least ``min_strength`` either way, in the record's response order.
- disagreements (the ``disagreements`` data_dir): the ratings' schema with each attribute a list of
  the individual annotators' ratings; never read.

About 29% of the prompts are multi-turn: the earlier turns in one text, each turn after the first
opened by a marker line, ``<extra_id_1>Assistant`` or ``<extra_id_1>User`` (the release's README;
the response is the last assistant turn). Such a prompt also becomes ``prompt_messages``, its turns
as chat messages, so that the model's chat template renders them as the conversation they are
(`prompt_messages_of`); ``prompt`` keeps the release's text, so example ids and splits do not move.
With ``split_turns = false`` (a model without a chat template) the markers stay in the one text.

The rules are `moplex_core.config.HelpSteer2Options`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import combinations

from moplex_core.config import HelpSteer2Options
from moplex_core.data.sources import STRICT, AdapterOutput, RawRejects, RawSchemaError, Record
from moplex_core.hashing import short_hash
from moplex_core.schema import prompt_id, ranking_row

NAME = "HelpSteer2"
MAX_RATING = 4
PREFERENCE_FIELDS = ("prompt", "response_1", "response_2", "preference_strength")
MAX_STRENGTH = 3
# The line that opens each turn after the first, with the line breaks around it (CRLF too)
TURN_MARKER = re.compile(r"(?:\r?\n)*<extra_id_1>(User|Assistant)[ \t]*(?:\r?\n)+")


def to_rankings(records: Iterable[Record], options: HelpSteer2Options, *, source: str,
                rejects: RawRejects = STRICT) -> AdapterOutput:
    stats: Counter[str] = Counter()
    rows = _preference_rankings(records, options, source, stats, rejects) if options.data == "preference" else \
        _ratings_rankings(records, options, source, stats, rejects)
    other = "ratings" if options.data == "preference" else "preference"
    skipped = sum(n for key, n in stats.items() if key.startswith("skipped_") and key.endswith("_records"))
    found = stats[f"skipped_{other}_records"]
    if stats["records"] == skipped and found:  # none of the kind asked for
        raise RawSchemaError(f"the source holds no HelpSteer2 {options.data} records but {found} {other} records "
                             f"(helpsteer2.data = {options.data!r}): set helpsteer2.data={other}")
    if options.split_turns:
        turns: dict[str, str | None] = {}  # per distinct prompt
        for row in rows:
            if row["prompt"] not in turns:
                turns[row["prompt"]] = prompt_messages_of(row["prompt"])
                if turns[row["prompt"]] is not None:
                    stats["multi_turn_prompts"] += 1
                elif "<extra_id_1>" in row["prompt"]:
                    stats["multi_turn_prompts_kept_as_text"] += 1
            row["prompt_messages"] = turns[row["prompt"]]
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats))


def prompt_messages_of(prompt: str) -> str | None:
    """A multi-turn prompt's turns as `prompt_messages` (a JSON list of ``{"role", "content"}``):
    user, assistant, user, ..., user, each turn's text as the release has it between the marker lines.
    None for a single-turn prompt, and for one whose markers do not alternate from a user turn to a
    last user turn around non-empty texts (read as one text, as before; counted in the stats)."""
    parts = TURN_MARKER.split(prompt)  # [text, role, text, role, text, ...]
    if len(parts) == 1:
        return None
    roles = ["user", *(role.lower() for role in parts[1::2])]
    texts = parts[0::2]
    alternating = all(role == ("user", "assistant")[i % 2] for i, role in enumerate(roles))
    if not alternating or roles[-1] != "user" or not all(text.strip() for text in texts):
        return None
    return json.dumps([{"role": role, "content": text} for role, text in zip(roles, texts, strict=True)])


def _of_kind(kind: str, records: Iterable[Record], options: HelpSteer2Options, stats: Counter[str]) -> Iterator[Record]:
    """The records of one kind (ratings, preference), counting every record and skipping the others."""
    for record in records:
        stats["records"] += 1
        if "response_1" in record.data:
            found = "preference"
        elif all(isinstance(record.data.get(a), list) for a in options.attributes):
            found = "disagreements"
        else:
            found = "ratings"
        if found == kind:
            yield record
        else:
            stats[f"skipped_{found}_records"] += 1


def _ratings_rankings(records: Iterable[Record], options: HelpSteer2Options, source: str,
                      stats: Counter[str], rejects: RawRejects) -> list[dict]:
    by_prompt: dict[str, list[tuple[str, dict[str, int | None]]]] = {}
    for record in _of_kind("ratings", records, options, stats):
        with rejects.reading(record):
            record.require(("prompt", "response", *options.attributes), NAME)
            prompt, response = record.data["prompt"], record.data["response"]
            if not isinstance(prompt, str) or not prompt.strip():
                stats["skipped_empty_prompt"] += 1
                continue
            if not isinstance(response, str) or not response.strip():
                stats["skipped_empty_response"] += 1
                continue
            ratings = {a: _rating(record.data[a], record.where, a) for a in options.attributes}
            answers = by_prompt.setdefault(prompt, [])
            if any(response.strip() == text.strip() for text, _ in answers):
                stats["skipped_duplicate_response"] += 1
                continue
            answers.append((response, ratings))

    rows = []
    for prompt, answers in by_prompt.items():
        for (text_a, ratings_a), (text_b, ratings_b) in combinations(answers, 2):
            pair_id = short_hash("helpsteer2", prompt_id(prompt), short_hash(text_a), short_hash(text_b))
            for attribute in options.attributes:
                a, b = ratings_a[attribute], ratings_b[attribute]
                if a is None or b is None or abs(a - b) < options.min_gap:
                    continue
                ranking = [[0], [1]] if a > b else [[1], [0]]
                example_id = short_hash(pair_id, attribute)
                rows.append(ranking_row(example_id, prompt, [text_a, text_b], ranking, attribute, source))
    stats["prompts"] = len(by_prompt)
    return rows


def _preference_rankings(records: Iterable[Record], options: HelpSteer2Options, source: str,
                         stats: Counter[str], rejects: RawRejects) -> list[dict]:
    rows, seen = [], set()
    for record in _of_kind("preference", records, options, stats):
        with rejects.reading(record):
            record.require(PREFERENCE_FIELDS, NAME)
            prompt, first, second = (record.data[f] for f in ("prompt", "response_1", "response_2"))
            if not all(isinstance(text, str) and text.strip() for text in (prompt, first, second)):
                stats["skipped_missing_text"] += 1
                continue
            strength = _rating(record.data["preference_strength"], record.where, "preference_strength",
                               low=-MAX_STRENGTH, high=MAX_STRENGTH, what="strength")
            if first.strip() == second.strip():
                stats["skipped_identical_responses"] += 1
                continue
            if strength is None or abs(strength) < options.min_strength:
                stats["skipped_weak_or_no_preference"] += 1
                continue
            example_id = short_hash("helpsteer2-preference", prompt_id(prompt), short_hash(first), short_hash(second))
            if example_id in seen:
                stats["skipped_duplicate_record"] += 1
                continue
            seen.add(example_id)
            ranking = [[0], [1]] if strength < 0 else [[1], [0]]
            rows.append(ranking_row(example_id, prompt, [first, second], ranking, None, source))
    return rows


def _rating(value: object, where: str, field: str, *, low: int = 0, high: int = MAX_RATING,
            what: str = "rating") -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RawSchemaError(f"{where}, field {field!r}: {what} {value!r} is not an integer in {low}..{high}",
                             field=field)
    return value
