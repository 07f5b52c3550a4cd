"""The pipeline's stages in order, whatever runs each one (DESIGN 1, 4).

`run_stages` is the one place that says which stages a `PipelineConfig` runs, in which order, and
what each reads: ingest -> (tiny model) -> augment -> cache -> train -> evaluate. The Prefect flow
(`flows.pipeline.moplex_pipeline`) hands it a stage that runs each stage's subflow, with retries;
`in_this_process` is the stage functions themselves, called directly (no Prefect:
`benchmarks/pipeline_stages.py`, on a machine without it). Either way a stage whose version is
complete is found, not rebuilt, and the artifacts are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moplex_core.artifacts import ArtifactCorruptError, ArtifactStore, root_of
from moplex_core.augment import run_augment
from moplex_core.cache import plan_cache, run_cache
from moplex_core.config import TINY_MODEL, CacheConfig, PipelineConfig
from moplex_core.evaluate import run_evaluate
from moplex_core.ingest import check_rankings_fit, run_ingest
from moplex_core.lm.checks import check_model
from moplex_core.lm.loading import resolve_device
from moplex_core.tiny_model import MODEL_DIR, run_tiny_model
from moplex_core.train import run_train

Stage = Callable[..., str]
"""stage(name, the stage's config, *its input artifact folders, [model=the base model where it is now]) -> its
artifact folder."""

log = logging.getLogger(__name__)


def run_stages(config: PipelineConfig, stage: Stage) -> dict[str, str]:
    """Run every stage of ``config`` through ``stage``; returns each stage's artifact folder by name
    (``model``, the tiny model's, and ``augment`` only where the config has them)."""
    _check_devices(config)
    dirs = {"ingest": stage("ingest", config.ingest)}
    check_rankings_fit(dirs["ingest"], k=config.train.k, splits=config.evaluate.splits,  # before any model work
                       labelled=config.train.init == "labels")
    _warn_of_another_generator(config)
    augment, cache = config.augment, config.cache
    if config.uses_tiny_model():
        dirs["model"] = stage("model", config.tiny_model, dirs["ingest"])
        tiny = {"model": str(Path(dirs["model"]) / MODEL_DIR)}
        cache = cache.model_copy(update=tiny) if cache.model == TINY_MODEL else cache
        augment = augment.model_copy(update=tiny) if augment and augment.model == TINY_MODEL else augment
    check_model(cache.model, lora_targets=config.train.lora_targets, max_prompt_tokens=cache.max_prompt_tokens,
                max_response_tokens=cache.max_response_tokens, use_chat_template=cache.use_chat_template)
    if augment is not None:
        dirs["augment"] = stage("augment", augment, dirs["ingest"])
    say_unread_contractions(config, cache, dirs.get("augment", dirs["ingest"]))
    dirs["cache"] = stage("cache", cache, dirs.get("augment", dirs["ingest"]))
    # The cache records where its model was; train and evaluate load it from where the config says it is
    # now (a moved model folder or artifact root: the same files elsewhere keep the cache's version).
    dirs["train"] = stage("train", config.train, dirs["cache"], model=cache.model)
    dirs["evaluate"] = stage("evaluate", config.evaluate, dirs["train"], dirs["cache"], model=cache.model)
    return dirs


def _check_devices(config: PipelineConfig) -> None:
    """Refuse a stage's device this machine does not have before the first stage runs, not when that
    stage starts (after the stages before it, with torch's error)."""
    stages = {"augment": config.augment if config.augment and config.augment.backend == "hf" else None,
              "cache": config.cache, "train": config.train, "evaluate": config.evaluate}
    for name, stage_config in stages.items():
        if stage_config is not None:
            try:
                resolve_device(stage_config.device)
            except ValueError as err:
                raise ValueError(f"{name}.device: {err}") from None


def _warn_of_another_generator(config: PipelineConfig) -> None:
    """Say where augment samples otherwise than the cache scores: from another model than pi_ref (a
    warning where one of them is the presets' ``tiny``: a model set for one stage only), or after
    prompts rendered otherwise."""
    augment, cache = config.augment, config.cache
    if augment is None or augment.backend == "borrow":
        return
    if augment.model != cache.model:
        advice = {augment.model: f"; set augment.model={cache.model} too, unless another generator is meant",
                  cache.model: f"; set cache.model={augment.model} too, unless another reference is meant"}
        (log.warning if TINY_MODEL in advice else log.info)(
            "augment.model = %s generates the responses, cache.model = %s (pi_ref) scores them%s", augment.model,
            cache.model, advice.get(TINY_MODEL, ""))
    if augment.use_chat_template != cache.use_chat_template:
        log.warning("augment.use_chat_template = %s but cache.use_chat_template = %s: responses are generated after "
                    "prompts rendered otherwise than the prompts they are scored after", augment.use_chat_template,
                    cache.use_chat_template)


def say_unread_contractions(config: PipelineConfig, cache: CacheConfig, rankings: str) -> None:
    """Before a cache is built with the reference contractions that this run's exact training
    (train.anchors = null) never reads, say how to leave them out: its backward passes, about half
    of the stage's time. Kept by default, for a later run with anchors and `moplex experiment
    approximation`."""
    if config.train.anchors is not None or not cache.contractions:
        return
    try:
        if plan_cache(cache, rankings, ArtifactStore(root_of(rankings))).complete:
            return
    except ArtifactCorruptError:  # a finished version damaged by hand: the cache stage refuses it by name
        return
    log.info("train.anchors = null scores every response exactly, so this run reads none of the reference "
             "contractions the cache computes (s_ref: its backward passes, about half of its time); unless a "
             "later run with train.anchors or `moplex experiment approximation` is to read this cache (as a "
             "comparison's `no_aug` reads the cache of its exact baselines), `--set cache.contractions=false` "
             "leaves them out")


def in_this_process(root: str | Path) -> Stage:
    """A `Stage` that calls each stage's function in this process, on the artifact store at ``root``."""
    store = ArtifactStore(root)
    calls: dict[str, Callable[..., Any]] = {
        "ingest": lambda config: run_ingest(config, store).path,
        "model": lambda config, rankings: run_tiny_model(config, rankings, store).parent,  # the artifact, not model/
        "augment": lambda config, rankings: run_augment(config, rankings, store).path,
        "cache": lambda config, rankings: run_cache(config, rankings, store).path,
        "train": lambda config, cache_dir, model: run_train(config, cache_dir, store, model=model).path,
        "evaluate": lambda config, train_dir, cache_dir, model: run_evaluate(config, train_dir, cache_dir, store,
                                                                             model=model).path,
    }
    return lambda name, *args, **kwargs: str(calls[name](*args, **kwargs))
