"""PERSONA (SynthLabsAI/PERSONA) as rankings: m = 2, cluster = demographic profile (DESIGN.md 6).

Raw record: ``persona`` (newline-separated ``key: value`` text; keys vary between personas and a
value may itself contain ": "), ``instruction``, ``original`` (the model's answer), ``critique``,
``data`` (the answer revised for the persona) and ``question type`` (with a space; it holds the
dataset's own "train" / "test" split of its questions, as public loaders of the release read it: not
used, ingest splits every dataset by prompt). Each record is
one ranking [data] > [original]; the two responses are placed in a seeded, per-row order so the
position of the preferred response carries no signal. Records with an empty or unchanged revision
are skipped (there is nothing to prefer). The profile rules are `moplex_core.config.PersonaOptions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from moplex_core.config import PersonaOptions
from moplex_core.data.sources import STRICT, AdapterOutput, RawRejects, Record, most_frequent_profiles
from moplex_core.hashing import short_hash
from moplex_core.schema import prompt_id, ranking_row

NAME = "PERSONA"


def parse_persona(text: str) -> dict[str, str]:
    """``key: value`` lines as a dict with lower-cased keys, split on the first ": " of each line.

    A line without ": " continues the previous value (multi-line values), unless it ends in ":" and
    the next line is a field or the end: then it is a field with an empty value ("household
    language:" between two fields). Blank lines are skipped.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    fields: dict[str, str] = {}
    key = None
    for i, line in enumerate(lines):
        name, sep, value = line.partition(": ")
        if not sep and line.endswith(":") and (i + 1 == len(lines) or ": " in lines[i + 1]):
            name, sep, value = line[:-1], ":", ""
        if sep and name.strip():
            key = name.strip().lower()
            fields[key] = value.strip()
        elif key is not None:
            fields[key] = f"{fields[key]}\n{line}" if fields[key] else line
    return fields


def profile_label(persona: dict[str, str], options: PersonaOptions) -> str | None:
    """e.g. ``age=18-44|sex=Female|race=White``; None when a field is absent or has no bucket."""
    parts = []
    for name in options.fields:
        value = persona.get(name.lower(), "").strip()
        if not value:
            return None
        if name.lower() == "age":
            value = _age_band(value, options.age_bands)
            if value is None:
                return None
        elif name.lower() == "race":
            value = next((g for g in options.race_groups if value.lower().startswith(g.lower())), "Other")
        parts.append(f"{name}={value}")
    return "|".join(parts)


def to_rankings(records: Iterable[Record], options: PersonaOptions, *, source: str, seed: int,
                rejects: RawRejects = STRICT) -> AdapterOutput:
    rows = []
    stats: Counter[str] = Counter()
    seen: set[str] = set()
    for record in records:
        with rejects.reading(record):
            record.require(("persona", "instruction", "original", "data"), NAME)
            stats["records"] += 1
            persona_text, prompt = record.data["persona"], record.data["instruction"]
            revised, original = record.data["data"], record.data["original"]
            if not all(isinstance(v, str) for v in (persona_text, prompt, revised, original)) or not prompt.strip():
                stats["skipped_missing_text"] += 1
                continue
            if not revised.strip() or not original.strip() or revised.strip() == original.strip():
                stats["skipped_empty_or_unrevised"] += 1
                continue
            label = profile_label(parse_persona(persona_text), options)
            if label is None:
                stats["skipped_no_profile"] += 1
                continue
            example_id = short_hash("persona", short_hash(persona_text), prompt_id(prompt), label)
            if example_id in seen:
                stats["skipped_duplicate_record"] += 1
                continue
            seen.add(example_id)
            revised_first = int(short_hash(str(seed), example_id)[-1], 16) % 2 == 0
            responses = [revised, original] if revised_first else [original, revised]
            ranking = [[0], [1]] if revised_first else [[1], [0]]
            rows.append(ranking_row(example_id, prompt, responses, ranking, label, source))

    if options.top_profiles is not None:
        rows = most_frequent_profiles(rows, options.top_profiles, stats)
    stats["profiles"] = len({row["cluster"] for row in rows})
    stats["rankings"] = len(rows)
    return AdapterOutput(rows, dict(stats))


def _age_band(value: str, starts: tuple[int, ...]) -> str | None:
    try:
        age = int(float(value))
    except (ValueError, OverflowError):
        return None
    if age < starts[0]:
        return None
    k = max(i for i, start in enumerate(starts) if age >= start)
    return f"{starts[k]}+" if k == len(starts) - 1 else f"{starts[k]}-{starts[k + 1] - 1}"
