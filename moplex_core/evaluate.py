"""Evaluation of a fitted mixture on held-out splits (DESIGN.md 7), for any Scorer.

Always exact scores. The Hungarian matching from EM's cluster ids to the true labels is fitted on
``fit_split`` (default `validation`) and applied to every split (in-sample on the fit split).
Ranking accuracy is reported four ways, labelled:

    posterior       each ranking routed to argmax_c gamma_ic, gamma computed from that same ranking
                    (the paper's number; optimistic: the ranking chooses its own scorer, and the more
                    clusters, the more it gains, also from adapters that order nothing)
    leave_pair_out  each pair (i, j) of a ranking predicted by the cluster argmax_c gamma_ic computed
                    from the ranking without i and j (a Plackett-Luce ranking's marginal over the
                    other items is Plackett-Luce over them): the posterior's routing without the
                    pair it predicts, so k = 1 and a mixture of adapters that know nothing score alike
    oracle          routed by the true label through the matching (needs labels; a label left without
                    a partner, as with k = 1, or whose partner holds none of its members, goes to the
                    cluster holding most of its validation members)
    marginal        the mixture's own prediction, no label and no ranking used: i above j when
                    sum_c alpha_c sigmoid(r_ci - r_cj), the mixture's probability that i precedes j
                    (a Plackett-Luce ranking's pairwise marginal), is above 1/2

Output rows: (split, metric, cluster, value); cluster is "all" for averages over the split's rankings
(the paper averages over clusters: the per-cluster rows give that mean). ``matched_adapter`` rows
(split: the one the matching was fitted on; cluster: a true label) give the EM cluster, the adapter
``c<value>``, that serves that label (oracle routing, `ClusterMatching.routing`). The evaluate stage adds
rows of split ``train_em``, from the train artifact's own posteriors of the training rankings (no
scoring): how much of its start EM kept (`em_start_metrics`), and from its result.json the check of
the anchors' estimates and where EM fell back to exact scores (`estimation_rows`).
``heldout_log_likelihood`` is per ranking under the trained model's own observation model (PL, or
Bradley-Terry over pairs for the pairwise baselines) over the cache's slates (originals, plus generated
responses when augmented): compare it only between methods with the same model and the same slates.

The evaluate stage (`plan_evaluate`, `run_evaluate`) applies this to a finished train artifact:
its final adapters score the cache's held-out splits exactly, once per split (the metrics and the
generated-response diagnostics share those scores), and it writes the `evaluation` artifact::

    evaluate/<version>/metrics.parquet      method, split, metric, cluster, value, seed
                       assignments.parquet  one row per held-out ranking, in `assign`'s schema
                                            (`assign.ASSIGN_SCHEMA`): its split, true label, posterior
                                            over the clusters, assigned adapter, mixture
                                            log-likelihood and every response's exact score [k][m']
                       diagnostics.parquet  moplex_core.diagnostics per split and EM cluster (when
                                            the cache has generated responses)
                       report.md, plots/    moplex_core.report
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest
from moplex_core.assign import assignment_table
from moplex_core.config import EvaluateConfig
from moplex_core.diagnostics import generated_score_diagnostics
from moplex_core.em import Rankings, Scorer, check_finite, mixture_posteriors
from moplex_core.metrics import (
    ClusterMatching,
    adjusted_rand_index,
    cluster_ids,
    clustering_accuracy,
    fit_matching,
    many_to_one_accuracy,
    normalized_mutual_information,
    pair_accuracy,
    per_cluster_accuracy,
    score_credit,
    score_order,
)
from moplex_core.pl import PAD, UNRANKED


@dataclass(frozen=True)
class EvalSplit:
    inputs: Any
    rankings: Rankings
    labels: np.ndarray | None = None  # int64 [n] true cluster ids, or None when unknown


MATCHED_ADAPTER = "matched_adapter"
RANKING_VARIANTS = ("posterior", "leave_pair_out", "oracle", "marginal")
"""The ranking accuracies, as ``ranking_accuracy_<variant>`` rows (module docstring)."""


def evaluate_mixture(
    scorer: Scorer,
    alpha: torch.Tensor,
    splits: dict[str, EvalSplit],
    label_names: list[str] | None = None,
    fit_split: str = "validation",
) -> pd.DataFrame:
    """Metrics of the mixture (scorer, alpha) on every split; the matching is fitted on ``fit_split``."""
    k = scorer.k
    splits = {name: split if split.labels is None else replace(split, labels=cluster_ids(split.labels))
              for name, split in splits.items()}
    empty = [name for name, split in splits.items() if len(split.rankings) == 0]
    if empty:  # its ARI and NMI would read 1.0 (sklearn's convention for no samples), all else NaN
        raise ValueError(f"split(s) {empty} hold no rankings: there is nothing to evaluate on them")
    outputs = {name: _posterior_outputs(scorer, alpha, split) for name, split in splits.items()}
    labelled = [split.labels for split in splits.values() if split.labels is not None and len(split.labels)]
    k_true = len(label_names) if label_names else max((int(labels.max()) + 1 for labels in labelled), default=k)
    matching = None
    if fit_split in splits and splits[fit_split].labels is not None:
        matching = fit_matching(outputs[fit_split]["assigned"], splits[fit_split].labels, k, k_true)

    rows: list[tuple[str, str, str, float]] = []
    for name, split in splits.items():
        out = outputs[name]
        rows.append((name, "heldout_log_likelihood", "all", float(out["ll"].mean())))
        rows.append((name, RANKINGS, "all", float(len(out["ll"]))))
        if split.labels is not None:  # how many rankings each per-cluster value rests on
            counts = np.bincount(split.labels, minlength=k_true)
            rows += [(name, RANKINGS, _name(c, label_names), float(n)) for c, n in enumerate(counts)]
        rows += _ranking_rows(name, out, split, alpha, matching, k_true, label_names)
        if split.labels is None or k == 1:  # one cluster holds every ranking: no clustering to measure
            continue
        rows.append((name, "ari", "all", adjusted_rand_index(out["assigned"], split.labels)))
        rows.append((name, "nmi", "all", normalized_mutual_information(out["assigned"], split.labels)))
        if matching is not None:
            rows.append((name, "clustering_accuracy", "all", clustering_accuracy(out["assigned"], split.labels, matching)))
            if k > k_true:  # one-to-one leaves k - k_true clusters without a label: count by majority too
                rows.append((name, "clustering_accuracy_many_to_one", "all",
                             many_to_one_accuracy(out["assigned"], split.labels, matching)))
            recall = per_cluster_accuracy(out["assigned"], split.labels, matching, k_true)
            rows += [(name, "clustering_accuracy", _name(c, label_names), float(v)) for c, v in enumerate(recall)]
    if matching is not None:
        rows += [(fit_split, MATCHED_ADAPTER, _name(c, label_names), float(matching.routing[c])) for c in range(k_true)]
    return pd.DataFrame(rows, columns=["split", "metric", "cluster", "value"])


def _posterior_outputs(scorer: Scorer, alpha: torch.Tensor, split: EvalSplit) -> dict[str, Any]:
    scores = scorer.score(split.inputs, 0)  # [n, k, M]
    check_finite(scores, split.rankings, "evaluation", "The trained adapters' scores are not usable.")
    gamma, ll = mixture_posteriors(scores, split.rankings, alpha)
    return {"scores": scores, "assigned": gamma.argmax(1).numpy(), "ll": ll}


def _ranking_rows(
    split_name: str,
    out: dict[str, Any],
    split: EvalSplit,
    alpha: torch.Tensor,
    matching: ClusterMatching | None,
    k_true: int,
    label_names: list[str] | None,
) -> list[tuple[str, str, str, float]]:
    scores, rankings = out["scores"], split.rankings
    n = scores.shape[0]
    routed = {"posterior": scores[torch.arange(n), torch.as_tensor(out["assigned"])]}
    if matching is not None and split.labels is not None:
        routed["oracle"] = scores[torch.arange(n), torch.as_tensor(matching.routing[split.labels])]
    credits = {variant: score_credit(s) for variant, s in routed.items()}
    credits["leave_pair_out"] = _leave_pair_out_credit(scores, rankings, alpha)
    credits["marginal"] = _mixture_credit(scores, alpha)
    rows = []
    for variant in RANKING_VARIANTS:
        if variant not in credits:
            continue
        acc = pair_accuracy(credits[variant], rankings.tiers, rankings.ranked_prefix).numpy()
        metric = f"ranking_accuracy_{variant}"
        rows.append((split_name, metric, "all", _mean_of_known(acc)))
        if split.labels is not None:
            for c in range(k_true):
                members = split.labels == c
                if members.any():
                    rows.append((split_name, metric, _name(c, label_names), _mean_of_known(acc[members])))
    return rows


def _mean_of_known(accuracy: np.ndarray) -> float:
    """The mean over rankings with a known pair (NaN marks one with none: every response tied); NaN,
    without numpy's empty-slice warning, where no ranking has one."""
    known = accuracy[~np.isnan(accuracy)]
    return float(known.mean()) if known.size else float("nan")


def _leave_pair_out_credit(scores: torch.Tensor, rankings: Rankings, alpha: torch.Tensor) -> torch.Tensor:
    """float64 [n, M, M]: the credit of predicting i above j by the cluster whose posterior, computed
    from the ranking with i and j left out (padding), is largest. Only pairs of ranked slots."""
    n, _, width = scores.shape
    credit = torch.full((n, width, width), 0.5, dtype=torch.float64)
    ranked = ((rankings.tiers != PAD) & (rankings.tiers != UNRANKED)).any(0).nonzero().flatten().tolist()
    rows = torch.arange(n)
    for a, i in enumerate(ranked):
        for j in ranked[a + 1:]:
            tiers = rankings.tiers.clone()
            tiers[:, [i, j]] = PAD
            held_out = Rankings(tiers, rankings.ranked_prefix, model=rankings.model)
            routed = scores[rows, mixture_posteriors(scores, held_out, alpha)[0].argmax(1)]  # [n, M]
            credit[:, i, j] = score_order(routed[:, i], routed[:, j])
            credit[:, j, i] = 1.0 - credit[:, i, j]
    return credit


def _mixture_credit(scores: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """float64 [n, M, M]: the credit of predicting i above j when the mixture's probability that i
    precedes j, sum_c alpha_c sigmoid(r_ci - r_cj), is above 1/2 (0.5 at exactly 1/2). The sigmoid is
    the pairwise marginal of a Plackett-Luce ranking of the whole slate; under the fitted model's
    augmented bottom set (paper eq. 5: the originals above every generated response) the odds of i
    above j in cluster c are (e^r_ci + Z_c) / (e^r_cj + Z_c), Z_c the generated responses' sum of
    e^r, which agree in direction within a cluster but can differ once mixed over clusters."""
    first, second = scores.unsqueeze(3), scores.unsqueeze(2)  # [n, k, M, 1], [n, k, 1, M]
    precedes = torch.sigmoid((first - second).to(torch.float64))  # [n, k, M, M]; NaN only at padding
    probability = torch.einsum("k,nkij->nij", alpha.to(torch.float64), precedes)  # [n, M, M]
    return score_order(probability, torch.full_like(probability, 0.5))  # NaN (padding) credits 0, never counted


EM_START_SPLIT = "train_em"  # not a cache split: EM's own posteriors of the training rankings


def em_start_metrics(start: torch.Tensor, final: torch.Tensor, labels: np.ndarray | None = None,
                     k_true: int | None = None) -> pd.DataFrame:
    """How much of its start EM kept, on the training rankings (split "train_em", cluster "all"; no
    rows for k = 1, which has one partition).

    ``start`` and ``final`` are the responsibilities float64 [n, k] EM started from and ended with.

        start_final_ari             ARI between the two partitions (argmax); 1 = EM ended where it started
        ari_start, ari_final        each partition against the true labels (when known)
        clustering_accuracy_start   each against the true labels under its own Hungarian matching,
        clustering_accuracy_final   fitted on the training rankings (not validation's, as held-out splits)
    """
    k = final.shape[1]
    if k == 1:
        return pd.DataFrame(columns=["split", "metric", "cluster", "value"])
    begin, end = start.argmax(1).numpy(), final.argmax(1).numpy()
    rows = [(EM_START_SPLIT, "start_final_ari", "all", adjusted_rand_index(begin, end))]
    if labels is not None:
        k_true = k_true or int(labels.max()) + 1
        for when, assigned in (("start", begin), ("final", end)):
            rows.append((EM_START_SPLIT, f"ari_{when}", "all", adjusted_rand_index(assigned, labels)))
            matching = fit_matching(assigned, labels, k, k_true)
            accuracy = clustering_accuracy(assigned, labels, matching)
            rows.append((EM_START_SPLIT, f"clustering_accuracy_{when}", "all", accuracy))
    return pd.DataFrame(rows, columns=["split", "metric", "cluster", "value"])


def _name(c: int, label_names: list[str] | None) -> str:
    return label_names[c] if label_names else str(c)


# ---------------------------------------------------------------------------------------------------
# the evaluate stage: a train artifact and its cache in, `evaluation` out (DESIGN 3, 7)

STAGE = "evaluate"
CODE_VERSION = "evaluate-16"  # bump when a change to this stage changes what it writes (8: plots, "|" in labels;
# 9: ranking accuracy leave_pair_out, marginal = the mixture's pairwise probability, non-finite scores refused;
# 10: clustering_accuracy_many_to_one when k exceeds the labels, no clustering rows when k = 1; 11: the report
# says that EM's iterations are numbered from 0, and under which observation model heldout_log_likelihood is;
# metrics.parquet counts each split's rankings, per true cluster too; 12: the report's mixture table; 13: text
# columns as Arrow string, not pandas 3's large_string, and no pandas metadata: `artifacts.writer.arrow_table`;
# 14: assignments.parquet, the held-out rankings' posteriors and scores; 15: a tied last tier of every response
# left adds 0 to the PL likelihood, moplex_core.pl; 16: ARI and NMI NaN where the true labels hold fewer than
# 2 rankings or one label, not sklearn's 1.0)
METRICS_FILE = "metrics.parquet"
ASSIGNMENTS_FILE = "assignments.parquet"
RANKINGS = "rankings"  # the metric that counts a split's rankings (per true cluster too): what each value rests on
METRICS_COLUMNS = ("method", "split", "metric", "cluster", "value", "seed")


@dataclass(frozen=True)
class EvaluatePlan:
    ref: ArtifactRef
    path: Path
    inputs: dict[str, str]  # {"train": "train/<version>", "cache": "cache/<version>"}
    complete: bool


@dataclass(frozen=True)
class EvaluateResult:
    ref: ArtifactRef
    path: Path
    built: bool
    metrics: pd.DataFrame  # METRICS_COLUMNS

    @property
    def report(self) -> Path:
        return self.path / "report.md"


@dataclass(frozen=True)
class _SplitOutputs:
    """Exact scores of one split, computed once and shared by the metrics and the diagnostics."""

    inputs: Any  # PolicyInputs
    clusters: list[str | None]  # each ranking's true label, as the cache holds it
    labels: np.ndarray | None  # int [n]: the labels' indices in the cache's sorted label names
    scores: torch.Tensor  # float64 [n, k, M]
    n_original: np.ndarray  # int [n]


class _ScoredSplits:
    """The Scorer protocol over scores already computed (exact, every response) per split."""

    def __init__(self, k: int, outputs: dict[str, _SplitOutputs]) -> None:
        self.k = k
        self._by_inputs = {id(out.inputs): out.scores for out in outputs.values()}

    def score(self, inputs: Any, iteration: int = 0) -> torch.Tensor:
        return self._by_inputs[id(inputs)]


def plan_evaluate(config: EvaluateConfig, train_dir: str | Path, cache_dir: str | Path,
                  store: ArtifactStore) -> EvaluatePlan:
    from moplex_core.lm.loading import identity_on_this_machine

    train = read_manifest(train_dir)
    cache = read_manifest(cache_dir)
    cache_ref = f"{cache['stage']}/{cache['version']}"
    if train["inputs"].get("cache") != cache_ref:
        raise ValueError(f"{train_dir} was trained on {train['inputs'].get('cache')}, not on {cache_ref} "
                         f"({cache_dir}); evaluate a train artifact with the cache it was trained on")
    inputs = {"train": f"{train['stage']}/{train['version']}", "cache": cache_ref}
    # the trained adapters score in the train config's dtype as it resolves on this machine
    scored_in = identity_on_this_machine({"dtype": train["config"]["dtype"]}, config.device)
    version = store.version(STAGE, {**config.identity(), **scored_in}, inputs, CODE_VERSION)
    return EvaluatePlan(ArtifactRef(STAGE, version), store.path(STAGE, version), inputs,
                        store.is_complete(STAGE, version))


def run_evaluate(config: EvaluateConfig, train_dir: str | Path, cache_dir: str | Path, store: ArtifactStore,
                 plan: EvaluatePlan | None = None, *, model: str | None = None) -> EvaluateResult:
    """Score the held-out splits exactly with the trained adapters and write metrics.parquet,
    assignments.parquet, diagnostics.parquet, report.md and plots/*.png (unless this version exists),
    on the cache's base model, found at ``model`` when given (`cache_model`)."""
    from moplex_core.cache import cache_model, load_policy_inputs
    from moplex_core.lm.loading import resolve_device
    from moplex_core.report import write_report
    from moplex_core.train import load_posteriors, load_trained

    plan = plan or plan_evaluate(config, train_dir, cache_dir, store)
    if plan.complete:
        return EvaluateResult(plan.ref, plan.path, False, pd.read_parquet(plan.path / METRICS_FILE))
    train_dir, cache_dir = Path(train_dir), Path(cache_dir)
    model = cache_model(cache_dir, model)
    scorer, alpha, trained = load_trained(train_dir, model, device=resolve_device(config.device))
    scorer.score_batch_size = config.score_batch_size
    label_names = cache_label_names(cache_dir)
    outputs = {}
    for split in config.splits:
        inputs, clusters = load_policy_inputs(cache_dir, split)
        labels = None if label_names is None or any(c is None for c in clusters) else \
            np.array([label_names.index(c) for c in clusters])
        outputs[split] = _SplitOutputs(inputs, list(clusters), labels, scorer.exact_scores(inputs),
                                       _n_original(cache_dir, inputs.example_ids))
    splits = {name: EvalSplit(out.inputs, out.inputs.rankings(trained.likelihood), out.labels)
              for name, out in outputs.items()}
    metrics = evaluate_mixture(_ScoredSplits(scorer.k, outputs), alpha, splits, label_names, config.fit_split)
    diagnostics = _generated_diagnostics(outputs, splits, alpha, scorer.k)
    seed = read_manifest(train_dir)["config"]["seed"]
    em_result = json.loads((train_dir / "result.json").read_text())
    posteriors = load_posteriors(train_dir)  # (training example ids, EM's start, its final posteriors)
    parts = [metrics, _diagnostic_metrics(diagnostics), em_start_rows(posteriors, cache_dir, label_names),
             estimation_rows(em_result.get("estimation_check"),  # absent before train-8
                             em_result.get("fell_back"))]  # absent before train-9
    # An empty part would turn the string columns into objects: the result would not equal metrics.parquet read back.
    metrics = pd.concat([part for part in parts if not part.empty], ignore_index=True)
    metrics.insert(0, "method", config.method)
    metrics["seed"] = seed
    metrics = metrics[list(METRICS_COLUMNS)]
    confusion = {name: _posterior_confusion(out, alpha, splits[name], label_names) for name, out in outputs.items()
                 if out.labels is not None}
    with store.writer(STAGE, plan.ref.version, config=config.model_dump(mode="json"), inputs=plan.inputs,
                      code_version=CODE_VERSION) as writer:
        if writer.complete:
            return EvaluateResult(plan.ref, plan.path, False, pd.read_parquet(plan.path / METRICS_FILE))
        writer.write_table(METRICS_FILE, metrics)
        writer.write_table(ASSIGNMENTS_FILE, pa.concat_tables(
            assignment_table(out.inputs, [name] * len(out.clusters), out.clusters, out.scores, splits[name].rankings,
                             alpha) for name, out in outputs.items()))
        if not diagnostics.empty:
            writer.write_table("diagnostics.parquet", diagnostics)
        write_report(writer, metrics, diagnostics, em_result, confusion, plan.inputs, trained.likelihood,
                     mixture_table(alpha, posteriors[2]))
        writer.summary.update({"metrics": len(metrics), "splits": list(config.splits), "method": config.method})
    return EvaluateResult(plan.ref, plan.path, True, metrics)


def mixture_table(alpha: torch.Tensor, gamma: torch.Tensor) -> pd.DataFrame:
    """The fitted mixture, one row per adapter (index ``adapter``): its mixing weight (``alpha`` [k],
    as `load_trained` gives it), the training rankings whose final posterior ``gamma`` (float64 [n, k],
    `load_posteriors`) puts them on it (argmax, ties to the lower index) and their mean posterior
    there (NaN for an adapter that holds none)."""
    assigned = gamma.argmax(1)  # [n]
    rows = []
    for c, weight in enumerate(alpha.tolist()):
        held = gamma[assigned == c, c]  # [n_c]
        rows.append({"adapter": f"c{c}", "alpha": weight, "training rankings": int(held.numel()),
                     "mean posterior": float(held.mean()) if held.numel() else float("nan")})
    return pd.DataFrame(rows).set_index("adapter")


def em_start_rows(posteriors: tuple[tuple[str, ...], torch.Tensor | None, torch.Tensor], cache_dir: str | Path,
                  label_names: list[str] | None) -> pd.DataFrame:
    """em_start_metrics of a train artifact's `load_posteriors`, with the labels of its cache
    (`cache_label_names`) when given; no rows for artifacts that did not keep their start."""
    example_ids, start, final = posteriors
    if start is None:
        return pd.DataFrame(columns=["split", "metric", "cluster", "value"])
    labels = None
    if label_names is not None:
        table = load_table(cache_dir, columns=["example_id", "cluster"]).to_pydict()
        by_id = dict(zip(table["example_id"], table["cluster"], strict=True))
        labels = np.array([label_names.index(by_id[e]) for e in example_ids])
    return em_start_metrics(start, final, labels, len(label_names) if label_names else None)


def estimation_rows(check: dict[str, Any] | None, fell_back: dict[str, Any] | None = None) -> pd.DataFrame:
    """The train stage's check of the anchors' estimates (`train.check_estimates`) as rows of split
    ``train_em``: estimates_relative_error (NaN for a zero spread) and estimates_same_cluster, and
    exact_fallback_iteration, the E-step at which EM switched to exact scores (`train.exact_fallback`),
    when it did."""
    rows = []
    if check is not None:
        relative = float("nan") if check["relative_error"] is None else check["relative_error"]
        rows += [("estimates_relative_error", relative), ("estimates_same_cluster", check["same_cluster"])]
    if fell_back is not None:
        rows.append(("exact_fallback_iteration", float(fell_back["iteration"])))
    metric, value = zip(*rows) if rows else ((), ())
    return pd.DataFrame({"split": EM_START_SPLIT, "metric": list(metric), "cluster": "all", "value": list(value)},
                        columns=["split", "metric", "cluster", "value"])


def cache_label_names(cache_dir: str | Path) -> list[str] | None:
    """The true cluster labels in the cache (all splits), sorted; None when any ranking has none."""
    clusters = load_table(cache_dir, columns=["cluster"]).column("cluster").to_pylist()
    if not clusters or any(c is None for c in clusters):
        return None
    return sorted(set(clusters))


def _n_original(cache_dir: Path, example_ids: tuple[str, ...]) -> np.ndarray:
    table = load_table(cache_dir, columns=["example_id", "n_original"]).to_pydict()
    by_id = dict(zip(table["example_id"], table["n_original"], strict=True))
    return np.array([by_id[e] for e in example_ids])


def _generated_diagnostics(outputs: dict[str, _SplitOutputs], splits: dict[str, EvalSplit], alpha: torch.Tensor,
                           k: int) -> pd.DataFrame:
    """generated_score_diagnostics per split, rankings grouped by their EM cluster (argmax gamma).

    Needs generated responses and one m for the whole split; splits without either are left out.
    """
    frames = []
    for name, out in outputs.items():
        m = set(out.n_original.tolist())
        if len(m) != 1 or out.scores.shape[2] <= min(m):
            continue
        scores = out.scores.clone()
        scores[(out.inputs.tiers == PAD).unsqueeze(1).expand_as(scores)] = float("nan")  # missing generated
        gamma, _ = mixture_posteriors(out.scores, splits[name].rankings, alpha)
        frame = generated_score_diagnostics(scores, m.pop(), gamma.argmax(1), [f"adapter c{c}" for c in range(k)])
        frames.append(frame.assign(split=name))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _diagnostic_metrics(diagnostics: pd.DataFrame) -> pd.DataFrame:
    if diagnostics.empty:
        return pd.DataFrame(columns=["split", "metric", "cluster", "value"])
    long = diagnostics.melt(id_vars=["split", "cluster"], value_vars=["below_all_originals", "all_distinct_fraction", "cv"],
                            var_name="metric", value_name="value")
    long["metric"] = "generated_" + long["metric"]
    return long[["split", "metric", "cluster", "value"]]


def _posterior_confusion(out: _SplitOutputs, alpha: torch.Tensor, split: EvalSplit,
                         label_names: list[str] | None) -> pd.DataFrame:
    """Mean posterior gamma per true label (rows) and EM cluster (columns)."""
    gamma, _ = mixture_posteriors(out.scores, split.rankings, alpha)
    names = label_names or [str(c) for c in range(int(out.labels.max()) + 1)]
    frame = pd.DataFrame(gamma.numpy(), columns=[f"c{c}" for c in range(gamma.shape[1])])
    frame["true"] = [names[c] for c in out.labels]
    return frame.groupby("true").mean().reindex(names)
