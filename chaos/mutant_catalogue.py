"""The mutant catalogue `chaos.mutants` runs: realistic bugs, each one replacement in one source file,
and the test modules that must catch the bugs of each file (run in this order; the first to fail
kills the mutant).

Gathered by three rounds of mutation testing (2026-11-25) over the math (pl, em, estimate, logprobs,
multi_lora, routed_adam, evaluate, metrics), the pipeline's bookkeeping (artifacts, schema, ingest,
splits, augment, cache, train, assign, config) and the adapters, tokenizer, loading and generation;
every mutant a round found surviving got a test. The whole catalogue, run end to end on 2026-11-25
(185 mutants then): every one killed, 42 minutes of mutant runs on 2 cores; the ones added since were each run
when added and killed. Add one when a bug slips past the tests, to `chaos.mutants_math` or
`chaos.mutants_pipeline` by its file (and its file's test modules to `chaos.mutant.TESTS`): its
``old`` must occur exactly once in its file (tests/test_mutant_catalogue.py)."""

from __future__ import annotations

from chaos.mutant import TESTS, Mutant
from chaos.mutants_math import MATH_MUTANTS
from chaos.mutants_pipeline import PIPELINE_MUTANTS

MUTANTS: list[Mutant] = [*MATH_MUTANTS, *PIPELINE_MUTANTS]

__all__ = ["MUTANTS", "TESTS", "Mutant"]
