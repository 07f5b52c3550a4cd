"""New rankings routed to a trained mixture's clusters: the `assign` artifact.

A user's (or a new annotator's) rankings, read by `moplex ingest` into a rankings artifact, are
scored exactly by each of the trained k adapters, r_c(y) = beta (log pi_c(y|x) - log pi_ref(y|x)), and
each ranking gets its posterior over the clusters under the mixture EM fitted (DESIGN 5.3):

    gamma_c = alpha_c P_c(sigma) / sum_c' alpha_c' P_c'(sigma)

so ``argmax_c gamma_c`` names the adapter (``train/<version>/adapters/cN``, PEFT's format) to serve
that user. The rankings first pass through the cache stage with the train artifact's own cache
settings (same model, tokenization and truncation), so log pi_ref is computed as training saw it and
the new cache is a versioned, resumable artifact like any other; exact scores need no reference
contractions, so it is built without them (cache.contractions = false: forward passes only).
Only the responses in the rankings are scored: nothing is generated.

    assign/<version>/part-*.parquet   one row per ranking (ASSIGN_SCHEMA); shard s holds the rankings
                                      of the cache's shard s (cache.shard_rows each), written as soon
                                      as they are scored, so a killed run resumes at the first
                                      missing shard

The version depends on the train and cache artifacts and the dtype the adapters score in; as for
evaluate, ``device`` and ``score_batch_size`` are left out of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from moplex_core.artifacts import (ArtifactError, ArtifactRef, ArtifactStore, finished_shards, read_manifest, root_of,
                                   shard_name)

if TYPE_CHECKING:
    from moplex_core.cache import CachePlan
    from moplex_core.config import CacheConfig
    from moplex_core.scorers.lora_policy import LoRAPolicyScorer

log = logging.getLogger(__name__)

STAGE = "assign"
CODE_VERSION = "assign-5"  # bump when a change to this stage changes what it writes
# (assign-2: agreement_with_labels; assign-3: one shard per cache shard, each written when scored; assign-4: a
# tied last tier of every response left adds 0 to the PL likelihood, moplex_core.pl; assign-5: the adjusted Rand
# index null where the labels hold one label or one ranking, not 1.0)

ASSIGN_SCHEMA = pa.schema([
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("split", pa.string(), nullable=False),
    pa.field("cluster", pa.string()),  # the ranking's true label in the input, when it has one
    pa.field("assigned", pa.int32(), nullable=False),  # argmax_c posterior: adapter c<assigned>
    pa.field("posterior", pa.list_(pa.float64()), nullable=False),  # [k], sums to 1
    pa.field("log_likelihood", pa.float64(), nullable=False),  # log sum_c alpha_c P_c(sigma), nats
    pa.field("scores", pa.list_(pa.list_(pa.float64())), nullable=False),  # [k][m]: r_c of each response
])


@dataclass(frozen=True)
class AssignPlan:
    ref: ArtifactRef
    path: Path
    cache: CachePlan  # the rankings' cache (built by `run_assign` when missing)
    cache_config: CacheConfig  # the train artifact's cache settings, on this run's device, without contractions
    inputs: dict[str, str]  # {"train": "train/<version>", "cache": "cache/<version>"}
    recorded: dict[str, Any]  # the manifest's config: where from, and how it was scored
    complete: bool


@dataclass(frozen=True)
class AssignResult:
    ref: ArtifactRef
    path: Path
    built: bool
    rows: int


def plan_assign(train_dir: str | Path, rankings_dir: str | Path, store: ArtifactStore, *, model: str | None = None,
                device: str = "auto", score_batch_size: int = 32) -> AssignPlan:
    """Where the assignment of ``rankings_dir`` (a rankings or augmented artifact) to the mixture of
    ``train_dir`` (a finished train artifact) lives, and the cache it needs. The base model is found
    at ``model`` when given, else where the train artifact's cache recorded it (`cache_model`); one
    whose files changed since the adapters were trained on it is refused."""
    from moplex_core.cache import RANKING_STAGES, cache_model, plan_cache
    from moplex_core.lm.loading import dtype_name, identity_on_this_machine, resolve_device, resolve_dtype

    train_dir, rankings_dir = Path(train_dir).resolve(), Path(rankings_dir).resolve()
    train = read_manifest(train_dir, ("train",))
    read_manifest(rankings_dir, RANKING_STAGES)  # refuses an unfinished artifact or one of another stage
    resolved = resolve_device(device)
    trained_cache_dir = root_of(train_dir) / train["inputs"]["cache"]
    try:
        trained_cache = read_manifest(trained_cache_dir, ("cache",))
    except ArtifactError as err:  # deleted, half deleted, or left behind when the train artifact was copied
        raise type(err)(
            f"train/{train['version']} was trained on {train['inputs']['cache']}, whose manifest.json holds the "
            f"settings and the base model that new rankings are cached with: {str(err).rstrip('.')}. Put that "
            f"version's folder back at {trained_cache_dir} (a train artifact copied to another root or machine "
            "needs its cache beside it), or rebuild it by rerunning the pipeline that trained the adapters (`moplex "
            "run` with the same preset and settings writes the same cache version and reuses the train "
            "artifact)") from None
    model = cache_model(trained_cache_dir, model)
    cache_config = _cache_config(trained_cache, device, model)
    cache = plan_cache(cache_config, rankings_dir, store)
    inputs = {"train": f"train/{train['version']}", "cache": str(cache.ref)}
    scored_in = identity_on_this_machine({"dtype": train["config"]["dtype"]}, device)
    version = store.version(STAGE, scored_in, inputs, CODE_VERSION)
    recorded = {"train": str(train_dir), "rankings": str(rankings_dir), "model": model, "device": resolved,
                "resolved_dtype": dtype_name(resolve_dtype(train["config"]["dtype"], resolved)),
                "score_batch_size": score_batch_size}
    return AssignPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), cache, cache_config, inputs, recorded,
                      store.is_complete(STAGE, version))


def run_assign(train_dir: str | Path, rankings_dir: str | Path, store: ArtifactStore, *, model: str | None = None,
               device: str = "auto", score_batch_size: int = 32, progress: bool = True,
               plan: AssignPlan | None = None) -> AssignResult:
    """Cache ``rankings_dir`` as ``train_dir``'s cache was built (unless done), score every response
    under each trained adapter and write each ranking's posterior (unless this version exists). A
    ``plan`` carries its own model, device and score_batch_size."""
    from moplex_core.cache import run_cache
    from moplex_core.train import load_trained

    plan = plan or plan_assign(train_dir, rankings_dir, store, model=model, device=device,
                               score_batch_size=score_batch_size)
    if plan.complete:  # whole: a damaged version is refused by its plan (`ArtifactStore.is_complete`)
        return AssignResult(plan.ref, plan.path, False, store.manifest(STAGE, plan.ref.version)["rows"])
    _warn_of_other_cache_code(Path(train_dir).resolve())
    with store.writer(STAGE, plan.ref.version, config=plan.recorded, inputs=plan.inputs,
                      code_version=CODE_VERSION) as writer:
        if writer.complete:
            return AssignResult(plan.ref, plan.path, False, store.manifest(STAGE, plan.ref.version)["rows"])
        run_cache(plan.cache_config, rankings_dir, store, plan.cache, progress=progress)
        cache_shards = finished_shards(plan.cache.path)  # assign shard s holds the rankings of cache shard s
        todo = [s for s in range(len(cache_shards)) if not writer.has_shard(s)]
        if todo:
            scorer, alpha, trained = load_trained(train_dir, plan.recorded["model"], device=plan.recorded["device"])
            scorer.score_batch_size, scorer.progress = plan.recorded["score_batch_size"], progress
            rows = [pq.read_metadata(path).num_rows for path in cache_shards]
            done = sum(rows) - sum(rows[s] for s in todo)
            with tqdm(total=sum(rows), initial=done, desc="assign: rankings", unit="ranking",
                      disable=not progress) as bar:
                for s in todo:
                    part = pq.read_table(cache_shards[s])
                    writer.write_shard(s, _assigned_rows(part, scorer, alpha, trained.likelihood))
                    bar.update(part.num_rows)
        written = pa.concat_tables(pq.read_table(writer.path / shard_name(s), columns=["posterior", "cluster"])
                                   for s in range(len(cache_shards)))
        posterior = np.array(written.column("posterior").to_pylist(), dtype=np.float64)  # [n, k]
        writer.summary.update(assignment_summary(posterior, written.column("cluster").to_pylist()))
    log.info("assigned %d rankings to the %d clusters of %s: %s", len(posterior), posterior.shape[1],
             plan.inputs["train"], plan.path)
    return AssignResult(plan.ref, plan.path, True, len(posterior))


def _assigned_rows(part: pa.Table, scorer: LoRAPolicyScorer, alpha: torch.Tensor, likelihood: str) -> pa.Table:
    """ASSIGN_SCHEMA rows of some CACHE_SCHEMA rows: each response scored exactly under every adapter,
    and each ranking's posterior over the clusters."""
    from moplex_core.cache import policy_inputs
    from moplex_core.em import check_finite

    inputs, clusters = policy_inputs(part)
    scores = scorer.exact_scores(inputs)  # float64 [n, k, M]
    rankings = inputs.rankings(likelihood)
    check_finite(scores, rankings, "moplex assign", "The trained adapters' scores of these rankings are not usable.")
    tied = rankings.all_tied
    if tied.any():
        log.warning("%d of %d rankings (the first: example_id %r) put every response in one tier: they order "
                    "nothing, so their posteriors say little about their cluster (near the mixing weights, "
                    "pulled toward the adapter that scores their responses most alike)", int(tied.sum()),
                    len(tied), inputs.example_ids[int(tied.nonzero()[0])])
    return assignment_table(inputs, part.column("split").to_pylist(), clusters, scores, rankings, alpha)


def assignment_table(inputs: Any, splits: list[str], clusters: list[str | None], scores: torch.Tensor,
                     rankings: Any, alpha: torch.Tensor) -> pa.Table:
    """ASSIGN_SCHEMA rows of the n rankings of ``inputs`` (PolicyInputs; ``rankings`` their Rankings
    under the mixture's likelihood), each in split ``splits[i]`` with true label ``clusters[i]`` (or
    None), from the exact scores float64 [n, k, M] of every response under every adapter and the
    mixing weights ``alpha`` [k]: the posterior over the clusters and the mixture log-likelihood."""
    from moplex_core.em import mixture_posteriors

    posterior, log_likelihood = mixture_posteriors(scores, rankings, alpha)  # [n, k], [n]
    return pa.Table.from_pydict({
        "example_id": list(inputs.example_ids),
        "split": list(splits),
        "cluster": list(clusters),
        "assigned": posterior.argmax(dim=1).to(torch.int32).tolist(),
        "posterior": posterior.tolist(),
        "log_likelihood": log_likelihood.tolist(),
        "scores": [scores[i, :, :len(seqs)].tolist() for i, seqs in enumerate(inputs.sequences)],  # [k][m_i] each
    }, schema=ASSIGN_SCHEMA)


def assignment_summary(posterior: np.ndarray, clusters: list[str | None]) -> dict[str, object]:
    """Per assigned cluster: how many rankings and their mean posterior there; and, when every
    ranking has a true label, how the labels spread over the assigned clusters."""
    assigned = posterior.argmax(axis=1)
    k = posterior.shape[1]
    summary: dict[str, object] = {
        "assigned": {f"c{c}": int((assigned == c).sum()) for c in range(k)},
        "mean_posterior_of_assigned": {f"c{c}": round(float(posterior[assigned == c, c].mean()), 4)
                                       for c in range(k) if (assigned == c).any()},
    }
    if clusters and all(c is not None for c in clusters):
        from moplex_core.metrics import adjusted_rand_index, clustering_accuracy, fit_matching

        names = sorted(set(clusters))
        labels = np.array([names.index(c) for c in clusters])
        summary["labels_by_assigned"] = {
            label: {f"c{c}": int(((assigned == c) & (labels == t)).sum()) for c in range(k)}
            for t, label in enumerate(names)
        }
        # The matching is fitted on these same rankings: an upper bound, unlike evaluate's validation fit.
        matching = fit_matching(assigned, labels, k, len(names))
        ari = adjusted_rand_index(assigned, labels)  # NaN with one label or one ranking: None in the manifest
        summary["agreement_with_labels"] = {
            "accuracy_best_matching": round(clustering_accuracy(assigned, labels, matching), 4),
            "adjusted_rand_index": round(ari, 4) if np.isfinite(ari) else None,
        }
    return summary


def _warn_of_other_cache_code(train_dir: Path) -> None:
    """A train artifact kept from an older moplex (an upgrade since) may have trained on a cache that
    other cache code wrote; the rankings to assign are cached by this code, whose text or scores may
    differ (prompt tokens: cache-5), and nothing else would say so."""
    from moplex_core.cache import CODE_VERSION as CACHE_CODE

    trained_on = read_manifest(train_dir)["inputs"]["cache"]
    written_by = read_manifest(root_of(train_dir) / trained_on).get("code_version")
    if written_by != CACHE_CODE:
        log.warning("%s trained on %s, which %s wrote; this moplex caches the rankings to assign with %s, so its "
                    "adapters score them as this code prepares a response, which can differ from what they trained "
                    "on (see the code version's comment in moplex_core/cache.py; retrain to match)",
                    f"train/{train_dir.name}", trained_on, written_by, CACHE_CODE)


def _cache_config(cache_manifest: dict[str, Any], device: str, model: str) -> CacheConfig:
    """The CacheConfig a cache artifact was built with, on ``device``, with its base model at ``model``
    and without contractions."""
    from moplex_core.config import CacheConfig

    recorded = dict(cache_manifest["config"])
    for resolved in ("resolved_dtype", "resolved_share_prompts"):  # what "auto" was where it ran (not settings)
        recorded.pop(resolved, None)
    return CacheConfig.model_validate({**recorded, "model": model, "device": device, "contractions": False})
