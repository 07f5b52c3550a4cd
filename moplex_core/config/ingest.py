"""The ingest stage's settings: which dataset, from where, each dataset's own rules, the split."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moplex_core.config.base import Options, StageConfig, absolute_path

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

    @model_validator(mode="after")
    def _sizes_or_fractions(self) -> SplitConfig:
        # sizes deal exact numbers of rankings and fractions would be ignored unseen (a preset's sizes under
        # --set ingest.split.fractions=...); the default fractions beside sizes are what every manifest records
        default = type(self).model_fields["fractions"].default
        if self.sizes is not None and any(abs(f - d) > 1e-9 for f, d in zip(self.fractions, default, strict=True)):
            raise ValueError(f"split.sizes {list(self.sizes)} and split.fractions {list(self.fractions)} exclude each "
                             "other: sizes deal exact numbers of rankings and ignore fractions; give split.sizes=null "
                             f"to split by fractions, or split.fractions={list(default)} (the default) to deal by "
                             "sizes")
        return self


class DatasetOptions(Options):
    """The block of one dataset's own settings (``IngestConfig.<dataset>``), and what the configs
    know of that dataset from it alone; a new dataset's block says here what differs from these."""

    def labels(self) -> tuple[str, ...] | None:
        """The cluster label set it declares (`IngestConfig.labels` unset), or None."""
        return None

    def responses(self) -> int | None:
        """m, the responses per ranking (at most), where the settings alone tell it."""
        return None

    def hub_parts(self) -> tuple[dict[str, str], ...]:
        """The `datasets.load_dataset` keyword arguments of each part read from the hub."""
        return ({},)

    def identity(self) -> dict[str, Any]:
        """Its settings that enter the ingest version."""
        return self.model_dump(mode="json")


class UltraFeedbackOptions(DatasetOptions):
    """One ranking per prompt per criterion over a shared slate of ``m`` completions (k = 4).

    A slate is ``m`` completions with a distinct non-empty response (a repeated text is read once, at
    its first), drawn (seeded, per prompt) from those rated
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

    def labels(self) -> tuple[str, ...]:
        return self.criteria

    def responses(self) -> int:
        return self.m


class PersonaOptions(DatasetOptions):
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

    def responses(self) -> int:
        return 2


class HelpSteer2Options(DatasetOptions):
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

    def labels(self) -> tuple[str, ...] | None:
        return self.attributes if self.data == "ratings" else None

    def responses(self) -> int:
        return 2

    def hub_parts(self) -> tuple[dict[str, str], ...]:
        return ({"data_dir": "preference"},) if self.data == "preference" else ({},)

    def identity(self) -> dict[str, Any]:
        """Only the options of the data read (ratings keep their old versions); ``split_turns`` at its
        default is the adapter's version (helpsteer2-2)."""
        unused = {"data", "min_strength"} if self.data == "ratings" else {"attributes", "min_gap"}
        return self.model_dump(mode="json", exclude=unused | ({"split_turns"} if self.split_turns else set()))


class PrismOptions(DatasetOptions):
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

    def responses(self) -> int:
        return PRISM_OPENING_RESPONSES

    def hub_parts(self) -> tuple[dict[str, str], ...]:
        return ({"name": "survey"}, {"name": "conversations"})  # the participants, then their conversations


class SyntheticOptions(DatasetOptions):
    """moplex_core.data.synthetic.SyntheticConfig without its augmentation fields: the rankings
    artifact holds originals only (generated responses are the augment stage's); the seed is the
    ingest config's. The upper bounds keep a mistyped size from a traceback or a machine's whole
    memory: the rankings are generated in memory."""

    n: int = Field(2000, ge=1, le=10_000_000)
    k: int = Field(3, ge=1, le=1000)
    m: int = Field(4, ge=2, le=1000)
    n_values: int = Field(10, ge=1, le=1_000_000)
    noise: float = Field(1.0, ge=0.0)
    alpha: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _alpha_is_a_distribution(self) -> SyntheticOptions:
        if self.alpha is not None and (
            len(self.alpha) != self.k or any(a < 0 for a in self.alpha) or abs(sum(self.alpha) - 1) > 1e-6
        ):
            raise ValueError(f"alpha must be {self.k} non-negative proportions summing to 1, got {self.alpha}")
        if self.n * self.m * self.k > 100_000_000:  # generated as one integer array of that many values
            raise ValueError(f"n x m x k = {self.n} x {self.m} x {self.k} values is more than these rankings are "
                             "generated in (10^8, in memory at once); lower synthetic.n, synthetic.m or synthetic.k")
        return self

    def labels(self) -> tuple[str, ...]:
        return tuple(f"c{c}" for c in range(self.k))

    def responses(self) -> int:
        return self.m


class IngestConfig(StageConfig):
    """Which dataset to read, from where, and how to turn it into `rankings` (DESIGN.md 3, 6).

    The data comes from ``path`` (a local file or folder in the dataset's raw schema) when given,
    else from the hub (``hub_name``, default the dataset's, at ``revision``, default the pinned one).
    ``labels`` declares the cluster label set (default: UltraFeedback's criteria, HelpSteer2's
    attributes for its ratings, c0..c{k-1} for synthetic; none for persona, prism, HelpSteer2's
    preference data and generic). ``validation="drop"`` writes the valid rows and records the others in
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

    def options(self) -> DatasetOptions | None:
        """The block of the dataset read (``self.<dataset>``); None for generic, which has none."""
        return getattr(self, self.dataset) if self.dataset in DATASET_BLOCKS else None

    def default_labels(self) -> tuple[str, ...] | None:
        """The declared cluster label set: ``labels``, else the dataset's (`DatasetOptions.labels`)."""
        options = self.options()
        return self.labels if self.labels is not None else options.labels() if options else None

    def hub_parts(self) -> tuple[dict[str, str], ...]:
        """The `datasets.load_dataset` keyword arguments of each part this config reads from the hub:
        PRISM's two configs, HelpSteer2's ``preference`` data_dir, else the default config."""
        options = self.options()
        return options.hub_parts() if options else ({},)

    def identity(self) -> dict[str, Any]:
        """Everything that changes the rankings except where a local file lives: its content is hashed
        separately (as the version's input), so moving a file keeps the version and editing it does
        not. Options of other datasets are left out, and the dataset's own are its block's identity; with
        ``split.from_source`` the seed and the split fractions, which then assign nothing, are left out."""
        data = self.model_dump(mode="json", exclude={"path", *(set(DATASET_BLOCKS) - {self.dataset})})
        if self.split.from_source:
            del data["seed"], data["split"]["fractions"]
        options = self.options()
        if options is not None:
            data[self.dataset] = options.identity()
        if self.path is None and self.dataset in HUB_SOURCES:
            data["hub_name"], data["revision"] = self.hub_source()
        return data


DATASET_BLOCKS = tuple(name for name, field in IngestConfig.model_fields.items()
                       if isinstance(field.annotation, type) and issubclass(field.annotation, DatasetOptions))
"""The datasets with a block of their own settings (every one but generic), in field order."""


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
        meant = difflib.get_close_matches(name, INGEST_PRESETS, n=1)
        raise ValueError(f"unknown ingest preset {name!r}; " + (f"did you mean {meant[0]}? " if meant else "")
                         + f"choose one of {', '.join(INGEST_PRESETS)} (`moplex run --list` names the pipeline "
                         "presets, which are not ingest presets)") from None
