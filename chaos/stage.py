"""One pipeline stage, described by a `StageJob`, run in this process without Prefect.

The kill schedule (chaos.kills) runs its uninterrupted reference runs through `run_stage` in its own
process, and the runs it kills, and their reruns, as children::

    python -m chaos.stage ROOT JOB_JSON

Both call the same moplex_core ``run_*`` functions the Prefect flows call. A child uses one torch
thread and shows its progress bars on stderr (the train stage's "M-step t" / "E-step t" bars are
how the schedule sees where EM is).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from moplex_core.artifacts import ArtifactStore

StageName = Literal["ingest", "augment", "cache", "train"]


@dataclass(frozen=True)
class StageJob:
    """A stage, its config (as JSON-able data) and its input artifact folder (None for ingest)."""

    stage: StageName
    config: dict[str, Any]
    input_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StageJob:
        return cls(**json.loads(text))


def run_stage(job: StageJob, root: str | Path, *, progress: bool) -> Path:
    """Write (or resume, or skip) the job's artifact under ``root``; returns its version folder."""
    store = ArtifactStore(root)
    # Each stage's module is imported only when it runs: ingest needs no torch (3 s less per child).
    if job.stage == "ingest":
        from moplex_core.config import IngestConfig
        from moplex_core.ingest import run_ingest

        return run_ingest(IngestConfig.model_validate(job.config), store).path
    if job.stage == "augment":
        from moplex_core.augment import run_augment
        from moplex_core.config import AugmentConfig

        return run_augment(AugmentConfig.model_validate(job.config), job.input_dir, store, progress=progress).path
    if job.stage == "cache":
        from moplex_core.cache import run_cache
        from moplex_core.config import CacheConfig

        return run_cache(CacheConfig.model_validate(job.config), job.input_dir, store, progress=progress).path
    if job.stage == "train":
        from moplex_core.config import TrainConfig
        from moplex_core.train import run_train

        return run_train(TrainConfig.model_validate(job.config), job.input_dir, store, progress=progress).path
    raise ValueError(f"unknown stage {job.stage!r}; the kill schedule runs ingest, augment, cache and train")


def main(argv: list[str]) -> int:
    root, text = argv
    job = StageJob.from_json(text)
    if job.stage != "ingest":
        import torch

        torch.set_num_threads(1)
    run_stage(job, root, progress=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
