"""PRISM (HannahRoseKirk/prism-alignment) as rankings: m = 4, cluster = the participant's profile.

Two of the release's files are read, in their raw schema (DESIGN.md 6):
- ``survey.jsonl``, one participant per record: ``user_id``, ``survey_only``, demographics (``age``,
  ``gender``, ``education``, ...) and nested ones (``location``, ``ethnicity``, ``religion``, each a
  dict such as ``{"special_region": "UK", ...}``);
- ``conversations.jsonl``, one conversation per record: ``conversation_id``, ``user_id``,
  ``opening_prompt`` and ``conversation_history``, a list of ``{"turn", "role", "content",
  "within_turn_id", "model_name", "score", "if_chosen", ...}`` (role "user" or "model"; turn 0 is
  the opening turn, where four models answered and the participant scored each 1-100). A text the
  release left empty reads "EMPTY STRING" (`EMPTY_TEXT`), and is no text here.

Records are told apart by their fields, so a folder holding the whole release (``hf download``
brings ``utterances.jsonl`` and ``metadata.jsonl`` too) or the hub's per-config Parquet reads as
it is; the other files' records are counted and skipped, and so are repeated records (a second copy
of a file). Each conversation gives one ranking of its opening turn's responses (in
``within_turn_id`` order) by score, equal scores tied; the rules for the profile are
`moplex_core.config.PrismOptions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from moplex_core.config import PRISM_OPENING_RESPONSES, PrismOptions
from moplex_core.data.sources import STRICT, AdapterOutput, RawRejects, RawSchemaError, Record, most_frequent_profiles
from moplex_core.hashing import short_hash
from moplex_core.schema import ranking_from_scores, ranking_row

NAME = "PRISM"
CONVERSATION_FIELDS = ("conversation_id", "user_id", "conversation_history")
SURVEY_MARK = "survey_only"  # a column only the survey has
SCORE_RANGE = (1, 100)
ROLES = ("user", "model")
EMPTY_TEXT = "EMPTY STRING"
"""What the release writes for a text that was empty, whitespace or "None" (``process_text`` in the
authors' HannahKirk/prism-alignment processing scripts; 147 model answers of utterances.jsonl are it):
read as no text, never as a prompt or a response."""


def to_rankings(records: Iterable[Record], options: PrismOptions, *, source: str,
                rejects: RawRejects = STRICT) -> AdapterOutput:
    stats: Counter[str] = Counter()
    profiles: dict[str, tuple[str | None, str]] = {}  # user_id -> (profile label or None: left out, where)
    conversations: list[Record] = []
    set_aside: dict[str, str] = {}  # user_id -> where a survey record of theirs was set aside (validation=drop)
    for record in records:
        with rejects.reading(record):
            stats["records"] += 1
            if "conversation_history" in record.data:
                record.require(CONVERSATION_FIELDS, NAME)
                conversations.append(record)
            elif SURVEY_MARK in record.data:
                try:
                    _survey(record, options, profiles, stats)
                except RawSchemaError:  # its participant's profile is unknown or in doubt
                    if record.data.get("user_id") is not None:
                        set_aside.setdefault(str(record.data["user_id"]), record.where)
                    raise
            else:
                stats["skipped_other_records"] += 1  # utterances, metadata
    if conversations and not profiles:
        raise RawSchemaError(
            f"{conversations[0].where}: PRISM conversations were found but no survey records (with "
            f"{SURVEY_MARK!r} and user_id), so no conversation has a cluster. Point the path at a folder that "
            "holds survey.jsonl beside conversations.jsonl (the release's layout)."
        )

    rows, seen = [], set()
    for record in conversations:
        with rejects.reading(record):
            stats["conversations"] += 1
            opening = _opening_turn(record)  # parsed first: a bad record fails whatever the profile options
            example_id = short_hash("prism", _id(record, "conversation_id"))
            if example_id in seen:
                stats["skipped_duplicate_record"] += 1
                continue
            seen.add(example_id)
            user = _id(record, "user_id")
            if user in set_aside and not rejects.drop:  # strict, reading on: the survey record's error says it
                continue
            if user in set_aside:  # its profile is unknown or in doubt: set aside with the survey record
                raise RawSchemaError(f"{record.where}: the survey record of user_id {user!r} ({set_aside[user]}) was "
                                     "set aside, so this conversation has no certain cluster", field="user_id")
            if user not in profiles:
                stats["skipped_user_not_in_survey"] += 1
                continue
            label = profiles[user][0]
            if label is None:
                stats["skipped_no_profile"] += 1
                continue
            if opening is None:
                stats["skipped_no_opening_prompt"] += 1
                continue
            prompt, responses, scores = opening
            if len(responses) < options.min_responses:
                stats["skipped_short_slate"] += 1
                continue
            if len(set(scores)) == 1:
                stats["skipped_all_tied"] += 1
                continue
            rows.append(ranking_row(example_id, prompt, responses, ranking_from_scores(scores), label, source))

    if options.top_profiles is not None:
        rows = most_frequent_profiles(rows, options.top_profiles, stats)
    stats["profiles"] = len({row["cluster"] for row in rows})
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats))


def _survey(record: Record, options: PrismOptions, profiles: dict[str, tuple[str | None, str]],
            stats: Counter[str]) -> None:
    """Enter a survey record's participant and profile label in ``profiles``."""
    record.require(("user_id",), NAME)
    user, label = _id(record, "user_id"), profile_label(record, options)
    if user in profiles and profiles[user][0] != label:
        raise RawSchemaError(f"{record.where}: user_id {user!r} is also the participant of {profiles[user][1]}, "
                             "with another profile; a participant has one survey record", field="user_id")
    stats["skipped_duplicate_record" if user in profiles else "participants"] += 1
    profiles[user] = (label, record.where)


def profile_label(record: Record, options: PrismOptions) -> str | None:
    """e.g. ``location.special_region=UK|gender=Female``; None when a field is absent, empty or excluded."""
    parts = []
    for path in options.fields:
        value: Any = record.data
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, str | int | float) or isinstance(value, bool) or not str(value).strip():
            return None
        value = str(value).strip()
        if value in options.exclude_values:
            return None
        parts.append(f"{path}={value}")
    return "|".join(parts)


def _id(record: Record, field: str) -> str:
    value = record.data[field]
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise RawSchemaError(f"{record.where}, field {field!r}: {value!r} is not an id (a non-empty string)",
                             field=field)
    return str(value)


def _opening_turn(record: Record) -> tuple[str, list[str], list[float]] | None:
    """(prompt, responses, scores) of turn 0: the participant's message and the models' distinct
    non-empty answers in ``within_turn_id`` order (a repeated answer is read once); None when turn 0
    has no user message. A message that is not as the release writes it raises `RawSchemaError`."""
    history = record.data["conversation_history"]
    if not isinstance(history, list):
        raise RawSchemaError(f"{record.where}, field 'conversation_history': expected a list of messages, "
                             f"got {type(history).__name__}", field="conversation_history")
    prompt, answers = None, []
    for i, message in enumerate(history):
        path = f"conversation_history[{i}]"
        where = f"{record.where}, field {path!r}"
        if not isinstance(message, dict) or not {"turn", "role", "content"} <= message.keys():
            raise RawSchemaError(f"{where}: a message needs 'turn', 'role' and 'content'; got {message!r:.200}",
                                 field=path)
        turn, role, content = message["turn"], message["role"], message["content"]
        if isinstance(turn, bool) or not isinstance(turn, int):
            raise RawSchemaError(f"{where}, key 'turn': {turn!r} is not an integer (0 is the opening turn)",
                                 field=f"{path}.turn")
        if role not in ROLES:
            raise RawSchemaError(f"{where}, key 'role': {role!r} is not one of {ROLES}", field=f"{path}.role")
        if not isinstance(content, str):
            raise RawSchemaError(f"{where}, key 'content': expected text, got {type(content).__name__}",
                                 field=f"{path}.content")
        if turn != 0:
            continue
        if role == "user":
            prompt = None if _empty(content) else content
        else:
            answers.append((message.get("within_turn_id"), content, _score(message.get("score"), where, path)))
    if len(answers) > PRISM_OPENING_RESPONSES:
        raise RawSchemaError(f"{record.where}, field 'conversation_history': {len(answers)} model answers at turn 0; "
                             f"PRISM's opening turn has at most {PRISM_OPENING_RESPONSES}", field="conversation_history")
    if prompt is None:
        return None
    if all(isinstance(w, int) and not isinstance(w, bool) for w, _, _ in answers):
        answers.sort(key=lambda answer: answer[0])  # stable: else the history's own order
    responses, scores = [], []
    for _, content, score in answers:
        if not _empty(content) and content.strip() not in {r.strip() for r in responses}:
            responses.append(content)
            scores.append(score)
    return prompt, responses, scores


def _empty(text: str) -> bool:
    return text.strip() in ("", EMPTY_TEXT)


def _score(value: object, where: str, message: str) -> float:
    """A model answer's score; ``message``: the answer's path in the record."""
    low, high = SCORE_RANGE
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RawSchemaError(f"{where}, key 'score': {value!r} is not a score in {low}..{high}", field=f"{message}.score")
    return float(value)
