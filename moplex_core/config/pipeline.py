"""Every setting of one pipeline run, and the named presets in data/presets/."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from moplex_core.config.augment import AugmentConfig
from moplex_core.config.base import TINY_MODEL, Options, absolute_path
from moplex_core.config.cache import CacheConfig, no_contractions_message
from moplex_core.config.evaluate import EvaluateConfig
from moplex_core.config.ingest import IngestConfig
from moplex_core.config.tiny_model import TinyModelConfig
from moplex_core.config.train import TrainConfig

PipelineStage = Literal["ingest", "model", "augment", "cache", "train", "evaluate"]
PRESETS_DIR = Path(__file__).resolve().parents[2] / "data" / "presets"


class FaultConfig(Options):
    """A failure on purpose, to try retries: ``stage`` fails (just before it would run) on the first
    ``times`` runs of a pipeline flow run; a retry of that flow run (the UI's Retry, ``prefect
    flow-run retry``) counts as a further run and goes through, reusing every finished stage."""

    stage: PipelineStage | None = None
    times: int = Field(1, ge=1)


class PipelineConfig(Options):
    """Every setting of one pipeline run: ingest -> (tiny model) -> augment -> cache -> train -> evaluate.

    The stage blocks are the stages' own configs. ``cache.model`` is the base model (pi_ref) of the
    cache and train stages, ``augment.model`` the generator (usually the same): a local directory,
    a hub name, or ``"tiny"`` (TINY_MODEL), which builds a tiny offline model with ``tiny_model``
    from the ingested texts. ``augment: null`` skips augmentation (the cache is built on the
    rankings). ``stage_retries`` reruns a failed stage flow that many times after
    ``retry_delay_seconds`` (transient failures; a rerun resumes from the stage's finished shards);
    an error a rerun would repeat (bad input or settings, flows.pipeline.NOT_RETRIED) is not retried.
    """

    root: str = Field("data/artifacts", validate_default=True)
    """The artifact root, made absolute against the working directory the config is read in."""
    tiny_model: TinyModelConfig = TinyModelConfig()
    ingest: IngestConfig
    augment: AugmentConfig | None = None
    cache: CacheConfig
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    fault: FaultConfig = FaultConfig()
    stage_retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(5.0, ge=0.0)

    @field_validator("root")
    @classmethod
    def _absolute_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("root is empty; name the folder the artifacts go under (e.g. data/artifacts)")
        return absolute_path(v)

    def uses_tiny_model(self) -> bool:
        models = [self.cache.model] + ([self.augment.model] if self.augment is not None else [])
        return TINY_MODEL in models

    def responses_per_example(self) -> int | None:
        """m' (at most) where the config alone tells it: the dataset's m plus the generated ones; None
        for a generic source (the train stage checks against the data then)."""
        options = self.ingest.options()
        m = options.responses() if options else None
        if m is None:
            return None
        return m + (self.augment.n_generated if self.augment is not None else 0)

    @model_validator(mode="after")
    def _anchors_fit_the_slates(self) -> PipelineConfig:
        m_prime = self.responses_per_example()
        if m_prime is not None and self.train.anchors is not None and self.train.anchors > m_prime:
            generated = self.augment.n_generated if self.augment is not None else 0
            raise ValueError(
                f"train.anchors a = {self.train.anchors} > m' = {m_prime} responses per example "
                f"({m_prime - generated} from {self.ingest.dataset} + {generated} generated). Set "
                f"train.anchors to at most {m_prime}, or to null to compute every response exactly."
            )
        estimates = self.train.anchors is not None and (m_prime is None or self.train.anchors < m_prime)
        if not self.cache.contractions and estimates:
            raise ValueError(no_contractions_message(self.train.anchors, "the cache of this pipeline"))
        return self

    @model_validator(mode="after")
    def _fault_in_a_stage_that_runs(self) -> PipelineConfig:
        skipped = {"augment": self.augment is None, "model": not self.uses_tiny_model()}
        if skipped.get(self.fault.stage or ""):
            why = "augment is null" if self.fault.stage == "augment" else f"neither model is {TINY_MODEL!r}"
            raise ValueError(f"fault.stage = {self.fault.stage!r} names a stage this pipeline skips ({why}), so it "
                             "would never fail: choose a stage that runs, or set fault.stage to null")
        return self


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def pipeline_preset(name: str) -> PipelineConfig:
    """The pipeline preset ``data/presets/<name>.json`` ({"description": ..., "config": {...}})."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        named = Path(name).name.removesuffix(".json")  # a preset's file given for its name
        meant = [named] if named in preset_names() else difflib.get_close_matches(name, preset_names(), n=1)
        raise ValueError(f"unknown pipeline preset {name!r}: no {path}; "
                         + (f"did you mean {meant[0]}? " if meant else "") + f"choose one of {', '.join(preset_names())}")
    try:
        return PipelineConfig.model_validate(json.loads(path.read_text())["config"])
    except (json.JSONDecodeError, KeyError, ValidationError) as err:
        raise ValueError(f"{path} is not a valid pipeline preset ({{\"description\": ..., \"config\": "
                         f"PipelineConfig}}):\n{err}") from None


def preset_description(name: str) -> str:
    return json.loads((PRESETS_DIR / f"{name}.json").read_text()).get("description", "")
