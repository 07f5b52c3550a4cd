"""UltraFeedback (openbmb/UltraFeedback, raw) as rankings: k = 4 criteria, m = 4 (DESIGN.md 6).

Raw record: ``instruction`` (the prompt) and ``completions``, a list of {``response``,
``annotations``, ...}; ``annotations[criterion]["Rating"]`` is a string "1".."5" or "N/A" for the
criteria helpfulness, honesty, instruction_following, truthfulness. ``overall_score`` is ignored
(known bug). Each prompt gives one ranking per criterion over one shared slate of m completions,
ranked by that criterion's rating with equal ratings as tied tiers; the rules for the slate, "N/A"
and short prompts are in `moplex_core.config.UltraFeedbackOptions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from moplex_core.config import UltraFeedbackOptions
from moplex_core.data.sources import STRICT, AdapterOutput, RawRejects, RawSchemaError, Record
from moplex_core.hashing import short_hash
from moplex_core.pl import encode_tiers
from moplex_core.schema import ranking_from_scores, ranking_row

NAME = "UltraFeedback"
NOT_RATED = "N/A"
RATINGS = (1, 5)  # the annotators' scale


@dataclass(frozen=True)
class Completion:
    response: str
    ratings: dict[str, float | None]  # criterion -> rating, None for "N/A" or absent


def to_rankings(
    records: Iterable[Record], options: UltraFeedbackOptions, *, source: str, seed: int,
    rejects: RawRejects = STRICT,
) -> AdapterOutput:
    rows = []
    stats: Counter[str] = Counter()
    seen: set[str] = set()
    for record in records:
        with rejects.reading(record):
            rows += _record_rows(record, options, source, seed, seen, stats)
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats))


def _record_rows(record: Record, options: UltraFeedbackOptions, source: str, seed: int, seen: set[str],
                 stats: Counter[str]) -> list[dict]:
    """The rankings of one record (one per rated criterion; none when the prompt is skipped)."""
    record.require(("instruction", "completions"), NAME)
    stats["records"] += 1
    prompt = record.data["instruction"]
    if not isinstance(prompt, str) or not prompt.strip():
        stats["skipped_empty_prompt"] += 1
        return []
    completions = _completions(record, options.criteria)
    record_id = short_hash(prompt, *(c.response for c in completions))
    if record_id in seen:
        stats["skipped_duplicate_record"] += 1
        return []
    seen.add(record_id)

    distinct = _distinct(completions)
    if repeated := sum(1 for c in completions if c.response.strip()) - len(distinct):
        stats["skipped_duplicate_response"] += repeated
    slate = _slate(distinct, options, np.random.default_rng([seed, int(record_id[:15], 16)]))
    if slate is None:
        stats["skipped_short_slate"] += 1
        return []
    rankings = {}
    for criterion in options.criteria:
        ratings = [c.ratings[criterion] for c in slate]
        if any(r is None for r in ratings):
            stats["criterion_not_rated"] += 1
            continue
        rankings[criterion] = ranking_from_scores(ratings)
    distinct = {tuple(encode_tiers(r, len(slate))) for r in rankings.values()}
    if len(distinct) < options.min_distinct_rankings:
        stats["skipped_too_few_distinct_rankings"] += 1
        return []
    stats["prompts"] += 1
    responses = [c.response for c in slate]
    return [ranking_row(short_hash("ultrafeedback", record_id, criterion), prompt, responses, ranking, criterion, source)
            for criterion, ranking in rankings.items()]


def _completions(record: Record, criteria: tuple[str, ...]) -> list[Completion]:
    completions = record.data["completions"]
    if not isinstance(completions, list):
        raise RawSchemaError(f"{record.where}: 'completions' must be a list, got {type(completions).__name__}",
                             field="completions")
    parsed = []
    for j, completion in enumerate(completions):
        if not isinstance(completion, dict) or "response" not in completion:
            raise RawSchemaError(f"{record.where}: completion {j} has no 'response'",
                                 field=f"completions[{j}]" + (".response" if isinstance(completion, dict) else ""))
        response = "" if completion["response"] is None else completion["response"]
        if not isinstance(response, str):
            raise RawSchemaError(f"{record.where}: completion {j}'s 'response' must be text, got "
                                 f"{type(response).__name__}", field=f"completions[{j}].response")
        annotations = completion.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise RawSchemaError(f"{record.where}: completion {j}'s 'annotations' must be an object (criterion -> "
                                 f"{{'Rating': ...}}), got {type(annotations).__name__} {str(annotations)[:60]!r}",
                                 field=f"completions[{j}].annotations")
        ratings = {c: _rating(annotations.get(c), f"{record.where}, completion {j}, {c}",
                              f"completions[{j}].annotations.{c}") for c in criteria}
        parsed.append(Completion(response, ratings))
    return parsed


def _rating(annotation: object, where: str, field: str) -> float | None:
    """The numeric rating (1..5), or None when absent or "N/A". ``field``: the annotation's path in the record."""
    if annotation is None:
        return None
    if not isinstance(annotation, dict):
        raise RawSchemaError(f"{where}: the annotation must be an object with a 'Rating', got "
                             f"{type(annotation).__name__} {str(annotation)[:60]!r}", field=field)
    value = annotation.get("Rating")
    if value is None or (isinstance(value, str) and value.strip() == NOT_RATED):
        return None
    rating = None
    if isinstance(value, str):
        try:
            rating = float(value)
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        rating = float(value)
    if rating is None or not RATINGS[0] <= rating <= RATINGS[1]:  # NaN and infinity fail too
        raise RawSchemaError(f"{where}: Rating {value!r} is neither a rating in {RATINGS[0]}..{RATINGS[1]} "
                             f"nor {NOT_RATED!r}", field=f"{field}.Rating")
    return rating


def _distinct(completions: list[Completion]) -> list[Completion]:
    """The completions with a non-empty response, a repeated one (the same text but for surrounding
    white space) read once, at its first: equal texts get equal scores, so no model could rank two
    copies apart as their ratings may."""
    seen: set[str] = set()
    distinct = []
    for completion in completions:
        text = completion.response.strip()
        if text and text not in seen:
            seen.add(text)
            distinct.append(completion)
    return distinct


def _slate(
    usable: list[Completion], options: UltraFeedbackOptions, rng: np.random.Generator
) -> list[Completion] | None:
    """m of the ``usable`` completions in dataset order, or None when the prompt is skipped (see
    UltraFeedbackOptions)."""
    fully_rated = [c for c in usable if all(r is not None for r in c.ratings.values())]
    pool = fully_rated if len(fully_rated) >= options.m else usable
    if len(pool) < options.m:
        return pool if options.short_slates == "keep" and len(pool) >= 2 else None
    picked = np.sort(rng.choice(len(pool), size=options.m, replace=False))
    return [pool[i] for i in picked]
