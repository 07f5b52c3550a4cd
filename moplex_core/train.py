"""The train stage without an orchestrator: `cache` in, a fitted mixture of k LoRA adapters out.

EM (moplex_core.em, paper Algorithm 2) drives the LoRA scorer (moplex_core.scorers.lora_policy) on
the cache's train split. Layout of the artifact (DESIGN 3)::

    train/<version>/
        em/restart-RR/start.parquet  the responsibilities that restart started from
        em/restart-RR/iter-NNNN/   posteriors.parquet, scores.parquet, adapters/cN/ (PEFT),
                                   estimation.json (that E-step's estimates against exact scores),
                                   state.pt (gamma, alpha, adapters, optimizer, shuffling RNG, the
                                   E-step's estimates for the next M-step, the exact fallback's switch;
                                   the last whole iteration's only: earlier ones are deleted),
                                   state.json (alpha, log-likelihood, history, step halvings; written last)
        adapters/cN/               the best restart's final adapters (PEFT save_pretrained format)
        posteriors.parquet         its final posteriors (example_id, gamma, assigned)
        start_posteriors.parquet   the responsibilities it started from (EM's init), same columns
        result.json                alpha, log-likelihood history, step halvings, iterations, restart, seed,
                                   the estimation check (the last iteration's, and each iteration's)

A killed run resumes at the last iteration whose state.json exists, with identical results (the
scorer's state restores adapters, Adam moments and the shuffling generator; anchors depend only on
(seed, iteration, example_id)).

    plan_train    the version (config, the cache's version) and whether it exists
    run_train     fit (or resume) and write the artifact
    load_trained  a finished train artifact as (scorer, alpha, config) for evaluation
    load_posteriors  its training example ids, the responsibilities EM started from and its final ones
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from moplex_core.artifacts import (CHECKPOINTS, MANIFEST, ArtifactRef, ArtifactStore, atomic_path,
                                   read_checked_manifest, read_manifest, root_of)
from moplex_core.cache import cache_model, contractions_out_of_date, load_policy_inputs
from moplex_core.config import TrainConfig, no_contractions_message, prompts_shared
from moplex_core.em import (START_FILE, EMConfig, EMState, estimates_off_by, fit_mixture, posteriors_table,
                            read_posteriors, soft_one_hot)
from moplex_core.estimate import check_sample, estimation_error
from moplex_core.ingest import check_clusters_fit, check_labels_fit
from moplex_core.pl import PAD
from moplex_core.lm.loading import dtype_name, identity_on_this_machine, resolve_device, resolve_dtype
from moplex_core.lm.multi_lora import LoRASettings
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, PolicyInputs, ScoreRecord

log = logging.getLogger(__name__)

STAGE = "train"
CODE_VERSION = "train-15"  # bump when a change to this stage changes what it writes (11: a k-means restart
# that repeats an earlier restart's partition starts from a Dirichlet draw instead; 12: adapter_config.json has
# task_type CAUSAL_LM, so AutoPeftModelForCausalLM loads an adapter; 13: EM's tolerance is absolute where
# |LL per ranking| < 1, as with m = 2; 14: with shared prompts a group's prefix reaches its rows by broadcast,
# whose backward sums them in another order: the same values to float rounding, other bytes; 15: a last tier
# that holds every response left, with no generated one below, adds log 1 = 0 to a ranking's PL likelihood
# (moplex_core.pl), where Breslow's term for a tie did not: rankings without ties keep their values)
POSTERIORS = "posteriors.parquet"
SCORES = "scores.parquet"  # of one EM iteration, under em/restart-RR/iter-NNNN/ (SCORES_SCHEMA)
ESTIMATES = "estimation.json"  # of one EM iteration, beside it: `measure_estimates`
START_POSTERIORS = "start_posteriors.parquet"
TRAIN_SPLIT = "train"

SCORES_SCHEMA = pa.schema([
    pa.field("example_id", pa.string()),
    pa.field("cluster", pa.int32()),
    pa.field("response_idx", pa.int32()),
    pa.field("score", pa.float64()),
    pa.field("is_anchor", pa.bool_()),
    pa.field("estimated", pa.bool_()),
])


@dataclass(frozen=True)
class TrainPlan:
    ref: ArtifactRef
    path: Path
    inputs: dict[str, str]  # {"cache": "cache/<version>"}
    complete: bool


@dataclass(frozen=True)
class TrainResult:
    ref: ArtifactRef
    path: Path
    built: bool
    log_likelihood: float
    iterations: int


def plan_train(config: TrainConfig, cache_dir: str | Path, store: ArtifactStore) -> TrainPlan:
    manifest = read_manifest(cache_dir)
    inputs = {"cache": f"{manifest['stage']}/{manifest['version']}"}
    device = resolve_device(config.device)
    identity = identity_on_this_machine(config.identity(), config.device)
    identity["share_prompts"] = prompts_shared(config.share_prompts, device)  # "auto" as it resolves here
    if config.lora_dropout:  # dropout masks come from the device's generator (see TrainConfig.identity)
        identity["device_type"] = torch.device(device).type
    version = store.version(STAGE, identity, inputs, CODE_VERSION)
    return TrainPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), inputs, store.is_complete(STAGE, version))


def make_scorer(config: TrainConfig, model: str, *, progress: bool = False, restart: int = 0) -> LoRAPolicyScorer:
    """The LoRA scorer ``config`` describes; restart r's is seeded config.seed + 1000 r (its adapters'
    initialisation, minibatch order, anchors and dropout), as EM seeds that restart's start."""
    device = resolve_device(config.device)
    return LoRAPolicyScorer(
        model, config.k, beta=config.beta, anchors=config.anchors, estimation=config.estimation,
        anchor_weighting=config.anchor_weighting, anchor_draw=config.anchor_draw,
        lora=LoRASettings(config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_targets),
        lr=config.lr, epochs=config.epochs, first_epochs=config.first_epochs, batch_size=config.batch_size,
        score_batch_size=config.score_batch_size,
        chunk_size=config.chunk_size, share_prompts=prompts_shared(config.share_prompts, device),
        gradient_checkpointing=config.gradient_checkpointing, seed=config.seed + 1000 * restart,
        exact_fallback=0 if config.exact_fallback is None else config.estimation_check,
        fallback_above=config.exact_fallback or 0.0,
        dtype=resolve_dtype(config.dtype, device), device=device,
        progress=progress,
    )


def run_train(config: TrainConfig, cache_dir: str | Path, store: ArtifactStore, plan: TrainPlan | None = None,
              *, model: str | None = None, progress: bool = True) -> TrainResult:
    """Fit the mixture on the cache's train split and write the train artifact (or resume it), on
    the cache's base model, found at ``model`` when given (`cache_model`)."""
    plan = plan or plan_train(config, cache_dir, store)
    if plan.complete:
        return _finished(plan)
    inputs, labels = load_policy_inputs(cache_dir, TRAIN_SPLIT)
    check_config_fits_data(config, inputs, cache_dir)
    estimated = config.anchors is not None and config.anchors < int((inputs.tiers != PAD).sum(1).max())
    out_of_date = contractions_out_of_date(cache_dir) if estimated else None
    if out_of_date:
        raise ValueError(out_of_date)
    model = cache_model(cache_dir, model)
    warm_start = label_start(labels, config.k, inputs.example_ids, cache_dir) if config.init == "labels" else None
    rankings = inputs.rankings(config.likelihood)
    em_config = EMConfig(k=config.k, max_iter=config.em_iterations, tol=config.tol, gamma_min=config.gamma_min,
                         init=config.init, restarts=config.restarts, hard=config.hard, mixing=config.mixing,
                         seed=config.seed,
                         backtracks=config.backtracks)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    recorded = {**config.model_dump(mode="json"), "model": model, "resolved_dtype": dtype_name(dtype)}
    with store.writer(STAGE, plan.ref.version, config=recorded, inputs=plan.inputs, code_version=CODE_VERSION) as writer:
        if writer.complete:
            return _finished(plan)
        bar = tqdm(total=config.em_iterations * config.restarts, desc="EM", disable=not progress)

        def on_iteration(state: EMState) -> None:
            bar.set_postfix(restart=state.restart, LL=f"{state.log_likelihood:.4f}", refresh=False)
            bar.update(state.restart * config.em_iterations + state.iteration + 1 - bar.n)  # redrawn at tqdm's pace
            log.info("restart %d iteration %d: LL %.6f, alpha %s", state.restart, state.iteration,
                     state.log_likelihood, [round(a, 4) for a in state.alpha.tolist()])

        gap: list[float] = []
        restarts = itertools.count()  # fit_mixture makes one scorer per restart, in order

        def new_scorer() -> LoRAPolicyScorer:
            scorer = make_scorer(config, model, progress=progress, restart=next(restarts))
            if not gap:
                gap.append(check_reference_gap(scorer, inputs, cache_dir))
            return scorer

        with bar:
            result, scorer = fit_mixture(new_scorer, inputs, rankings, em_config, checkpoint_dir=writer.path / CHECKPOINTS,
                                         on_iteration=on_iteration, warm_start=warm_start,
                                         checkpoint_files=partial(_iteration_files, inputs=inputs, config=config))
        best = result.best
        with writer.directory("adapters") as staging:
            scorer.save_adapters(staging)
        writer.write_table(POSTERIORS, posteriors_table(inputs.example_ids, best.gamma))
        start_file = writer.path / CHECKPOINTS / f"restart-{best.restart:02d}" / START_FILE
        writer.write_file(START_POSTERIORS, start_file.read_bytes())  # EM wrote it for these example ids
        summary = {
            "restart": best.restart, "iterations": best.iteration + 1, "converged": best.converged,
            "log_likelihood": best.log_likelihood, "history": best.history, "step_halvings": best.halvings,
            "alpha": best.alpha.tolist(),
            "restarts": [{"restart": s.restart, "log_likelihood": s.log_likelihood, "iterations": s.iteration + 1,
                          **({} if s.compared_on is None else {"exact_log_likelihood": s.compared_on})}
                         for s in result.restarts],
            "train_examples": len(inputs), "seed": config.seed, "reference_gap": gap[0],
            "estimation_check": check_estimates(best, writer.path / "em", scorer.fell_back),
            "fell_back": scorer.fell_back,
        }
        writer.write_file("result.json", json.dumps(summary, indent=2))
        writer.summary.update({k: summary[k] for k in ("restart", "iterations", "converged", "log_likelihood",
                                                       "alpha", "train_examples", "reference_gap",
                                                       "estimation_check", "fell_back")})
    return TrainResult(plan.ref, plan.path, True, best.log_likelihood, best.iteration + 1)


ESTIMATES_HOLD = {"relative_error": 1.0, "same_cluster": 0.9}
"""`check_estimates` warns when `estimate.estimation_error`'s relative_error is above 1.0 (the
estimates' error is larger than the spread of the exact scores in a slate) or its same_cluster is
below 0.9 (more than one ranking in ten would change its most probable cluster under exact scores)."""
BY_ITERATION = ("iteration", "relative_error", "same_cluster", "holds")  # result.json's per-iteration check


def measure_estimates(scorer: LoRAPolicyScorer, inputs: PolicyInputs, config: TrainConfig, it_dir: Path,
                      state: EMState) -> dict[str, Any] | None:
    """The E-step scores of one EM iteration (``it_dir``/scores.parquet) of up to
    ``train.estimation_check`` training examples (a seeded draw, the same every iteration) against
    their exact scores under the same adapters, the scorer's now (`estimate.estimation_error`): does
    EM's partition rest on estimates that order the slates as the exact scores do? ``holds`` says
    whether they are within `ESTIMATES_HOLD`. None without estimated responses or with
    estimation_check = 0. It costs one exact forward over the checked examples' responses under each
    adapter, and changes nothing EM does."""
    if config.anchors is None or config.estimation_check == 0:
        return None
    checked = inputs.subset(check_sample(len(inputs), config.estimation_check, scorer.seed))  # the fallback's draw
    table = pq.read_table(it_dir / SCORES, filters=[("example_id", "in", list(checked.example_ids))]).to_pydict()
    if not any(table["estimated"]):  # every response exact (e.g. after train.exact_fallback): nothing to check
        return None
    record = scorer.last_scores  # the exact fallback scored the same examples under the same adapters
    reuse = record is not None and record.iteration == state.iteration and record.check_exact is not None
    exact = record.check_exact if reuse else scorer.exact_scores(checked)  # [n', k, M]
    row = {example_id: i for i, example_id in enumerate(checked.example_ids)}
    at = (torch.tensor([row[e] for e in table["example_id"]]), torch.tensor(table["cluster"]),
          torch.tensor(table["response_idx"]))  # 3 x [rows]
    estimated = exact.index_put(at, torch.tensor(table["score"], dtype=exact.dtype))
    is_estimated = torch.zeros(exact.shape, dtype=torch.bool).index_put(at, torch.tensor(table["estimated"]))
    check = {"examples": len(checked), "iteration": state.iteration,
             **estimation_error(estimated, exact, is_estimated, checked.tiers != PAD,
                                checked.rankings(config.likelihood).log_likelihood, state.alpha)}
    relative = check["relative_error"]
    check["holds"] = (relative is not None and relative <= ESTIMATES_HOLD["relative_error"]
                      and check["same_cluster"] >= ESTIMATES_HOLD["same_cluster"])
    return check


def check_estimates(best: EMState, em_dir: Path, fell_back: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The best restart's last `measure_estimates`, with ``by_iteration`` (each iteration's
    iteration, relative_error, same_cluster and holds: when the estimates stopped holding), logged
    with a warning when EM ended on estimates that do not hold. None when nothing was measured.
    After an exact fallback (``fell_back``, `train.exact_fallback`) the last measured iteration is
    the one before it (every later score was exact), and ``by_iteration`` ends with the failed
    E-step's relative error (same_cluster None)."""
    restart_dir = em_dir / f"restart-{best.restart:02d}"
    measured = [json.loads((restart_dir / f"iter-{t:04d}" / ESTIMATES).read_text())
                for t in range(best.iteration + 1) if (restart_dir / f"iter-{t:04d}" / ESTIMATES).is_file()]
    if fell_back is not None:
        log.info("the anchors' estimates at E-step %d were %s: EM redid that iteration and computed every later "
                 "step exactly (train.exact_fallback)", fell_back["iteration"],
                 estimates_off_by(fell_back["relative_error"]))
    if not measured:
        return None
    failed = [] if fell_back is None else [{"iteration": fell_back["iteration"], "relative_error":
                                            fell_back["relative_error"], "same_cluster": None, "holds": False}]
    check = {**measured[-1], "by_iteration": [{key: m[key] for key in BY_ITERATION} for m in measured] + failed}
    relative = check["relative_error"]
    message = (f"anchors' estimates after EM iteration {check['iteration']}, on {check['examples']} training "
               f"examples: mean |r_hat - r| = {check['mean_abs_error']:.4g} against a spread of "
               f"{check['score_spread']:.4g} in the exact scores of a slate (relative error "
               f"{'-' if relative is None else f'{relative:.2f}'}); {check['same_cluster']:.0%} keep their most "
               f"probable cluster under exact scores; LL per ranking {check['log_likelihood_estimated']:.4f} "
               f"estimated, {check['log_likelihood_exact']:.4f} exact")
    if fell_back is None and not check["holds"]:
        held = [m["iteration"] for m in measured if m["holds"]]
        since = f"; they held until iteration {held[-1]}" if held else "; they held at no iteration"
        log.warning("%s%s. EM's clusters rest on these estimates, and they do not hold here (train.ESTIMATES_HOLD): "
                    "raise train.anchors, set it to null to compute every response exactly, or let "
                    "train.exact_fallback (e.g. 0.5) switch to exact scores when they fail.", message, since)
    else:
        log.info("%s", message)
    return check


REFERENCE_GAP_WARNING = 0.05  # nats: float32 rounding is ~1e-5; a float32 cache under bfloat16 is ~0.1-1


def check_reference_gap(scorer: LoRAPolicyScorer, inputs: PolicyInputs, cache_dir: str | Path) -> float:
    """The scorer's base model against the cache's log pi_ref (`LoRAPolicyScorer.reference_gap`),
    logged, with a warning that names both dtypes when every delta would start that far from 0."""
    gap = scorer.reference_gap(inputs)
    cached = read_manifest(cache_dir)["config"].get("resolved_dtype", "unknown")
    trained = dtype_name(scorer.model.dtype)
    if gap > REFERENCE_GAP_WARNING:
        remedy = (f"compute the cache in the training's dtype (cache.dtype={trained})" if cached != trained else
                  "rounding in this dtype depends on the batch's shape; float32 for both removes it")
        log.warning("the base model's log-probs differ from the cache's log pi_ref by up to %.3g nats (cache in %s, "
                    "training in %s): every delta starts that far from 0 instead of at 0. To avoid it, %s; or "
                    "accept it as noise in the scores.", gap, cached, trained, remedy)
    else:
        log.info("the base model reproduces the cache's log pi_ref to %.3g nats (cache in %s, training in %s)",
                 gap, cached, trained)
    return gap


def label_start(labels: list[str | None], k: int, example_ids: Sequence[str], cache_dir: str | Path) -> torch.Tensor:
    """`train.init = labels`: the start float64 [n, k] from the training rankings' own labels, the
    i-th of them in sorted order on cluster c<i> (`em.soft_one_hot`)."""
    names = check_labels_fit(labels, example_ids, k, f"the cache at {cache_dir}")
    return soft_one_hot(np.array([names.index(label) for label in labels]), k)


def check_config_fits_data(config: TrainConfig, inputs: PolicyInputs, cache_dir: str | Path) -> None:
    """Refuse, before EM writes anything, what only the data can show: more clusters than training
    rankings, more anchors than responses (a > m'), or anchors (a < m') on a cache without reference
    contractions (cache.contractions = false). `run_train` refuses, besides, anchors on contractions
    from before their target terms (`cache.contractions_out_of_date`). An example with fewer
    responses than ``a`` (ragged slates) is computed exactly, as ``a = m'`` would."""
    check_clusters_fit(config.k, len(inputs), f"the cache at {cache_dir} has")
    responses = (inputs.tiers != PAD).sum(1)  # [n]: m' of every example
    largest, smallest = int(responses.max()), int(responses.min())
    if config.anchors is not None and config.anchors > largest:
        shown = f"m' = {largest}" if largest == smallest else f"m' = {smallest}..{largest}"
        raise ValueError(
            f"train.anchors a = {config.anchors} > {shown} responses per example in the cache at {cache_dir} "
            f"(m originals + m' - m generated). Set train.anchors to at most {largest}, or to null to compute "
            "every response exactly (the full ablation)."
        )
    if config.anchors is not None and config.anchors < largest and inputs.ref_contraction is None:
        raise ValueError(no_contractions_message(config.anchors, f"the cache at {cache_dir}"))
    if config.anchors is not None and config.anchors > smallest:
        log.info("%d example(s) have fewer than a = %d responses; they are computed exactly",
                 int((responses < config.anchors).sum()), config.anchors)


def load_trained(train_dir: str | Path, model: str | None = None, *, device: str | None = None
                 ) -> tuple[LoRAPolicyScorer, torch.Tensor, TrainConfig]:
    """The final adapters of a finished train artifact as a scorer, the mixing weights alpha, and
    the config it was trained with (its ``likelihood`` is how its posteriors are computed), on the
    base model at ``model``, by default where its cache finds its model now (`cache_model`: the root's
    own tiny model when the root moved), or where the model was when it trained when that cache is
    not beside it."""
    # What evaluate and assign read of it, as its stage checks it (a truncated adapter, say; a deleted
    # start_posteriors.parquet would pass for an artifact from before train-5, which kept none).
    manifest = read_checked_manifest(train_dir)
    recorded = dict(manifest["config"])
    trained_on = recorded.pop("model")  # where the model was when it trained
    if model is None:
        cache_dir = root_of(Path(train_dir).resolve()) / manifest["inputs"]["cache"]
        model = cache_model(cache_dir) if (cache_dir / MANIFEST).is_file() else trained_on
    recorded.pop("resolved_dtype", None)  # what "auto" was where it trained (artifacts of train-6 on)
    if device is not None:
        recorded["device"] = device
    config = TrainConfig.model_validate(recorded)
    scorer = make_scorer(config, model)
    scorer.load_adapters(Path(train_dir) / "adapters")
    alpha = torch.tensor(json.loads((Path(train_dir) / "result.json").read_text())["alpha"], dtype=torch.float64)
    return scorer, alpha, config


def _iteration_files(it_dir: Path, state: EMState, scorer: LoRAPolicyScorer, *, inputs: PolicyInputs,
                     config: TrainConfig) -> None:
    """scores.parquet, adapters/ and estimation.json (`measure_estimates`, when it measures) of one EM
    iteration, each renamed into place when whole."""
    record = scorer.last_scores
    if record is None or record.iteration != state.iteration:
        raise RuntimeError(f"the scorer holds no E-step scores of iteration {state.iteration}")
    table = scores_table(record)
    with atomic_path(it_dir / SCORES) as tmp:
        pq.write_table(table, tmp)
    staging = it_dir / f".adapters.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    scorer.save_adapters(staging)
    shutil.rmtree(it_dir / "adapters", ignore_errors=True)
    os.replace(staging, it_dir / "adapters")
    check = measure_estimates(scorer, inputs, config, it_dir, state)
    if check is not None:
        log.info("iteration %d: the anchors' estimates against exact scores on %d training examples: relative error "
                 "%s, %.0f%% keep their most probable cluster", state.iteration, check["examples"],
                 "-" if check["relative_error"] is None else f"{check['relative_error']:.2f}",
                 100 * check["same_cluster"])
        with atomic_path(it_dir / ESTIMATES) as tmp:
            tmp.write_text(json.dumps(check, indent=2))


def scores_table(record: ScoreRecord) -> pa.Table:
    """Long format: one row per (example, cluster, response) in the slate (SCORES_SCHEMA)."""
    n, k, m = record.scores.shape
    example, cluster, response = torch.meshgrid(torch.arange(n), torch.arange(k), torch.arange(m), indexing="ij")
    keep = record.in_slate[:, None, :].expand(n, k, m)
    anchor = record.is_anchor[:, None, :].expand(n, k, m)[keep]
    ids = pa.array(list(record.example_ids), pa.string()).take(pa.array(example[keep].numpy()))
    return pa.table({
        "example_id": ids,
        "cluster": pa.array(cluster[keep].numpy().astype("int32")),
        "response_idx": pa.array(response[keep].numpy().astype("int32")),
        "score": pa.array(record.scores[keep].numpy()),
        "is_anchor": pa.array(anchor.numpy()),
        "estimated": pa.array((~anchor).numpy()),
    }, schema=SCORES_SCHEMA)


def load_posteriors(train_dir: str | Path) -> tuple[tuple[str, ...], torch.Tensor | None, torch.Tensor]:
    """A finished train artifact's training example ids, the responsibilities EM started from and its
    final posteriors (float64 [n, k] each). The start is None in artifacts of code before train-5,
    which did not keep it."""
    train_dir = Path(train_dir)
    ids = tuple(pq.read_table(train_dir / POSTERIORS, columns=["example_id"]).column(0).to_pylist())
    start = read_posteriors(train_dir / START_POSTERIORS, ids) if (train_dir / START_POSTERIORS).is_file() else None
    return ids, start, read_posteriors(train_dir / POSTERIORS, ids)


def _finished(plan: TrainPlan) -> TrainResult:
    result = json.loads((plan.path / "result.json").read_text())
    return TrainResult(plan.ref, plan.path, False, result["log_likelihood"], result["iterations"])
