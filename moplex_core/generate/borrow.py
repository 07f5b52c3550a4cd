"""The ``borrow`` backend: other rankings' responses to the same prompt stand in for generated ones.

PERSONA's setting (DESIGN.md 6): every profile's ranking of an instruction has its own revision, so
the other profiles' revisions of the same instruction are natural extra responses, and unlike
generated text they carry cluster information (DESIGN.md 5.4b). Requests are keyed by example_id;
the pool of a ranking is every response of the other rankings of its prompt.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from moplex_core.generate.base import Sample, SampleRequest, normalise


def borrow_pools(example_ids: Sequence[str], prompt_ids: Sequence[str],
                 responses: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """example_id -> the responses of the other rankings with its prompt_id, in row order."""
    rows_of_prompt: dict[str, list[int]] = defaultdict(list)
    for row, pid in enumerate(prompt_ids):
        rows_of_prompt[pid].append(row)
    return {
        eid: [text for other in rows_of_prompt[pid] if other != row for text in responses[other]]
        for row, (eid, pid) in enumerate(zip(example_ids, prompt_ids, strict=True))
    }


class BorrowGenerator:
    """Draws, without replacement and seeded by the request, pool texts not in ``request.avoid``.

    Texts that normalise alike count once. Fewer than ``n`` samples means the pool is used up.
    """

    backend = "borrow"
    model = None

    def __init__(self, pools: Mapping[str, Sequence[str]]):
        self.pools = pools

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        out = []
        for request in requests:
            if request.key not in self.pools:
                raise KeyError(f"no borrow pool for {request.key!r}; pools are keyed by example_id")
            distinct: dict[str, str] = {}
            for text in self.pools[request.key]:
                key = normalise(text)
                if key and key not in request.avoid:
                    distinct.setdefault(key, text)
            candidates = list(distinct.values())
            order = np.random.default_rng(request.seed).permutation(len(candidates))[: request.n]
            out.append([Sample(candidates[i], 0) for i in order])
        return out

    def close(self, failed: bool = False) -> None:
        return None
