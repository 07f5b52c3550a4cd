"""Configs of every stage, validated at construction, printable, and hashable into artifact versions.

Every config is a frozen pydantic model that refuses unknown keys. `StageConfig.identity` is the part
of a config that determines the stage's output (what the artifact version hashes); `fingerprint` is
its short hash. One module per stage (ingest, augment, cache, train, tiny_model, evaluate), the whole
run and its presets in `pipeline`, what they share in `base`, and ``key=value`` overrides in
`overrides`; every public name is importable from here.
"""

from moplex_core.config.augment import VLLM_MAX_TEMPERATURE, AugmentConfig, GeneratorBackend
from moplex_core.config.base import (
    TINY_MODEL,
    Device,
    Options,
    SharePrompts,
    StageConfig,
    absolute_path,
    local_model_absolute,
    prompts_shared,
    refuse_the_pipelines_model,
)
from moplex_core.config.cache import CacheConfig, ModelDtype, no_contractions_message
from moplex_core.config.evaluate import EvaluateConfig
from moplex_core.config.ingest import (
    HELPSTEER2_ATTRIBUTES,
    HUB_SOURCES,
    INGEST_PRESETS,
    PRISM_OPENING_RESPONSES,
    ULTRAFEEDBACK_CRITERIA,
    DatasetName,
    HelpSteer2Options,
    IngestConfig,
    PersonaOptions,
    PrismOptions,
    SplitConfig,
    SyntheticOptions,
    UltraFeedbackOptions,
    ingest_preset,
)
from moplex_core.config.overrides import as_assignments, describe_validation_error, with_overrides
from moplex_core.config.pipeline import (
    PRESETS_DIR,
    FaultConfig,
    PipelineConfig,
    PipelineStage,
    pipeline_preset,
    preset_description,
    preset_names,
)
from moplex_core.config.tiny_model import TinyModelConfig
from moplex_core.config.train import TrainConfig

__all__ = [
    "HELPSTEER2_ATTRIBUTES", "HUB_SOURCES", "INGEST_PRESETS", "PRESETS_DIR", "PRISM_OPENING_RESPONSES", "TINY_MODEL",
    "ULTRAFEEDBACK_CRITERIA", "VLLM_MAX_TEMPERATURE", "AugmentConfig", "CacheConfig", "DatasetName", "Device",
    "EvaluateConfig", "FaultConfig", "GeneratorBackend", "HelpSteer2Options", "IngestConfig", "ModelDtype", "Options",
    "PersonaOptions", "PipelineConfig", "PipelineStage", "PrismOptions", "SharePrompts", "SplitConfig", "StageConfig",
    "SyntheticOptions", "TinyModelConfig", "TrainConfig", "UltraFeedbackOptions", "absolute_path", "as_assignments",
    "describe_validation_error", "ingest_preset", "local_model_absolute", "no_contractions_message",
    "pipeline_preset", "preset_description", "preset_names", "prompts_shared", "refuse_the_pipelines_model",
    "with_overrides",
]
