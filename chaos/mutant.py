"""A mutant of the catalogue (`chaos.mutant_catalogue`): one realistic bug as one replacement in one
source file, and per source file the test modules that must catch its bugs (run in this order; the
first to fail kills the mutant)."""

from __future__ import annotations

from dataclasses import dataclass

TESTS: dict[str, tuple[str, ...]] = {  # source file -> test modules under tests/ (no .py)
    'moplex_core/artifacts/layout.py': (
        'test_artifacts', 'test_ingest_build', 'test_train_stage', 'test_cache_stage', 'test_inspect',
        'test_concurrency', 'test_chaos',
    ),
    'moplex_core/artifacts/writer.py': (
        'test_artifacts', 'test_inspect', 'test_cache_stage', 'test_concurrency', 'test_chaos',
        'test_train_stage',
    ),
    'moplex_core/artifacts/store.py': ('test_artifacts', 'test_inspect', 'test_long_lived_root'),
    'moplex_core/assign.py': ('test_assign', 'test_long_lived_root'),
    'moplex_core/augment.py': ('test_augment_stage', 'test_generate', 'test_chaos', 'test_pipeline_config'),
    'moplex_core/cache.py': (
        'test_cache_stage', 'test_augment_stage', 'test_train_stage', 'test_approximation',
        'test_evaluate_stage', 'test_chaos', 'test_pipeline_config',
    ),
    'moplex_core/config/augment.py': ('test_config', 'test_augment_stage', 'test_pipeline_config'),
    'moplex_core/config/base.py': ('test_config', 'test_train_stage', 'test_cache_stage', 'test_pipeline_config'),
    'moplex_core/config/cache.py': ('test_config', 'test_cache_stage', 'test_pipeline_config'),
    'moplex_core/config/evaluate.py': ('test_config', 'test_pipeline_config', 'test_evaluate_stage'),
    'moplex_core/config/ingest.py': (
        'test_config', 'test_ingest_build', 'test_ingest_flow', 'test_pipeline_config',
        'test_ingest_adapters',
    ),
    'moplex_core/config/overrides.py': ('test_config', 'test_pipeline_config'),
    'moplex_core/config/train.py': ('test_config', 'test_train_stage', 'test_pipeline_config'),
    'moplex_core/data/generic.py': ('test_ingest_build', 'test_bad_inputs', 'test_ingest_adapters'),
    'moplex_core/data/helpsteer2.py': ('test_ingest_adapters', 'test_ingest_build', 'test_bad_inputs'),
    'moplex_core/data/persona.py': ('test_ingest_adapters', 'test_ingest_build', 'test_bad_inputs'),
    'moplex_core/data/prism.py': ('test_ingest_adapters', 'test_ingest_build', 'test_bad_inputs'),
    'moplex_core/data/sources.py': (
        'test_ingest_build', 'test_ingest_flow', 'test_ingest_adapters', 'test_bad_inputs',
    ),
    'moplex_core/data/splits.py': (
        'test_ingest_build', 'test_schema', 'test_ingest_adapters', 'test_pipeline_config',
    ),
    'moplex_core/data/synthetic.py': (
        'test_ingest_build', 'test_em', 'test_em_falls', 'test_em_inputs', 'test_approximation', 'test_evaluate',
        'test_identifiability',
    ),
    'moplex_core/data/ultrafeedback.py': ('test_ingest_adapters', 'test_ingest_build', 'test_bad_inputs'),
    'moplex_core/em/fit.py': (
        'test_em', 'test_em_falls', 'test_em_inputs', 'test_numerics', 'test_assign', 'test_train_stage',
        'test_lora_policy',
    ),
    'moplex_core/display.py': ('test_evaluate', 'test_inspect', 'test_evaluate_stage', 'test_compare'),
    'moplex_core/em/checkpoints.py': ('test_em', 'test_em_falls', 'test_lora_policy', 'test_train_stage'),
    'moplex_core/em/start.py': (
        'test_em', 'test_em_falls', 'test_numerics', 'test_assign', 'test_train_stage', 'test_lora_policy',
    ),
    'moplex_core/estimate.py': ('test_estimate', 'test_approximation', 'test_lora_policy', 'test_em', 'test_em_falls'),
    'moplex_core/evaluate.py': ('test_evaluate', 'test_metrics', 'test_evaluate_stage'),
    'moplex_core/experiments/compare.py': ('test_compare',),
    'moplex_core/methods.py': ('test_compare',),
    'moplex_core/generate/hf.py': ('test_generate', 'test_augment_stage'),
    'moplex_core/hashing.py': ('test_artifacts', 'test_lm_loading', 'test_cache_stage'),
    'moplex_core/inspect.py': ('test_inspect', 'test_evaluate_stage', 'test_ingest_flow', 'test_long_lived_root'),
    'moplex_core/cli.py': ('test_inspect', 'test_pipeline_config'),
    'moplex_core/ingest.py': (
        'test_ingest_build', 'test_bad_inputs', 'test_ingest_adapters', 'test_ingest_flow', 'test_config',
    ),
    'moplex_core/lm/checkpointing.py': ('test_checkpointing', 'test_lora_policy', 'test_cache_stage'),
    'moplex_core/lm/checks.py': ('test_model_checks', 'test_generate'),
    'moplex_core/lm/device.py': (
        'test_device', 'test_lora_policy', 'test_lm_logprobs', 'test_estimate', 'test_em', 'test_em_falls',
    ),
    'moplex_core/lm/lean.py': ('test_lean', 'test_estimate', 'test_lm_logprobs'),
    'moplex_core/lm/loading.py': ('test_lm_loading', 'test_generate', 'test_pipeline_config'),
    'moplex_core/lm/logprobs.py': (
        'test_lm_logprobs', 'test_estimate', 'test_lm_tiny', 'test_approximation', 'test_lora_policy',
        'test_checkpointing',
    ),
    'moplex_core/lm/multi_lora.py': (
        'test_multi_lora', 'test_lean', 'test_model_checks', 'test_estimate', 'test_lora_policy', 'test_checkpointing',
    ),
    'moplex_core/lm/routed_adam.py': ('test_routed_adam', 'test_multi_lora', 'test_lora_policy'),
    'moplex_core/lm/tokenize.py': (
        'test_lm_logprobs', 'test_estimate', 'test_lm_tiny', 'test_approximation', 'test_lora_policy',
        'test_lm_tokenize', 'test_cache_stage', 'test_generate', 'test_augment_stage',
    ),
    'moplex_core/metrics.py': ('test_evaluate', 'test_metrics', 'test_evaluate_stage'),
    'moplex_core/pipeline.py': ('test_pipeline_config',),
    'moplex_core/pl.py': (
        'test_pl', 'test_em', 'test_em_falls', 'test_em_inputs', 'test_numerics', 'test_metrics', 'test_bad_inputs',
        'test_evaluate', 'test_lora_policy',
    ),
    'moplex_core/processes.py': ('test_pipeline_run',),
    'moplex_core/report.py': ('test_evaluate', 'test_evaluate_stage'),
    'moplex_core/schema.py': ('test_schema', 'test_ingest_build', 'test_bad_inputs', 'test_ingest_adapters'),
    'moplex_core/scorers/item.py': ('test_em_inputs', 'test_em', 'test_em_falls', 'test_numerics'),
    'moplex_core/scorers/lora_policy.py': ('test_lora_policy', 'test_em', 'test_em_falls', 'test_train_stage'),
    'moplex_core/train.py': ('test_train_stage', 'test_evaluate_stage', 'test_pipeline_config'),
    'flows/pipeline.py': ('test_pipeline_run',),
}


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    what: str  # the bug, in words
    old: str  # an exact piece of ``file``, present once
    new: str  # what it becomes

    @property
    def tests(self) -> tuple[str, ...]:
        return TESTS[self.file]
