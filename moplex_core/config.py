"""Configs of every stage, validated at construction, printable, and hashable into artifact versions.

Every config is a frozen pydantic model that refuses unknown keys. `StageConfig.identity` is the part
of a config that determines the stage's output (what the artifact version hashes); `fingerprint` is
its short hash. Sections below are ordered as the pipeline: ingest, then later stages.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moplex_core.hashing import canonical_json, short_hash


def absolute_path(path: str) -> str:
    """``path`` made absolute against the working directory it is read in (``~`` expanded): the
    manifests record it and later stages, CLI commands and retried flow runs read it from anywhere."""
    return os.path.abspath(os.path.expanduser(path))


def local_model_absolute(model: str | None) -> str | None:
    """A model naming an existing local directory, made absolute; a hub name or "tiny" as given."""
    if model is None or model == TINY_MODEL or not Path(model).expanduser().is_dir():
        return model
    return absolute_path(model)

C = TypeVar("C", bound=BaseModel)


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


class StageConfig(Options):
    def identity(self) -> dict[str, Any]:
        """The settings that change the stage's output (all of them unless a stage says otherwise)."""
        return self.model_dump(mode="json")

    def canonical_json(self) -> str:
        return canonical_json(self.identity())

    def fingerprint(self) -> str:
        return short_hash(self.canonical_json())


def with_overrides(config: C, assignments: Sequence[str]) -> C:
    """A copy of ``config`` with ``key=value`` assignments applied (dotted keys reach nested blocks).

    Values are read as JSON when they parse (``3``, ``0.5``, ``true``, ``null``, ``[0.8, 0.1, 0.1]``)
    and as plain strings otherwise; a setting that takes text keeps a number or boolean as typed (a
    root or revision named ``2024``). Unknown keys and invalid values raise one ``ValueError`` naming
    every one of them.
    """
    data = config.model_dump(mode="json")
    known = _dotted_keys(data)
    blocks = [key for key in known if isinstance(_at(data, key), dict)]  # before any assignment changes data
    problems = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            problems.append(f"  {assignment!r}: expected key=value (e.g. {_example_key(data)}=...)")
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = data
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                block = ".".join(parents[:depth + 1])
                meant = _closest_key(block, blocks)
                within = ".".join(parents[:depth]) or type(config).__name__
                problems.append(f"  {key}: {part!r} is not a block of {within}"
                                + (f"; did you mean {meant}?" if meant else ""))
                break
            node = node[part]
        else:
            scalar = isinstance(value, (bool, int, float))
            node[leaf] = raw if scalar and _takes_text(type(config), [*parents, leaf]) else value
    try:
        validated = type(config).model_validate(data)
    except ValidationError as err:
        problems.append(describe_validation_error(err, known))
    if problems:
        given = f" (overrides {list(assignments)})" if assignments else ""
        raise ValueError(f"invalid {type(config).__name__} settings{given}:\n" + "\n".join(problems))
    return validated


def _takes_text(model: type[BaseModel], path: Sequence[str]) -> bool:
    """Whether the setting at dotted ``path`` of ``model`` takes a string (``str``, ``str | None``, a
    `Device`), so that what was typed for it is text even when it reads as a number."""
    annotation: Any = model
    for part in path:
        blocks = [t for t in _types_in(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        field = blocks[0].model_fields.get(part) if blocks else None
        if field is None:
            return False
        annotation = field.annotation
    return str in _types_in(annotation)


def _types_in(annotation: Any) -> list[Any]:
    """``annotation`` and every type inside it (unions, Optional, Annotated), flattened."""
    return [annotation, *(t for arg in get_args(annotation) for t in _types_in(arg))]


def _example_key(data: dict[str, Any]) -> str:
    """A real key of these settings to show in an error: the first one inside a block, else the first."""
    for name, value in data.items():
        if isinstance(value, dict) and value:
            return f"{name}.{next(iter(value))}"
    return next(iter(data), "key")


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every setting of a dumped config as a dotted key (``train.em_iterations``), blocks included."""
    keys = []
    for name, value in data.items():
        keys.append(prefix + name)
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _at(data: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a dumped config."""
    for part in key.split("."):
        data = data[part]
    return data


def _closest_key(key: str, known: Sequence[str]) -> str | None:
    """The setting ``key`` was probably meant as: one of that name in another block (``em_iterations``
    for ``train.em_iterations``), else the nearest spelling."""
    leaf = key.rsplit(".", 1)[-1]
    same_name = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != key]
    if same_name:
        return same_name[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return close[0] if close else None


def describe_validation_error(err: ValidationError, known: Sequence[str] = ()) -> str:
    """One line per problem, ``dotted.key: what is wrong (got value)``, without pydantic's URLs;
    ``known`` (every dotted key of the settings) lets an unknown key name the one it was likely meant as."""
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "extra_forbidden":
            meant = _closest_key(key, known)
            hint = f"did you mean {meant}?" if meant else "check the spelling"
            lines.append(f"  {key}: unknown key (not a setting of this block; {hint})")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        said = isinstance(problem.get("input"), dict) or ", got " in message  # a validator's own message names it
        got = "" if said else f" (got {problem.get('input')!r})"
        lines.append(f"  {key + ': ' if key else ''}{message}{got}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# ingest

DatasetName = Literal["ultrafeedback", "persona", "helpsteer2", "prism", "synthetic", "generic"]

ULTRAFEEDBACK_CRITERIA = ("helpfulness", "honesty", "instruction_following", "truthfulness")
HELPSTEER2_ATTRIBUTES = ("helpfulness", "correctness", "coherence", "complexity", "verbosity")
PRISM_OPENING_RESPONSES = 4  # models answering a PRISM conversation's opening prompt

HUB_SOURCES: dict[str, tuple[str, str | None]] = {
    # dataset -> (hub name, pinned revision); UltraFeedback's revision has the Dec 2023 score fix.
    # HelpSteer2's (2026-11-25, as public projects pin it) has preference/ and disagreements/ in their
    # own folders (earlier revisions kept them at the top), as helpsteer2.data = "preference" reads them.
    # PERSONA is gated and its revisions could not be seen from here: unpinned.
    "ultrafeedback": ("openbmb/UltraFeedback", "40b436560ca83a8dba36114c22ab3c66e43f6d5e"),
    "persona": ("SynthLabsAI/PERSONA", None),
    "helpsteer2": ("nvidia/HelpSteer2", "990b2711a36180dd19d9c94b8627844866f8982a"),
    "prism": ("HannahRoseKirk/prism-alignment", "18ab5cfb37456f4ec8cbc00212ce54cf7b1239f6"),
}


class SplitConfig(Options):
    """How prompts are split into train / validation / test (never one prompt in two splits).

    ``fractions`` are fractions of prompts. ``sizes``, when given, asks for exact numbers of rankings
    instead: whole prompts are dealt in a seeded order to the first split that still has room, and
    prompts that fit nowhere are left out (this is how a preset reproduces a paper's split sizes).
    ``from_source`` keeps the ``split`` column of a generic source instead of assigning one.
    """

    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    sizes: tuple[int, int, int] | None = None
    from_source: bool = False

    @field_validator("fractions")
    @classmethod
    def _fractions_sum_to_one(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(f < 0 for f in v) or abs(sum(v) - 1.0) > 1e-9:
            raise ValueError(f"split fractions (train, validation, test) must be >= 0 and sum to 1, got {v}")
        return v

    @field_validator("sizes")
    @classmethod
    def _sizes_non_negative(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is not None and (any(s < 0 for s in v) or sum(v) == 0):
            raise ValueError(f"split sizes (train, validation, test) must be >= 0 and not all 0, got {v}")
        return v


class UltraFeedbackOptions(Options):
    """One ranking per prompt per criterion over a shared slate of ``m`` completions (k = 4).

    A slate is ``m`` completions with a non-empty response, drawn (seeded, per prompt) from those rated
    on every criterion when there are at least ``m`` of them, else from all. A criterion whose rating
    is "N/A" for any completion of the slate gives no ranking for that prompt: a ranking must order
    every response of the slate, and the slate must stay the same across criteria so the mixture sees
    the same responses under each. Prompts with fewer than ``m`` usable completions are skipped, or
    with ``short_slates="keep"`` ranked over the (2 or more) they have.
    """

    criteria: tuple[str, ...] = ULTRAFEEDBACK_CRITERIA
    m: int = Field(4, ge=2)
    min_distinct_rankings: int = Field(2, ge=1)
    """Keep prompts whose criteria give at least this many distinct orders (1 keeps all)."""
    short_slates: Literal["skip", "keep"] = "skip"

    @field_validator("criteria")
    @classmethod
    def _known_criteria(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(v) - set(ULTRAFEEDBACK_CRITERIA))
        if not v or unknown or len(set(v)) != len(v):
            raise ValueError(f"criteria must be distinct names from {ULTRAFEEDBACK_CRITERIA}, got {v}")
        return v


class PersonaOptions(Options):
    """Cluster = a demographic profile read from the persona text (DESIGN.md 6).

    The persona is ``key: value`` lines split on the first ": ". The profile label joins
    ``key=value`` for each of ``fields``, in order, e.g. ``age=18-44|sex=Female|race=White``, where
    ``age`` is bucketed into bands starting at ``age_bands`` (an age below the first edge has no
    band), ``race`` into the first of ``race_groups`` its value starts with (else "Other"), and any
    other field is used verbatim. Rows whose persona lacks a field are skipped. ``top_profiles``
    keeps the most frequent profiles (ties by label).

    The default is the paper's 12-profile preset: "two age ranges, two sexes, and four races"
    (paper section 5.1). The paper names the axes but not the age bands, the race buckets, nor which
    12 of the 2 x 2 x 4 = 16 combinations it kept; ours are ages 18-44 / 45+, races White / Black /
    Asian / Other (the census race value's first words), and the 12 most frequent combinations.
    """

    fields: tuple[str, ...] = ("age", "sex", "race")
    age_bands: tuple[int, ...] = (18, 45)
    race_groups: tuple[str, ...] = ("White", "Black", "Asian")
    top_profiles: int | None = Field(12, ge=1)

    @field_validator("fields")
    @classmethod
    def _some_fields(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or len(set(v)) != len(v) or any(not f.strip() for f in v):
            raise ValueError(f"fields must be distinct, non-empty persona keys, got {v}")
        return v

    @field_validator("age_bands")
    @classmethod
    def _increasing(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(b <= a for a, b in zip(v, v[1:])) or v[0] < 0:
            raise ValueError(f"age_bands must be increasing non-negative band starts, got {v}")
        return v


class HelpSteer2Options(Options):
    """``data="ratings"`` (the default config): for every pair of responses to one prompt and every
    attribute whose ratings differ by at least ``min_gap``, one ranking (m = 2) with the higher-rated
    response first; cluster = attribute. Higher is treated as preferred for every attribute,
    verbosity and complexity included (each attribute is its own criterion).

    ``data="preference"`` (the ``preference`` data_dir): one ranking per annotated pair whose
    ``preference_strength`` (-3: response_1 much better .. 3: response_2 much better) is at least
    ``min_strength`` either way, the preferred response first; no cluster label (one population,
    whose clusters EM has to find).

    ``split_turns``: a multi-turn prompt (the release's ``<extra_id_1>User`` / ``<extra_id_1>Assistant``
    markers) also becomes ``prompt_messages``, its turns as chat messages for the chat template;
    false keeps the markers inside the one prompt text (for a model without a chat template, which
    cannot render messages)."""

    data: Literal["ratings", "preference"] = "ratings"
    attributes: tuple[str, ...] = HELPSTEER2_ATTRIBUTES
    min_gap: int = Field(1, ge=1, le=4)
    min_strength: int = Field(1, ge=1, le=3)
    split_turns: bool = True

    @field_validator("attributes")
    @classmethod
    def _known_attributes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(v) - set(HELPSTEER2_ATTRIBUTES))
        if not v or unknown or len(set(v)) != len(v):
            raise ValueError(f"attributes must be distinct names from {HELPSTEER2_ATTRIBUTES}, got {v}")
        return v


class PrismOptions(Options):
    """One ranking per conversation: the opening turn's model responses ranked by the participant's
    scores (1-100; equal scores are tied tiers); cluster = the participant's profile from the survey.

    The profile label joins ``field=value`` for each of ``fields``, in order, e.g.
    ``location.special_region=UK|gender=Female``; a field is a survey column (``age``, ``gender``,
    ``education``, ...) or a key of one of its nested columns, written with a dot
    (``location.special_region``, ``ethnicity.simplified``, ``religion.simplified``). Participants
    with a value in ``exclude_values`` or without a field are left out, and
    ``top_profiles`` keeps the most frequent profiles (ties by label). Conversations whose opening
    turn has fewer than ``min_responses`` distinct scored responses, or scores them all alike, give
    no ranking.

    The paper does not use PRISM; this default is ours: the PRISM authors' own regions (which split
    the US and UK from the rest of their continents), the four largest of them.
    """

    fields: tuple[str, ...] = ("location.special_region",)
    exclude_values: tuple[str, ...] = ("Prefer not to say",)
    top_profiles: int | None = Field(4, ge=1)
    min_responses: int = Field(4, ge=2, le=PRISM_OPENING_RESPONSES)

    @field_validator("fields")
    @classmethod
    def _some_fields(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or len(set(v)) != len(v) or any(not part.strip() for f in v for part in f.split(".")):
            raise ValueError(f"fields must be distinct survey columns or column.key paths, got {v}")
        return v


class SyntheticOptions(Options):
    """moplex_core.data.synthetic.SyntheticConfig without its augmentation fields: the rankings
    artifact holds originals only (generated responses are the augment stage's); the seed is the
    ingest config's."""

    n: int = Field(2000, ge=1)
    k: int = Field(3, ge=1)
    m: int = Field(4, ge=2)
    n_values: int = Field(10, ge=1)
    noise: float = Field(1.0, ge=0.0)
    alpha: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _alpha_is_a_distribution(self) -> SyntheticOptions:
        if self.alpha is not None and (
            len(self.alpha) != self.k or any(a < 0 for a in self.alpha) or abs(sum(self.alpha) - 1) > 1e-6
        ):
            raise ValueError(f"alpha must be {self.k} non-negative proportions summing to 1, got {self.alpha}")
        return self


class IngestConfig(StageConfig):
    """Which dataset to read, from where, and how to turn it into `rankings` (DESIGN.md 3, 6).

    The data comes from ``path`` (a local file or folder in the dataset's raw schema) when given,
    else from the hub (``hub_name``, default the dataset's, at ``revision``, default the pinned one).
    ``labels`` declares the cluster label set (default: the dataset's criteria or attributes; none
    for persona and generic). ``validation="drop"`` writes the valid rows and records the others in
    ``rejected.parquet``; ``"strict"`` writes nothing if any row is bad.
    """

    dataset: DatasetName
    path: str | None = None
    """Made absolute (`absolute_path`), as every local path of these configs."""
    hub_name: str | None = None
    revision: str | None = None
    seed: int = Field(0, ge=0)
    split: SplitConfig = SplitConfig()
    validation: Literal["strict", "drop"] = "strict"
    labels: tuple[str, ...] | None = None
    shard_rows: int = Field(100_000, ge=1)
    ultrafeedback: UltraFeedbackOptions = UltraFeedbackOptions()
    persona: PersonaOptions = PersonaOptions()
    helpsteer2: HelpSteer2Options = HelpSteer2Options()
    prism: PrismOptions = PrismOptions()
    synthetic: SyntheticOptions = SyntheticOptions()

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, v: str | None) -> str | None:
        return None if v is None else absolute_path(v)

    @model_validator(mode="after")
    def _source_is_consistent(self) -> IngestConfig:
        if self.path is not None and (self.hub_name is not None or self.revision is not None):
            raise ValueError("give either path (a local file or folder) or hub_name/revision, not both")
        if self.dataset == "generic" and self.path is None:
            raise ValueError("dataset 'generic' reads canonical Parquet/JSONL from a local path; set path")
        if self.dataset == "synthetic" and (self.path or self.hub_name or self.revision):
            raise ValueError("dataset 'synthetic' is generated; it takes no path, hub_name or revision")
        if self.split.from_source and self.dataset != "generic":
            raise ValueError("split.from_source keeps a generic source's split column; other datasets are split here")
        if self.split.from_source and self.split.sizes is not None:
            raise ValueError("split.sizes and split.from_source exclude each other")
        if self.labels is not None and (not self.labels or len(set(self.labels)) != len(self.labels)):
            raise ValueError(f"labels must be distinct cluster names, got {self.labels}")
        return self

    def hub_source(self) -> tuple[str, str | None]:
        """(hub name, revision) this config reads when it has no local path."""
        default_name, default_revision = HUB_SOURCES.get(self.dataset, (None, None))
        name = self.hub_name or default_name
        if name is None:
            raise ValueError(f"dataset {self.dataset!r} has no hub source")
        if self.revision is not None or self.hub_name is not None:
            return name, self.revision
        return name, default_revision

    def hub_parts(self) -> tuple[dict[str, str], ...]:
        """The `datasets.load_dataset` keyword arguments of each part this config reads from the hub:
        PRISM's two configs, HelpSteer2's ``preference`` data_dir, else the default config."""
        if self.dataset == "prism":
            return ({"name": "survey"}, {"name": "conversations"})
        if self.dataset == "helpsteer2" and self.helpsteer2.data == "preference":
            return ({"data_dir": "preference"},)
        return ({},)

    def identity(self) -> dict[str, Any]:
        """Everything that changes the rankings except where a local file lives: its content is hashed
        separately (as the version's input), so moving a file keeps the version and editing it does
        not. Options of other datasets are left out."""
        data = self.model_dump(mode="json", exclude={"path"})
        for name in ("ultrafeedback", "persona", "helpsteer2", "prism", "synthetic"):
            if name != self.dataset:
                del data[name]
        if self.dataset == "helpsteer2":  # only the options of the data read (ratings keep their old versions)
            unused = ("data", "min_strength") if self.helpsteer2.data == "ratings" else ("attributes", "min_gap")
            for key in unused:
                del data["helpsteer2"][key]
            if self.helpsteer2.split_turns:  # the default's change is the adapter's version (helpsteer2-2)
                del data["helpsteer2"]["split_turns"]
        if self.path is None and self.dataset in HUB_SOURCES:
            data["hub_name"], data["revision"] = self.hub_source()
        return data


INGEST_PRESETS: dict[str, IngestConfig] = {
    # Paper section 5.1: 3,612 / 448 / 452 rankings = 903 / 112 / 113 prompts x 4 criteria, from
    # "a subset where these criteria follow different rankings". The paper does not say how many
    # distinct orders that means (we keep >= 2) nor how the 1,128 prompts were drawn (we deal them in
    # a seeded order). A prompt with an "N/A" criterion gives 3 rankings, so a split can end up to 3
    # rankings short of its size; the manifest's summary records the sizes reached.
    "ultrafeedback-paper": IngestConfig(
        dataset="ultrafeedback", split=SplitConfig(sizes=(3612, 448, 452))
    ),
    # Paper section 5.1: 12 profiles, m = 2, 1,905 / 237 / 258 rankings (how they were sampled from
    # the profiles is not stated; ours follow the data's mix); profiles as PersonaOptions.
    "persona-paper": IngestConfig(dataset="persona", split=SplitConfig(sizes=(1905, 237, 258))),
    "helpsteer2": IngestConfig(dataset="helpsteer2"),
    # Paper appendix B.1 defaults (k = 3, m = 4).
    "synthetic": IngestConfig(dataset="synthetic"),
}


def ingest_preset(name: str) -> IngestConfig:
    try:
        return INGEST_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown ingest preset {name!r}; choose one of {', '.join(INGEST_PRESETS)}") from None


# ---------------------------------------------------------------------------------------------------
# augment

GeneratorBackend = Literal["hf", "vllm", "borrow"]
_SAMPLING_FIELDS = ("temperature", "top_p", "max_new_tokens", "dtype", "use_chat_template", "max_prompt_tokens")


VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's SamplingParams refuse higher temperatures (vllm-project/vllm PR 44965, in 0.33.0)."""


class AugmentConfig(StageConfig):
    """How the augment stage adds m' - m generated responses to every ranking (paper section 4.1).

    ``backend``: ``hf`` samples from ``model`` with transformers in this process, ``vllm`` with vLLM
    in a subprocess under ``vllm_python`` (an interpreter of an environment where vllm and pyarrow
    are installed; vLLM never shares Prefect's), ``borrow`` takes other rankings' responses to the
    same prompt (PERSONA: other profiles' revisions of the same instruction) and needs no model.
    Model backends generate once per prompt; every ranking of that prompt gets the same texts.

    A generated text equal to an original or to another generated text of the same prompt (after
    trimming, collapsing whitespace and case-folding) is dropped, and the missing ones are drawn
    again, ``max_attempts`` rounds in all. Prompts still short are written to ``shortfall.parquet``;
    ``on_shortfall="fail"`` stops the stage there, ``"keep_fewer"`` keeps those rankings with fewer
    generated responses.

    Sampling is seeded per prompt and attempt, so with ``hf`` texts do not depend on sharding or
    batching (on one machine and dtype). vLLM's texts can: its kernels are not batch-invariant by
    default (its reproducibility docs), so a resumed shard may sample other texts than a clean run;
    the seeds still fix the draws, and the version is the same. What is left out of the version
    (`identity`): ``batch_size``, ``device``, ``vllm_python`` and ``vllm_gpu_memory_utilization``
    (where and how fast, not what), ``on_shortfall`` (what to accept, not what is generated), and
    ``model`` itself: a local model directory's content is an input of the version (moving it keeps
    the version, retraining it does not).
    """

    backend: GeneratorBackend = "hf"
    model: str | None = None
    """A local model directory (save_pretrained output; made absolute) or a hub name; none for ``borrow``."""

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, v: str | None) -> str | None:
        return local_model_absolute(v)
    n_generated: int = Field(3, ge=1)
    """m' - m: responses added to every ranking."""
    temperature: float = Field(2.0, gt=0.0)
    """The paper's best (appendix, temperature ablation: 0.5 / 1 / 2 / 4); at most 2 with vLLM."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(512, ge=1)
    seed: int = Field(0, ge=0)
    max_attempts: int = Field(4, ge=1)
    on_shortfall: Literal["fail", "keep_fewer"] = "fail"
    shard_prompts: int = Field(256, ge=1)
    """Prompts per part-*.parquet shard: the unit of resumption after a kill."""
    batch_size: int = Field(16, ge=1)
    """Sequences per transformers `generate` call (hf); vLLM schedules its own batches."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations; ``auto`` is bfloat16 on a GPU and float32 on the CPU (hf: the version
    holds the dtype ``auto`` resolves to, `identity_on_this_machine`)."""
    device: Device = "auto"
    """hf only: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``, ``cuda:1``, ..."""
    use_chat_template: bool = True
    max_prompt_tokens: int | None = Field(None, ge=1)
    vllm_python: str | None = None
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _backend_is_complete(self) -> AugmentConfig:
        if self.backend in ("hf", "vllm") and not self.model:
            raise ValueError(f"backend {self.backend!r} samples from a model; set model to a local model "
                             "directory or a hub name")
        if self.backend == "borrow" and self.model is not None:
            raise ValueError("backend 'borrow' takes other rankings' responses and uses no model; unset model")
        if self.backend == "vllm" and not self.vllm_python:
            raise ValueError("backend 'vllm' runs vLLM under another interpreter (it cannot share Prefect's "
                             "environment); set vllm_python to that environment's python, e.g. "
                             "/opt/vllm-env/bin/python")
        if self.backend == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(f"temperature = {self.temperature}: vLLM's SamplingParams refuse a temperature above "
                             f"{VLLM_MAX_TEMPERATURE:g} (since 2026-06, after the model has loaded); use backend "
                             "'hf' for the paper's temperature 4")
        return self

    def identity(self) -> dict[str, Any]:
        excluded = {"model", "batch_size", "device", "vllm_python", "vllm_gpu_memory_utilization", "on_shortfall"}
        if self.backend == "borrow":
            excluded |= set(_SAMPLING_FIELDS)
        return self.model_dump(mode="json", exclude=excluded)


# ---------------------------------------------------------------------------------------------------
# cache

# No float16 for the cache and train: their input and LoRA gradients would need loss scaling, which
# this code does not do ("auto" on a GPU without bfloat16 is float32).
ModelDtype = Literal["auto", "float32", "bfloat16", "float64"]


class CacheConfig(StageConfig):
    """How the cache stage tokenises every response and computes its reference terms (DESIGN 3, 5.4).

    For every response (originals, then generated ones): token ids (prompt + response + EOS), the
    response start, ``ref_logp`` = log pi_ref(y|x) in float64, and the m' x m' reference
    contraction s_ref. ``model`` is pi_ref, the base model the train stage puts adapters on.

    Left out of the version (`identity`): ``model`` (its directory's content is an input of the
    version instead), ``score_batch_size``, ``device`` and ``chunk_size`` (how fast, not what: other
    pass and chunk shapes round differently, moving the floats in their last digits, and a resume under
    other values says so), and ``contractions`` while it is true (versions built before it existed
    stay valid).
    """

    model: str
    """A local model directory (save_pretrained output; made absolute) or a cached hub name."""

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, v: str) -> str:
        return local_model_absolute(v)
    use_chat_template: bool = True
    max_prompt_tokens: int | None = Field(512, ge=1)
    """Longer prompts lose their start."""
    max_response_tokens: int | None = Field(512, ge=1)
    """Longer responses lose their end (and their EOS), never their start."""
    score_batch_size: int = Field(32, ge=1)
    """Responses per forward + input-gradient pass, as the train and evaluate stages count their
    passes (the pass's memory grows with it, not with m'). An example's responses share a pass, and
    its prompt's, where they fit; an example with more responses than this is split over passes."""
    shard_rows: int = Field(1000, ge=1)
    """Examples per part-*.parquet shard: the unit of resumption after a kill."""
    dtype: ModelDtype = "auto"
    """``auto`` is bfloat16 on a GPU and float32 on the CPU (the version holds the dtype it resolves to,
    `identity_on_this_machine`); log-probs accumulate in float32/64."""
    device: Device = "auto"
    chunk_size: int = Field(1024, ge=1)
    """Response positions projected to the vocabulary at a time."""
    contractions: bool = True
    """False: forward passes only, no s_ref (``ref_contraction`` null), for a cache that is only ever
    scored exactly: `moplex assign`'s, or a train stage with ``train.anchors = null``. Train refuses
    anchors on it."""

    def identity(self) -> dict[str, Any]:
        exclude = {"model", "score_batch_size", "device", "chunk_size"} | ({"contractions"} if self.contractions else set())
        return self.model_dump(mode="json", exclude=exclude)


def no_contractions_message(anchors: int | None, where: str) -> str:
    """Why a = ``anchors`` estimated scores cannot use ``where`` (a cache built with
    ``cache.contractions = false``), and what to do: one wording for every place that refuses it."""
    return (f"train.anchors a = {anchors} estimates scores from the reference contractions s_ref, and {where} has "
            "none (cache.contractions = false: forward passes only). Set train.anchors to null to compute every "
            "response exactly, or build the cache with cache.contractions = true.")


# ---------------------------------------------------------------------------------------------------
# train

class TrainConfig(StageConfig):
    """The EM training stage: k LoRA adapters on the cache's base model (DESIGN 5.3-5.5).

    ``anchors`` = a responses per example computed exactly per EM iteration (the rest estimated,
    paper Algorithm 1); ``None`` computes every response (the `full` ablation). ``estimation``:
    ``delta`` linearises log pi_c - log pi_ref, ``logpi`` log pi_c alone (the authors' code).
    ``anchor_weighting``: a non-anchor's estimate is the ``mean`` of every anchor's first-order
    estimate of it (the paper's Algorithm 1) or the estimate of the ``nearest`` anchor in input
    embedding space alone, where the first-order term is most accurate (README, "Which anchor
    estimates a response"); in the version only when ``nearest`` with at least 2 anchors.
    ``epochs`` passes over the weighted (example, cluster) pairs per M-step, in minibatches of
    ``batch_size`` pairs (a rows each, m' without anchors: the M-step's memory); ``first_epochs``
    (None = ``epochs``) for the first M-step, which starts with every adapter at the base model and
    must carry the start's partition into them. ``score_batch_size``
    is the rows (one response under one adapter, clusters mixed) per E-step or exact-scoring pass.
    ``share_prompts`` runs each (example, cluster)'s prompt once per pass for all its rows there
    (the same scores and gradients up to float rounding, for fewer tokens; with ``lora_dropout``
    the rows share the prompt's dropout mask): faster on the CPU, slower on an H200 (1.5-2.2x at
    m' = 26 in 8-row passes, a second decoder call per pass; about 5% for full computation at 32-row passes;
    README, GPU efficiency). Trains on the cache's ``train`` split.

    ``likelihood`` is the observation model of a ranking: ``pl`` (Plackett-Luce, eq. 2 and 5) or
    ``bt_pairs`` (Bradley-Terry over every ordered pair of the ranking, as DPO and the mixture-of-BT
    baselines see it). ``hard`` replaces the posteriors by their one-hot argmax (MaxMin-RLHF's
    assignment step). Both exist so that the baselines are presets of this one engine (DESIGN 7).

    ``init`` breaks the symmetry of the first M-step (moplex_core.em): ``linearized`` (default), the
    posteriors of a linear PL mixture over each response's output-layer score gradient under the
    base model (one extra forward per training response; `LoRAPolicyScorer.response_features`);
    ``kmeans`` over the rankings' Fisher-score features; a seeded ``dirichlet``; or ``labels``, the
    training rankings' own ``cluster`` labels (0.9 on the label's cluster, labels in sorted order to
    c0, c1, ...): a warm start from known groups (annotators, criteria, personas) that EM then
    refines, and the test of how much of a known partition the adapters can hold. It needs a label on
    every training ranking, exactly k labels, and one restart (every restart would start alike).

    ``backtracks``: when the training log-likelihood falls after an M-step, redo that M-step from
    where it started at half the learning rate, up to this many times per iteration (each costs one
    M-step and one E-step more; soft EM only). Soft EM never lowers the log-likelihood when every
    M-step raises its own objective; a few Adam steps may not. With anchors the log-likelihood before
    the M-step is taken again under this iteration's anchors, to compare like with like: one E-step
    more per iteration.

    ``estimation_check``: after every E-step, its estimated scores of this many training examples (a
    seeded draw, the same each iteration; 0 = none) are compared with their exact scores under the
    same adapters (`train.measure_estimates`, in each iteration's estimation.json; the last one and
    the trajectory in result.json, warned about outside `train.ESTIMATES_HOLD`). With anchors only.
    It is part of the version because result.json holds its outcome.

    ``exact_fallback``: when an E-step's estimates of those examples are off by more than this many
    times the spread of their exact scores (their relative error; `ESTIMATES_HOLD` warns above 1.0,
    where they say nothing about an order; 0.5 is a stricter guard), redo that iteration's M-step
    (whose estimated objective led there) and E-step with every response exact, and every later step
    too (the `full` computation from there; where, in result.json's ``fell_back``). Never train on
    estimates seen not to hold, at the price of exact passes once they fail (and, once, of the
    discarded M-step and E-step). None: never. Needs anchors and estimation_check > 0.

    Left out of the version: ``score_batch_size``, ``device``, ``chunk_size`` (how fast, not what),
    except that with LoRA dropout ``score_batch_size`` and the device type are in (`identity`).
    The base model is the one the cache was built from (its version pins the model's content).
    """

    k: int = Field(3, ge=1)
    beta: float = Field(0.1, gt=0.0)
    anchors: int | None = Field(2, ge=1)
    estimation: Literal["delta", "logpi"] = "delta"
    anchor_weighting: Literal["mean", "nearest"] = "mean"
    likelihood: Literal["pl", "bt_pairs"] = "pl"
    hard: bool = False
    lora_r: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0.0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lr: float = Field(1e-4, gt=0.0)
    epochs: int = Field(1, ge=1)
    first_epochs: int | None = Field(None, ge=1)
    batch_size: int = Field(16, ge=1)
    gamma_min: float = Field(1e-3, ge=0.0, lt=1.0)
    em_iterations: int = Field(10, ge=1)
    tol: float = Field(1e-6, ge=0.0)
    init: Literal["linearized", "kmeans", "dirichlet", "labels"] = "linearized"
    restarts: int = Field(1, ge=1)
    backtracks: int = Field(0, ge=0)
    estimation_check: int = Field(64, ge=0)
    exact_fallback: float | None = Field(None, gt=0.0)
    seed: int = Field(0, ge=0)
    dtype: ModelDtype = "auto"
    """As the cache's: versioned as the dtype it resolves to on the machine that trains."""
    device: Device = "auto"
    score_batch_size: int = Field(32, ge=1)
    chunk_size: int = Field(1024, ge=1)
    share_prompts: bool = True

    @field_validator("lora_targets")
    @classmethod
    def _some_targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not t.strip() for t in v):
            raise ValueError(f"lora_targets must name at least one module (e.g. q_proj), got {v}")
        return v

    @model_validator(mode="after")
    def _backtracks_are_soft_em(self) -> TrainConfig:
        if self.hard and self.backtracks > 0:
            raise ValueError(f"train.backtracks = {self.backtracks} redoes M-steps after which the log-likelihood "
                             "fell, but hard EM (train.hard) may lower it legitimately and never backtracks: set "
                             "train.backtracks = 0")
        return self

    @model_validator(mode="after")
    def _fallback_has_a_check(self) -> TrainConfig:
        if self.exact_fallback is not None and (self.anchors is None or self.estimation_check == 0):
            raise ValueError("train.exact_fallback computes every response exactly once the anchors' estimates "
                             "fail the estimation check: it needs train.anchors (not null) and "
                             "train.estimation_check > 0")
        return self

    @model_validator(mode="after")
    def _restarts_can_differ(self) -> TrainConfig:
        if self.k == 1 and self.restarts > 1:
            raise ValueError(f"train.k = 1 starts every restart from the same responsibilities (all ones), so "
                             f"restarts = {self.restarts} would repeat one fit: set train.restarts = 1")
        return self

    @model_validator(mode="after")
    def _every_ranking_trains_a_cluster(self) -> TrainConfig:
        if not self.hard and self.gamma_min > 1 / self.k:
            raise ValueError(f"train.gamma_min = {self.gamma_min} is above 1/k = {1 / self.k:.4g}: a ranking's "
                             "largest responsibility can be as low as 1/k, and such a ranking would train no "
                             f"adapter at all; set train.gamma_min <= {1 / self.k:.4g}")
        return self

    @model_validator(mode="after")
    def _one_start_from_labels(self) -> TrainConfig:
        if self.init == "labels" and self.restarts > 1:
            raise ValueError(f"train.init = labels starts every restart from the same responsibilities, so "
                             f"restarts = {self.restarts} would differ only by their adapters' random "
                             "initialisation: set train.restarts = 1")
        return self

    def identity(self) -> dict[str, Any]:
        """What enters the train version. ``score_batch_size`` and ``device`` do not, unless LoRA
        dropout is on: its masks are drawn pass by pass (so by how rows are grouped into passes) and
        by the device's generator (train.plan_train adds the device type)."""
        volatile = {"score_batch_size", "device", "chunk_size"} - ({"score_batch_size"} if self.lora_dropout else set())
        if self.anchor_weighting == "mean" or self.anchors in (None, 1):  # the default, or nothing to weigh:
            volatile.add("anchor_weighting")  # the versions of before the setting existed hold
        return self.model_dump(mode="json", exclude=volatile)


# ---------------------------------------------------------------------------------------------------
# tiny model (built by the pipeline when a preset's model is TINY_MODEL)

TINY_MODEL = "tiny"
"""The special model value: the pipeline builds a tiny offline Qwen3 model (moplex_core.lm.tiny) from
the ingested texts into the artifact root, versioned like any stage output, and uses it."""


class TinyModelConfig(StageConfig):
    """moplex_core.lm.tiny.build_tiny_model settings. The model is pre-trained on every (prompt,
    response) pair of the train split, at most ``max_pairs`` of them (the first, in table order)."""

    hidden_size: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    vocab_size: int = Field(320, ge=261)
    """256 byte symbols + 4 special tokens + at least one merge."""
    max_positions: int = Field(1024, ge=64)
    pretrain_steps: int = Field(150, ge=0)
    max_pairs: int = Field(4000, ge=1)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _heads_fit(self) -> TinyModelConfig:
        head, rest = divmod(self.hidden_size, self.heads)
        if rest or self.heads % self.kv_heads or head % 2:
            raise ValueError(f"tiny_model: hidden_size {self.hidden_size} / heads {self.heads} must be a whole, even "
                             f"head size (rotary embeddings) and heads a multiple of kv_heads {self.kv_heads}")
        return self


# ---------------------------------------------------------------------------------------------------
# evaluate

class EvaluateConfig(StageConfig):
    """The evaluate stage: the trained mixture on held-out splits with exact scores (DESIGN 7).

    The Hungarian matching of EM's cluster ids to the true labels is fitted on ``fit_split`` and
    applied to every split. ``score_batch_size`` is the rows (one response under one adapter) per
    scoring pass. Left out of the version: ``device`` and ``score_batch_size``.
    """

    splits: tuple[str, ...] = ("validation", "test")
    fit_split: str = "validation"
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


# ---------------------------------------------------------------------------------------------------
# the whole pipeline

PipelineStage = Literal["ingest", "model", "augment", "cache", "train", "evaluate"]
PRESETS_DIR = Path(__file__).resolve().parents[1] / "data" / "presets"


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
        m = {"synthetic": self.ingest.synthetic.m, "ultrafeedback": self.ingest.ultrafeedback.m,
             "helpsteer2": 2, "persona": 2, "prism": PRISM_OPENING_RESPONSES}.get(self.ingest.dataset)
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
        raise ValueError(f"unknown pipeline preset {name!r}: no {path}; choose one of {', '.join(preset_names())}")
    try:
        return PipelineConfig.model_validate(json.loads(path.read_text())["config"])
    except (json.JSONDecodeError, KeyError, ValidationError) as err:
        raise ValueError(f"{path} is not a valid pipeline preset ({{\"description\": ..., \"config\": "
                         f"PipelineConfig}}):\n{err}") from None


def preset_description(name: str) -> str:
    return json.loads((PRESETS_DIR / f"{name}.json").read_text()).get("description", "")
