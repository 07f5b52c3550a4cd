"""Synthetic rankings for the EM engine's tests (test_em, test_em_inputs)."""

import torch

from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.em import Rankings


def synthetic(k=3, m=8, n=900, seed=0, **kw):
    data = generate_synthetic(SyntheticConfig(n=n, k=k, m=m, seed=seed, **kw))
    return data, Rankings(torch.as_tensor(data.tiers), example_ids=tuple(f"ex{i}" for i in range(n))), data.features()
