"""New rankings routed to a trained mixture's clusters: the `assign` artifact.

A user's (or a new annotator's) rankings, read by `moplex ingest` into a rankings artifact, are
scored exactly by each of the trained k adapters, r_c(y) = beta (log pi_c(y|x) - log pi_ref(y|x)), and
each ranking gets its posterior over the clusters under the mixture EM fitted (DESIGN 5.2):

    gamma_c = alpha_c P_c(sigma) / sum_c' alpha_c' P_c'(sigma)

so ``argmax_c gamma_c`` names the adapter (``train/<version>/adapters/cN``, PEFT's format) to serve
that user. The rankings first pass through the cache stage with the train artifact's own cache
settings (same model, tokenization and truncation), so log pi_ref is computed as training saw it and
the new cache is a versioned, resumable artifact like any other (its anchor contractions go unused).
Only the responses in the rankings are scored: nothing is generated.

    assign/<version>/part-*.parquet   one row per ranking (ASSIGN_SCHEMA)

The version depends on the train and cache artifacts and the dtype the adapters score in; as for
evaluate, ``device`` and ``score_batch_size`` are left out of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest

log = logging.getLogger(__name__)

STAGE = "assign"
CODE_VERSION = "assign-1"  # bump when a change to this stage changes what it writes

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
    cache_dir: Path  # the new rankings' cache (built by `run_assign` when missing)
    inputs: dict[str, str]  # {"train": "train/<version>", "cache": "cache/<version>"}
    complete: bool


@dataclass(frozen=True)
class AssignResult:
    ref: ArtifactRef
    path: Path
    built: bool
    rows: int


def plan_assign(train_dir: str | Path, rankings_dir: str | Path, store: ArtifactStore, *,
                device: str = "auto") -> AssignPlan:
    """Where the assignment of ``rankings_dir`` (a rankings or augmented artifact) to the mixture of
    ``train_dir`` (a finished train artifact) lives, and the cache it needs."""
    from moplex_core.cache import plan_cache
    from moplex_core.lm.loading import identity_on_this_machine

    train = read_manifest(train_dir)
    if train["stage"] != "train":
        raise ValueError(f"{train_dir} holds an {train['stage']} artifact, not a train artifact (train/<version>)")
    cache = plan_cache(_cache_config(train_dir, device), rankings_dir, store)
    inputs = {"train": f"train/{train['version']}", "cache": str(cache.ref)}
    scored_in = identity_on_this_machine({"dtype": train["config"]["dtype"]}, device)
    version = store.version(STAGE, scored_in, inputs, CODE_VERSION)
    return AssignPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), cache.path, inputs,
                      store.is_complete(STAGE, version))


def run_assign(train_dir: str | Path, rankings_dir: str | Path, store: ArtifactStore, *, device: str = "auto",
               score_batch_size: int = 32, progress: bool = True, plan: AssignPlan | None = None) -> AssignResult:
    """Cache ``rankings_dir`` as ``train_dir``'s cache was built (unless done), score every response
    under each trained adapter and write each ranking's posterior (unless this version exists)."""
    from moplex_core.cache import load_policy_inputs, run_cache
    from moplex_core.em import mixture_posteriors
    from moplex_core.lm.loading import resolve_device
    from moplex_core.train import load_trained

    plan = plan or plan_assign(train_dir, rankings_dir, store, device=device)
    if plan.complete:
        return AssignResult(plan.ref, plan.path, False, store.manifest(STAGE, plan.ref.version)["rows"])
    run_cache(_cache_config(train_dir, device), rankings_dir, store, progress=progress)
    inputs, clusters = load_policy_inputs(plan.cache_dir, split=None)
    scorer, alpha, trained = load_trained(train_dir, device=resolve_device(device))
    scorer.score_batch_size, scorer.progress = score_batch_size, progress
    scores = scorer.exact_scores(inputs)  # float64 [n, k, M]
    posterior, log_likelihood = mixture_posteriors(scores, inputs.rankings(trained.likelihood), alpha)  # [n, k], [n]
    sizes = [len(s) for s in inputs.sequences]
    table = pa.Table.from_pydict({
        "example_id": list(inputs.example_ids),
        "split": load_table(plan.cache_dir, columns=["split"]).column("split").to_pylist(),  # rows as inputs
        "cluster": list(clusters),
        "assigned": posterior.argmax(dim=1).to(torch.int32).tolist(),
        "posterior": posterior.tolist(),
        "log_likelihood": log_likelihood.tolist(),
        "scores": [scores[i, :, :m].tolist() for i, m in enumerate(sizes)],
    }, schema=ASSIGN_SCHEMA)
    with store.writer(STAGE, plan.ref.version, config={"device": device, "score_batch_size": score_batch_size},
                      inputs=plan.inputs, code_version=CODE_VERSION) as writer:
        if writer.complete:
            return AssignResult(plan.ref, plan.path, False, table.num_rows)
        writer.write_shard(0, table)
        writer.summary.update(assignment_summary(posterior.numpy(), clusters))
    log.info("assigned %d rankings to the %d clusters of %s: %s", table.num_rows, scorer.k, plan.inputs["train"],
             plan.path)
    return AssignResult(plan.ref, plan.path, True, table.num_rows)


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
        summary["labels_by_assigned"] = {
            label: {f"c{c}": int(((assigned == c) & (np.asarray(clusters) == label)).sum()) for c in range(k)}
            for label in sorted(set(clusters))
        }
    return summary


def _cache_config(train_dir: str | Path, device: str):
    """The CacheConfig of the train artifact's cache (in the train artifact's root), on ``device``."""
    from moplex_core.config import CacheConfig

    root = Path(train_dir).parents[1]
    recorded = dict(read_manifest(root / read_manifest(train_dir)["inputs"]["cache"])["config"])
    recorded.pop("resolved_dtype", None)  # what "auto" was where it ran (cache-N artifacts record it)
    return CacheConfig.model_validate({**recorded, "device": device})
