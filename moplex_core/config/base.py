"""What every config is made of: frozen blocks of settings that refuse unknown keys, a stage config's
identity (what its artifact version hashes), devices, and local paths made absolute."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

TINY_MODEL = "tiny"
"""The special model value: the pipeline builds a tiny offline Qwen3 model (moplex_core.lm.tiny) from
the ingested texts into the artifact root, versioned like any stage output, and uses it."""


def absolute_path(path: str) -> str:
    """``path`` made absolute against the working directory it is read in (``~`` expanded): the
    manifests record it and later stages, CLI commands and retried flow runs read it from anywhere.
    Refuses an empty or blank path, which the OS would read as the working directory itself."""
    if not path.strip():
        raise ValueError("is empty: give a file or folder (an empty path would be the working directory)")
    return os.path.abspath(os.path.expanduser(path))


def refuse_the_pipelines_model(model: str | None) -> None:
    """Raise ValueError for the model value `tiny` in a stage run alone (`moplex cache`, a stage
    deployment): it names the model the pipeline builds into its artifact root and puts in its place,
    which a stage given it here would look for on the hub."""
    if model == TINY_MODEL:
        raise ValueError(f"model {TINY_MODEL!r} is the pipeline's own model, which `moplex run` builds; give its "
                         "folder, ROOT/model/VERSION/model")


def local_model_absolute(model: str | None) -> str | None:
    """A model naming an existing local directory, made absolute; a hub name or "tiny" as given; an
    empty or blank one refused."""
    if model is not None and not model.strip():
        raise ValueError("is empty: give a local model folder or a hub name (an empty path would be the working "
                         "directory)")
    if model is None or model == TINY_MODEL or not Path(model).expanduser().is_dir():
        return model
    return absolute_path(model)


class Options(BaseModel):
    """A frozen block of settings; unknown keys are errors, and so are NaN and infinity (JSON and
    Python read them; they would pass the bounds and fail a stage later)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _torch_device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|(mps|cuda)(:\d+)?", value):
        raise ValueError(f"{value!r} is not a device: give auto, cpu, cuda, cuda:N, mps or mps:N")
    return value


Device = Annotated[str, AfterValidator(_torch_device)]
"""Where a stage runs: refused up front when torch could not parse it (not after the stages before)."""

SharePrompts = bool | Literal["auto"]
"""Whether the rows of a pass that share a prompt run it once (moplex_core.lm.logprobs.prompt_prefix):
``auto`` means on the CPU, and on a GPU in the cache's passes with contractions only (`prompts_shared`;
why: `TrainConfig`'s and `CacheConfig`'s docstrings)."""


def prompts_shared(setting: SharePrompts, device: str, elsewhere: bool = False) -> bool:
    """Whether passes on ``device`` (a resolved torch device: cpu, cuda:0, ...) share prompts under
    ``setting``: the setting itself, or for ``auto`` True on the CPU and ``elsewhere`` on any other
    device (the cache's passes with contractions, which a shared prompt made faster on the H200)."""
    if isinstance(setting, bool):
        return setting
    return device.split(":")[0] == "cpu" or elsewhere


SplitName = Literal["train", "validation", "test"]
"""The splits ingest writes (`moplex_core.schema.SPLITS`, in this order)."""


class StageConfig(Options):
    """A stage's settings. Its `identity` is hashed into the stage's version (`ArtifactStore.version`).

    A new setting: give it a default that does what the stage did before, and leave it out of
    `identity` while it holds that default (as `CacheConfig.contractions` does), so that every
    existing version keeps its hash; a setting that only says how (a batch size, a device) stays
    out always. Then give it another value in tests/test_config.py's VERSIONED table, which fails
    naming any setting no version check varies.
    """

    def identity(self) -> dict[str, Any]:
        """The settings that change the stage's output (all of them unless a stage says otherwise)."""
        return self.model_dump(mode="json")
