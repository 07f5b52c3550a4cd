"""The evaluate stage's settings (DESIGN 7)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from moplex_core.config.base import Device, SplitName, StageConfig


class EvaluateConfig(StageConfig):
    """The evaluate stage: the trained mixture on held-out splits with exact scores (DESIGN 7).

    The Hungarian matching of EM's cluster ids to the true labels is fitted on ``fit_split`` and
    applied to every split. ``score_batch_size`` is the rows (one response under one adapter) per
    scoring pass. Left out of the version: ``device`` (but the dtype the trained adapters score in on
    it is in, `plan_evaluate`) and ``score_batch_size``.
    """

    splits: tuple[SplitName, ...] = ("validation", "test")
    fit_split: SplitName = "validation"
    method: str = "moplex"
    """The `method` column of metrics.parquet (a baseline preset names itself here)."""
    device: Device = "auto"
    score_batch_size: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _fit_split_is_evaluated(self) -> EvaluateConfig:
        if not self.splits or len(set(self.splits)) != len(self.splits):
            raise ValueError(f"splits must be distinct split names, got {self.splits}")
        if self.fit_split not in self.splits:
            raise ValueError(f"fit_split {self.fit_split!r} must be one of the evaluated splits {self.splits}")
        return self

    def identity(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"device", "score_batch_size"})
