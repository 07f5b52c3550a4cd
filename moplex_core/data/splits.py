"""Train / validation / test by prompt: every ranking of a prompt lands in the same split."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from moplex_core.config import SplitConfig
from moplex_core.schema import SPLITS

_SPLIT_STREAM = 0x5B1  # keeps the split's random stream apart from the adapters' (same seed)


def assign_splits(prompt_ids: Sequence[str], config: SplitConfig, seed: int) -> list[str | None]:
    """The split of each row; None for rows left out when ``config.sizes`` asks for fewer rows.

    Prompts are shuffled in an order that depends only on the seed and the set of prompt ids (not
    on row order). With fractions, the first round(f * n_prompts) prompts (largest remainders) go
    to train, the next to validation, the rest to test. With sizes, each prompt goes to the first
    split that still has room for all its rankings.
    """
    unique = sorted(set(prompt_ids))
    order = [unique[i] for i in np.random.default_rng([seed, _SPLIT_STREAM]).permutation(len(unique))]
    assignment: dict[str, str] = {}
    if config.sizes is None:
        start = 0
        for name, count in zip(SPLITS, _largest_remainder(len(unique), config.fractions), strict=True):
            assignment.update(dict.fromkeys(order[start : start + count], name))
            start += count
    else:
        rows_of = Counter(prompt_ids)
        if len(prompt_ids) < sum(config.sizes):
            raise ValueError(
                f"split sizes {config.sizes} ask for {sum(config.sizes)} rankings but the source gives "
                f"{len(prompt_ids)}; lower the sizes or split by fractions (split.sizes=null)"
            )
        room = list(config.sizes)
        for pid in order:
            for s, name in enumerate(SPLITS):
                if rows_of[pid] <= room[s]:
                    assignment[pid] = name
                    room[s] -= rows_of[pid]
                    break
            if not any(room):
                break
    return [assignment.get(pid) for pid in prompt_ids]


def split_groups(prompt_ids: Sequence[str], prompts: Sequence[str]) -> list[str]:
    """Per row, the prompt_id its split goes by: the smallest of the ids joined by a shared prompt
    text. A prompt_id is the hash of its prompt text unless a generic source brings its own ids; one
    prompt text under two ids would otherwise be split twice and could be trained and tested on.
    Where every id is its text's hash, each row keeps its own prompt_id."""
    parent = {pid: pid for pid in prompt_ids}

    def root(pid: str) -> str:
        while parent[pid] != pid:
            parent[pid] = parent[parent[pid]]
            pid = parent[pid]
        return pid

    id_of_text: dict[str, str] = {}
    for pid, text in zip(prompt_ids, prompts, strict=True):
        a, b = root(pid), root(id_of_text.setdefault(text, pid))
        if a != b:
            parent[max(a, b)] = min(a, b)
    return [root(pid) for pid in prompt_ids]


def _largest_remainder(n: int, fractions: Sequence[float]) -> list[int]:
    exact = [f * n for f in fractions]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts)]:
        counts[k] += 1
    return counts
