"""Stage configs: strict, frozen, and hashed only on what changes a stage's output."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from moplex_core.config import (
    INGEST_PRESETS,
    AugmentConfig,
    CacheConfig,
    EvaluateConfig,
    IngestConfig,
    TrainConfig,
    as_assignments,
    ingest_preset,
    pipeline_preset,
    with_overrides,
)
from moplex_core.hashing import canonical_json, short_hash


def fingerprint(config) -> str:
    """What a stage config contributes to its artifact version: the hash of its identity."""
    return short_hash(canonical_json(config.identity()))


def test_unknown_keys_and_impossible_values_are_errors():
    with pytest.raises(ValidationError, match="extra_forbidden"):
        IngestConfig(dataset="ultrafeedback", min_distinct=2)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        IngestConfig(dataset="ultrafeedback", ultrafeedback={"min_distinct": 2})
    impossible = [
        {"dataset": "imdb"},
        {"dataset": "ultrafeedback", "split": {"fractions": [0.8, 0.3, 0.1]}},
        {"dataset": "ultrafeedback", "split": {"sizes": [0, 0, 0]}},
        {"dataset": "ultrafeedback", "ultrafeedback": {"criteria": ["helpfulness", "fun"]}},
        {"dataset": "ultrafeedback", "ultrafeedback": {"m": 1}},
        {"dataset": "helpsteer2", "helpsteer2": {"min_gap": 5}},
        {"dataset": "persona", "persona": {"age_bands": [45, 18]}},
        {"dataset": "synthetic", "synthetic": {"k": 2, "alpha": [0.5, 0.6]}},
        {"dataset": "generic"},  # needs a path
        {"dataset": "synthetic", "path": "x.jsonl"},
        {"dataset": "persona", "path": "x.jsonl", "revision": "abc"},
        {"dataset": "persona", "split": {"from_source": True}},
        {"dataset": "ultrafeedback", "labels": ["a", "a"]},
    ]
    for data in impossible:
        with pytest.raises(ValidationError):
            IngestConfig.model_validate(data)


def test_configs_are_frozen_and_fingerprints_are_stable():
    config = IngestConfig(dataset="ultrafeedback")
    with pytest.raises(ValidationError):
        config.seed = 1
    assert fingerprint(config) == fingerprint(IngestConfig.model_validate_json(config.model_dump_json()))
    assert fingerprint(config) != fingerprint(IngestConfig(dataset="ultrafeedback", seed=1))
    assert canonical_json(config.identity()).startswith('{"dataset":"ultrafeedback"')


def test_identity_leaves_out_where_a_file_lives_and_other_datasets_options():
    here = IngestConfig(dataset="helpsteer2", path="/data/a/train.jsonl")
    there = IngestConfig(dataset="helpsteer2", path="/mnt/b/train.jsonl", persona={"top_profiles": 3})
    assert here.identity() == there.identity()
    assert "path" not in here.identity() and "persona" not in here.identity() and "helpsteer2" in here.identity()
    assert here.identity() != IngestConfig(dataset="helpsteer2", path="x", helpsteer2={"min_gap": 2}).identity()
    hub = IngestConfig(dataset="ultrafeedback").identity()
    assert (hub["hub_name"], hub["revision"]) == ("openbmb/UltraFeedback", "40b436560ca83a8dba36114c22ab3c66e43f6d5e")


def test_a_source_whose_splits_are_kept_is_versioned_without_the_seed_and_fractions_that_assign_none():
    kept = IngestConfig(dataset="generic", path="x.jsonl", split={"from_source": True})
    assert kept.identity() == IngestConfig(dataset="generic", path="x.jsonl", seed=1,
                                           split={"from_source": True, "fractions": (0.5, 0.5, 0.0)}).identity()
    assert kept.identity() != IngestConfig(dataset="generic", path="x.jsonl").identity()
    assigned = IngestConfig(dataset="generic", path="x.jsonl")
    assert assigned.identity() != IngestConfig(dataset="generic", path="x.jsonl", seed=1).identity()


# (a stage's config, another valid value of each setting, the settings its docstring leaves out of the version)
VERSIONED = {
    "cache": (CacheConfig(model="some/hub-model"),
              {"use_chat_template": False, "max_prompt_tokens": 7, "max_response_tokens": 9, "shard_rows": 3,
               "dtype": "float64", "contractions": False, "score_batch_size": 5, "device": "cpu", "chunk_size": 8,
               "share_prompts": False, "gradient_checkpointing": True},
              {"score_batch_size", "device", "chunk_size", "share_prompts", "gradient_checkpointing"}),
    "augment": (AugmentConfig(model="some/hub-model"),
                {"n_generated": 5, "temperature": 1.0, "top_p": 0.5, "max_new_tokens": 7, "seed": 3, "max_attempts": 2,
                 "shard_prompts": 3, "dtype": "float32", "use_chat_template": False, "max_prompt_tokens": 9,
                 "batch_size": 2, "device": "cpu", "on_shortfall": "keep_fewer", "vllm_gpu_memory_utilization": 0.5, "vllm_timeout_s": 60.0,
                 "vllm_max_model_len": 4096},
                {"batch_size", "device", "on_shortfall", "vllm_gpu_memory_utilization", "vllm_timeout_s",
                 "vllm_max_model_len"}),  # the backend here is hf: vLLM's setting changes nothing
    "train": (TrainConfig(),
              {"k": 2, "beta": 0.2, "anchors": 3, "estimation": "logpi", "likelihood": "bt_pairs", "hard": True,
               "lora_r": 4, "lora_alpha": 8.0, "lora_targets": ("q_proj",), "lr": 1e-3, "epochs": 2, "first_epochs": 3,
               "batch_size": 4, "gamma_min": 0.0, "em_iterations": 3, "tol": 0.1, "init": "kmeans", "restarts": 2,
               "estimation_check": 0, "seed": 1, "dtype": "float64", "share_prompts": False,
               "score_batch_size": 5, "device": "cpu", "chunk_size": 9, "anchor_weighting": "nearest",
               "anchor_draw": "by_length", "mixing": "uniform",
               "lora_dropout": 0.1, "backtracks": 1, "exact_fallback": 0.5, "gradient_checkpointing": True},
              {"score_batch_size", "device", "chunk_size", "gradient_checkpointing"}),
    "evaluate": (EvaluateConfig(),
                 {"splits": ("validation", "train"), "method": "x", "device": "cpu", "score_batch_size": 3},
                 {"device", "score_batch_size"}),
    "ingest": (IngestConfig(dataset="synthetic"),
               {"seed": 2, "validation": "drop", "labels": ("a", "b", "c"), "shard_rows": 5}, set()),
}


# Settings VERSIONED does not vary, each checked where it is said
VERSIONED_ELSEWHERE = {
    "cache": {"model"},  # its files' fingerprint is the version's input (test_cache_stage)
    "augment": {"model", "backend", "vllm_python"},  # the model's fingerprint (test_augment_stage); a backend needs its own settings
    "train": set(),
    "evaluate": {"fit_split"},  # below
    "ingest": {"dataset", "path", "hub_name", "revision", "split", "synthetic", "ultrafeedback", "persona", "helpsteer2",
               "prism"},  # above (test_identity_leaves_out_...) and in test_ingest_build
}


@pytest.mark.parametrize("stage", VERSIONED)
def test_every_setting_is_varied_or_said_to_be_checked_elsewhere(stage):
    config, changes, _ = VERSIONED[stage]
    unchecked = set(type(config).model_fields) - set(changes) - VERSIONED_ELSEWHERE[stage]
    assert not unchecked, (f"{stage} settings {sorted(unchecked)} are in no version check: add another valid value of "
                           "each to VERSIONED (and to its left-out set if the stage's identity() leaves it out)")


@pytest.mark.parametrize("stage", VERSIONED)
def test_every_setting_not_left_out_of_the_version_changes_it(stage):
    # A setting missing from the identity would let a changed run reuse another setting's artifact.
    config, changes, left_out = VERSIONED[stage]
    for setting, value in changes.items():
        changed = type(config).model_validate({**config.model_dump(), setting: value}).identity() != config.identity()
        assert changed == (setting not in left_out), f"{stage}.{setting}"
    moved = EvaluateConfig(splits=("validation", "test"), fit_split="test")  # the matching fitted on another split
    assert moved.identity() != EvaluateConfig(splits=("validation", "test")).identity()


def test_vllms_max_model_len_is_versioned_where_vllm_generates():
    # vLLM ends a generation that reaches max_model_len: another value can cut other texts short
    vllm = AugmentConfig(model="some/hub-model", backend="vllm", vllm_python="/opt/vllm-env/bin/python")
    assert "vllm_max_model_len" not in vllm.identity()  # unset: every version made before the setting keeps its name
    assert vllm.identity() != AugmentConfig(**{**vllm.model_dump(), "vllm_max_model_len": 4096}).identity()


@pytest.mark.parametrize(("given", "as_if"), [
    ({"anchors": None, "estimation": "logpi", "estimation_check": 0}, {"anchors": None}),  # nothing estimated
    ({"lora_targets": ("v_proj", "q_proj", "q_proj")}, {"lora_targets": ("q_proj", "v_proj")}),  # a set
    ({"lora_targets": tuple(reversed(TrainConfig().lora_targets))}, {}),
    ({"epochs": 2, "first_epochs": 2}, {"epochs": 2}),
    ({"hard": True, "gamma_min": 0.5}, {"hard": True}),  # responsibilities of 0 or 1
])
def test_train_settings_that_change_nothing_keep_the_version(given, as_if):
    assert TrainConfig(**given).identity() == TrainConfig(**as_if).identity()


@pytest.mark.parametrize(("given", "other"), [
    ({"estimation": "logpi"}, {}),  # anchors: estimated
    ({"hard": True, "gamma_min": 0.0}, {"hard": True}),  # 0 keeps the pairs of responsibility 0
    ({"epochs": 2, "first_epochs": 1}, {"epochs": 2}),
])
def test_train_settings_that_change_the_fit_change_the_version(given, other):
    assert TrainConfig(**given).identity() != TrainConfig(**other).identity()


def test_a_value_holding_an_equals_sign_is_kept_whole(tmp_path):
    folder = tmp_path / "run=1"  # a hive-style folder
    assert with_overrides(EvaluateConfig(), ["method=a=b"]).method == "a=b"
    assert with_overrides(IngestConfig(dataset="generic", path=str(tmp_path)), [f"path={folder}"]).path == str(folder)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: AugmentConfig(backend="borrow", model="m"), "backend 'borrow' takes other rankings' responses and uses "
                                                         "no model; unset model"),
    (lambda: EvaluateConfig(splits=("test", "test")), r"splits must be distinct split names, got \('test', 'test'\)"),
    (lambda: EvaluateConfig(splits=()), r"splits must be distinct split names, got \(\)"),
    (lambda: IngestConfig(dataset="persona", persona={"fields": ["age", " "]}),
     "fields must be distinct, non-empty persona keys"),
    (lambda: IngestConfig(dataset="helpsteer2", helpsteer2={"attributes": ["helpfulness", "humour"]}),
     "attributes must be distinct names from"),
    (lambda: IngestConfig(dataset="helpsteer2", helpsteer2={"attributes": ["verbosity", "verbosity"]}),
     "attributes must be distinct names from"),
    (lambda: IngestConfig(dataset="prism", prism={"fields": ["location."]}),
     "fields must be distinct survey columns or column.key paths"),
    (lambda: IngestConfig(dataset="generic", path="x.jsonl", split={"from_source": True, "sizes": [1, 1, 1]}),
     "split.sizes and split.from_source exclude each other"),
    (lambda: IngestConfig(dataset="synthetic", split={"sizes": [10, 10, 10], "fractions": [1, 0, 0]}),
     r"split.sizes \[10, 10, 10\] and split.fractions \[1.0, 0.0, 0.0\] exclude each other: .* or "
     r"split.fractions=\[0.8, 0.1, 0.1\] \(the default\) to deal by sizes"),
    (lambda: TrainConfig(lora_targets=()), r"lora_targets must name at least one module \(e.g. q_proj\), got \(\)"),
    (lambda: TrainConfig(lora_targets=("q_proj", "")), "lora_targets must name at least one module"),
])
def test_each_setting_that_cannot_work_is_refused_naming_it(make, message):
    with pytest.raises(ValidationError, match=message):
        make()


def test_split_sizes_keep_the_default_fractions_every_manifest_records():
    sized = IngestConfig(dataset="synthetic", split={"sizes": [10, 10, 10]})
    assert IngestConfig.model_validate(sized.model_dump()).split == sized.split  # read back from a manifest
    assert IngestConfig(dataset="synthetic", split={"sizes": [10, 10, 10], "fractions": [0.8000000000000001, 0.1, 0.1]})


def test_hub_source_defaults_and_overrides():
    assert IngestConfig(dataset="persona").hub_source() == ("SynthLabsAI/PERSONA", None)
    assert IngestConfig(dataset="ultrafeedback", revision="main").hub_source() == ("openbmb/UltraFeedback", "main")
    assert IngestConfig(dataset="ultrafeedback", hub_name="me/uf-copy").hub_source() == ("me/uf-copy", None)
    with pytest.raises(ValueError, match="dataset 'generic' has no hub source"):
        IngestConfig(dataset="generic", path="x.jsonl").hub_source()


def test_overrides_reach_nested_blocks_and_name_bad_keys():
    config = with_overrides(IngestConfig(dataset="ultrafeedback"), [
        "ultrafeedback.min_distinct_rankings=3", "split.fractions=[0.6, 0.2, 0.2]", "seed=7", "revision=main",
    ])
    assert config.ultrafeedback.min_distinct_rankings == 3 and config.split.fractions == (0.6, 0.2, 0.2)
    assert config.seed == 7 and config.revision == "main"
    with pytest.raises(ValueError, match="ultrafeedback.nope"):
        with_overrides(config, ["ultrafeedback.nope=1"])
    with pytest.raises(ValueError, match=r"'seed': expected key=value \(e.g. seed=...\)"):
        with_overrides(config, ["seed"])  # a known key: the example is that key
    with pytest.raises(ValueError, match="'ingest' is not a block of IngestConfig; did you mean seed"):
        with_overrides(config, ["ingest.seed=3"])  # `moplex run`'s spelling given to `moplex ingest`
    with pytest.raises(ValueError, match="'seed' is not a block of IngestConfig$"):
        with_overrides(config, ["seed.x=1"])  # a setting of its own, not the config's name: no did-you-mean
    with pytest.raises(ValueError) as every:  # one error names every bad assignment, the example is real
        with_overrides(config, ["seed.x=1", "split.nope=2", "seed=abc", "fraction"])
    lines = str(every.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["seed.x", "'fraction'", "seed", "split.nope"]
    block, key = lines[1].split("e.g. ")[1].removesuffix("=...)").split(".")
    value = config.model_dump(mode="json")[block][key]
    assert with_overrides(config, [f"{block}.{key}={json.dumps(value)}"]) == config
    with pytest.raises(ValueError) as listed:  # a list written as comma-separated text: its JSON, to copy
        with_overrides(config, ["ultrafeedback.criteria=helpfulness, honesty"])
    assert """ultrafeedback.criteria='["helpfulness", "honesty"]'""" in str(listed.value)
    assert with_overrides(config, ['ultrafeedback.criteria=["helpfulness", "honesty"]']).ultrafeedback.criteria == (
        "helpfulness", "honesty")


def test_presets_are_valid_configs_with_the_paper_split_sizes():
    assert ingest_preset("ultrafeedback-paper").split.sizes == (3612, 448, 452)
    assert ingest_preset("persona-paper").split.sizes == (1905, 237, 258)
    assert ingest_preset("persona-paper").persona.top_profiles == 12
    assert all(isinstance(c, IngestConfig) for c in INGEST_PRESETS.values())
    with pytest.raises(ValueError, match="unknown ingest preset 'x'; choose one of ultrafeedback-paper"):
        ingest_preset("x")


def test_a_boolean_given_to_a_number_is_refused_not_read_as_one():
    with pytest.raises(ValueError) as refused:
        with_overrides(pipeline_preset("synthetic-demo"), ["train.k=true", "train.lr=false", "train.anchors=true"])
    assert str(refused.value).splitlines()[1:] == [
        "  train.k: expected an integer, not a boolean (got true)",
        "  train.lr: expected a number, not a boolean (got false)",
        "  train.anchors: expected an integer or null, not a boolean (got true)"]
    assert with_overrides(pipeline_preset("synthetic-demo"), ["train.share_prompts=false"]).train.share_prompts is False
    assert with_overrides(pipeline_preset("synthetic-demo"), ["train.share_prompts=auto"]).train.share_prompts == "auto"
    with pytest.raises(ValueError, match=r"ingest.split.fractions: Input should be a valid tuple \(got True\)"):
        with_overrides(pipeline_preset("synthetic-demo"), ["ingest.split.fractions=true"])  # a list, not a number


def test_a_block_given_whole_says_which_preset_settings_it_resets(caplog):
    with caplog.at_level(logging.WARNING, logger="moplex_core.config"):
        config = with_overrides(pipeline_preset("synthetic-demo"), ['train={"k": 2, "beta": 1.0}'])
    assert config.train.k == 2 and config.train.lr == TrainConfig().lr
    assert ("train={...} replaces the whole block, so its other settings are back at their defaults: anchors null -> "
            "2, lora_r 8 -> 16, lr 0.003 -> 0.0001") in caplog.text and "beta" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moplex_core.config"):
        with_overrides(pipeline_preset("synthetic-demo"), ['train={"k": 2}', "train.lr=0.1"])
    assert "lora_r 8 -> 16" in caplog.text and "lr" not in caplog.text.replace("lora_r", "")  # typed on its own
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moplex_core.config"):
        config = with_overrides(pipeline_preset("synthetic-demo"), ["train.lr=0.123", 'train={"k": 2}'])
    assert config.train.lr == TrainConfig().lr and "lr 0.123 -> 0.0001" in caplog.text  # typed before: replaced too
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moplex_core.config"):
        with_overrides(pipeline_preset("synthetic-demo"), ["train.k=2"])
    assert caplog.text == ""


def test_existing_datasets_keep_their_ingest_versions_as_options_are_added():
    # the default configs' fingerprints before PRISM and HelpSteer2's preference data (6699fdc); HelpSteer2's
    # changed once, when its hub revision was pinned (2026-11-25: another source, so another version)
    pinned = {"ultrafeedback": "4c24b0514f8486e0", "persona": "fa809a5475b4e53d", "helpsteer2": "cd05b9ddba4a54f4",
              "generic": "dc59e397a60b926c", "synthetic": "fd0f62a6f9f5848b"}
    for dataset, pinned_fingerprint in pinned.items():
        config = IngestConfig(dataset=dataset, **({"path": "x.jsonl"} if dataset == "generic" else {}))
        assert fingerprint(config) == pinned_fingerprint, dataset
    assert IngestConfig(dataset="helpsteer2", helpsteer2={"split_turns": False}).identity()["helpsteer2"][
        "split_turns"] is False
    preference = IngestConfig(dataset="helpsteer2", helpsteer2={"data": "preference"})
    assert set(preference.identity()["helpsteer2"]) == {"data", "min_strength"}
    assert fingerprint(preference) != fingerprint(IngestConfig(dataset="helpsteer2", helpsteer2={"data": "preference",
                                                                                      "min_strength": 2}))


def test_assignments_of_checked_settings_give_them_back_from_any_directory(tmp_path, monkeypatch):
    """What `moplex run` hands its flow run: a retry in another working directory runs the same settings."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "r.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    typed = ["ingest.dataset=generic", "ingest.path=data/r.jsonl", "root=out", "augment=null", "cache.model=2024",
             "ingest.revision=null", "train.k=4", "ingest.labels=[\"a\", \"b\"]"]
    config = with_overrides(pipeline_preset("synthetic-demo"), typed)
    assert config.ingest.path == str(tmp_path / "data" / "r.jsonl") and config.cache.model == "2024"
    again = as_assignments(config, [a.partition("=")[0] for a in typed])
    assert "ingest.path=" + str(tmp_path / "data" / "r.jsonl") in again and "cache.model=\"2024\"" in again
    monkeypatch.chdir("/")
    assert with_overrides(pipeline_preset("synthetic-demo"), again) == config
    # a block set whole after (or before) one of its keys: the block's assignment carries them
    for typed in (["augment.n_generated=4", "augment=null"], ['train={"k": 2}', "train.lr=0.01"]):
        config = with_overrides(pipeline_preset("synthetic-demo"), typed)
        again = as_assignments(config, [a.partition("=")[0] for a in typed])
        assert len(again) == 1 and with_overrides(pipeline_preset("synthetic-demo"), again) == config


def test_each_dataset_declares_the_labels_its_docstring_names():
    assert IngestConfig(dataset="ultrafeedback").default_labels() == ("helpfulness", "honesty",
                                                                       "instruction_following", "truthfulness")
    assert IngestConfig(dataset="helpsteer2").default_labels() == ("helpfulness", "correctness", "coherence",
                                                                    "complexity", "verbosity")
    assert IngestConfig(dataset="helpsteer2", helpsteer2={"data": "preference"}).default_labels() is None
    assert IngestConfig(dataset="synthetic", synthetic={"k": 2}).default_labels() == ("c0", "c1")
    assert [IngestConfig(dataset=d, path="x.jsonl").default_labels() for d in ("persona", "prism", "generic")] == [None] * 3
    assert IngestConfig(dataset="persona", labels=("a", "b")).default_labels() == ("a", "b")
