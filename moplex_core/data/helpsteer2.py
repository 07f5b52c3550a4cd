"""HelpSteer2 (nvidia/HelpSteer2, default config) as rankings: m = 2, cluster = attribute (k = 5).

Raw record: ``prompt``, ``response`` and integer ratings 0-4 for ``helpfulness``, ``correctness``,
``coherence``, ``complexity``, ``verbosity``; rows with the same prompt (consecutive in the release)
are responses to one prompt. Every pair of distinct responses to a prompt (a repeated response is
read once) gives one ranking per attribute whose ratings differ by at least ``min_gap``, the
higher-rated response first (`moplex_core.config.HelpSteer2Options`). A pair keeps dataset order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from itertools import combinations

from moplex_core.config import HelpSteer2Options
from moplex_core.data.sources import AdapterOutput, RawSchemaError, Record
from moplex_core.hashing import short_hash
from moplex_core.schema import prompt_id, ranking_row

NAME = "HelpSteer2"
MAX_RATING = 4


def to_rankings(records: Iterable[Record], options: HelpSteer2Options, *, source: str) -> AdapterOutput:
    stats: Counter[str] = Counter()
    by_prompt: dict[str, list[tuple[str, dict[str, int | None]]]] = {}
    for record in records:
        record.require(("prompt", "response", *options.attributes), NAME)
        stats["records"] += 1
        prompt, response = record.data["prompt"], record.data["response"]
        if not isinstance(prompt, str) or not prompt.strip():
            stats["skipped_empty_prompt"] += 1
            continue
        if not isinstance(response, str) or not response.strip():
            stats["skipped_empty_response"] += 1
            continue
        ratings = {a: _rating(record.data[a], f"{record.where}, field {a!r}") for a in options.attributes}
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
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats))


def _rating(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_RATING:
        raise RawSchemaError(f"{where}: rating {value!r} is not an integer in 0..{MAX_RATING}")
    return value
