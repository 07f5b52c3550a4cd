"""Baselines and ablations as presets of one engine, and the comparison report (paper Tables 3, 4).

A *method* (moplex_core.methods.METHODS) is a list of ``key=value`` overrides applied to a base pipeline config (a `PipelineConfig`
whose train/augment settings are MoPLEx itself: generated responses and a < m' anchors). Every
method runs the same ingest and tiny model artifacts, and one of two caches (the store reuses them):
the augmented rankings', or, for the methods without generated responses (``augment=null``), the
rankings' alone; train and evaluate are each method's. Seeds vary ``train.seed``: the LoRA
initialisation, the EM start, the M-step shuffling and the anchor draws; the data and the generated
responses stay fixed.

    method       paper row                   what changes from the base (MoPLEx)
    dpo          DPO                         k = 1, Bradley-Terry over pairs, no generated responses, exact
    single_pl    LiPO (list MLE)             k = 1, no generated responses, exact
    mixture_bt   EM-DPO                      soft EM over pairs, no generated responses, exact
    maxmin_bt    MaxMin-RLHF                 hard EM over pairs by the likelihood alone, no generated responses, exact
    moplex       MoPLEx (Alg. 2)             -
    no_pl        w/o Plackett-Luce models    Bradley-Terry over pairs (generated responses kept)
    no_aug       w/o generated responses     no generated responses
    k1           w/o mixture models          k = 1
    full         w/o gradient estimation     a = m' (every response exact)
    guarded      (not in the paper)          exact fallback once the estimates fail (train.exact_fallback=0.5)

MiCRo (the paper's third mixture-of-BT baseline: a BT mixture with a learned context router) has
no preset: its router is a separate model, not a setting of this engine.

The report (`write_comparison`) is a `compare` artifact: comparison.parquet (every run's metric
rows), report.md with the two tables and plots/comparison.png.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moplex_core.artifacts import ArtifactRef, ArtifactStore, read_manifest
from moplex_core.config import PipelineConfig
from moplex_core.methods import METHODS, method_config
from moplex_core.evaluate import EM_START_SPLIT, MATCHED_ADAPTER, METRICS_FILE, RANKING_VARIANTS, RANKINGS
from moplex_core.display import markdown_cell
from moplex_core.report import markdown_table, png_bytes

STAGE = "compare"
CODE_VERSION = "compare-10"  # bump when a change here changes what the report holds (5: NaN cells as -;
# 6: how much the test sample's rankings alone move a value, `sampling_note`; 7: comparison.parquet's text
# columns as Arrow string, without pandas metadata; 8: the Runs table names each evaluation as
# evaluate/VERSION, not by its absolute path, so the report's bytes do not depend on where the root is; 9: the
# split the evaluations fitted their matching on, not "validation" whatever it was; the sampling note says
# that ranking accuracy rests on the rankings with a known pair; 10: the start section says every mixture
# starts from the same train.init, MoPLEx's, which the baselines' papers do not have)
SPLIT = "test"


def plan_runs(base: PipelineConfig, methods: list[str], seeds: list[int]) -> list[tuple[str, int, PipelineConfig]]:
    """(method, seed, config) of every run, methods in the given order, seeds inner."""
    if not methods or not seeds or len(set(methods)) != len(methods) or len(set(seeds)) != len(seeds):
        raise ValueError(f"need distinct methods and seeds, got methods {methods} and seeds {seeds}")
    if base.fault.stage is not None:
        # A retried compare run starts new pipeline subflow runs, each counting its runs from 1.
        raise ValueError(f"fault.stage = {base.fault.stage!r} would fail every retry of a comparison (each retry "
                         "starts new pipeline runs, whose first runs fail); try retries on one pipeline run "
                         "(moplex run, or the moplex-pipeline deployment), or set fault.stage to null")
    return [(method, seed, method_config(base, method, seed)) for method in methods for seed in seeds]


def collect_metrics(evaluations: list[tuple[str, int, str | Path]]) -> pd.DataFrame:
    """Every run's metrics.parquet (method, split, metric, cluster, value, seed) in one frame."""
    frames = [pd.read_parquet(Path(path) / METRICS_FILE) for _, _, path in evaluations]
    return pd.concat(frames, ignore_index=True)


AVERAGE = "Average"


def seed_statistics(metrics: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean, std (sample; NaN for one seed) and count over seeds of one metric on the ``SPLIT``
    rankings, per method and true cluster, plus ``AVERAGE``: per seed the mean of the per-cluster values (every cluster weighted
    alike, as the paper's tables average their columns), or the all-rankings value of a method that
    has no per-cluster rows (no labels)."""
    rows = metrics[(metrics.metric == metric) & (metrics.split == SPLIT)]
    per_cluster = rows[rows.cluster != "all"]
    averages = per_cluster.groupby(["method", "seed"], sort=False)["value"].mean().reset_index()
    unlabelled = rows[(rows.cluster == "all") & ~rows.method.isin(per_cluster.method)]
    combined = pd.concat([per_cluster, averages.assign(cluster=AVERAGE), unlabelled.assign(cluster=AVERAGE)])
    stats = combined.groupby(["method", "cluster"], sort=False)["value"].agg(["mean", "std", "count"])
    return stats.reset_index()


def _averages(metrics: pd.DataFrame, metric: str) -> pd.DataFrame:
    """seed_statistics' AVERAGE rows, indexed by method."""
    stats = seed_statistics(metrics, metric)
    return stats[stats.cluster == AVERAGE].set_index("method")


def _cell(mean: float, std: float) -> str:
    """A percentage, mean ± std over seeds; "-" where every seed's value is NaN (evaluate writes NaN
    for a label with no rankings in the split)."""
    if np.isnan(mean):
        return "-"
    return f"{100 * mean:.1f}" if np.isnan(std) else f"{100 * mean:.1f} ± {100 * std:.1f}"


def summary_shape(metrics: pd.DataFrame, dataset: str) -> str:
    """Paper Table 3's shape: clustering accuracy of the mixture methods, then the ranking accuracy
    (posterior-routed, the paper's number) of every method, on one dataset, and the same routed
    without the pair predicted (leave pair out, which k alone does not raise); % mean ± std over seeds."""
    methods = list(dict.fromkeys(metrics.method))
    lines = [f"| Methods | {dataset} |", "|---|---|", "| **Clustering accuracy** | |"]
    clustering = _averages(metrics, "clustering_accuracy")
    lines += [f"| {_label(m)} | {_cell(*clustering.loc[m, ['mean', 'std']])} |" for m in methods
              if _is_mixture(m) and m in clustering.index]
    for variant, title in (("posterior", "Ranking accuracy"), ("leave_pair_out", "Ranking accuracy, leave pair out")):
        lines.append(f"| **{title}** | |")
        ranking = _averages(metrics, f"ranking_accuracy_{variant}")
        lines += [f"| {_label(m)} | {_cell(*ranking.loc[m, ['mean', 'std']])} |" for m in methods if m in ranking.index]
    return "\n".join(lines)


def per_cluster_shape(metrics: pd.DataFrame, metric: str = "ranking_accuracy_posterior") -> str:
    """Paper Table 4's shape: ``metric`` per true cluster and their average, one row per method
    (only the mixtures for clustering accuracy)."""
    stats = seed_statistics(metrics, metric)
    if metric == "clustering_accuracy":
        stats = stats[[_is_mixture(m) for m in stats.method]]
    clusters = [c for c in dict.fromkeys(stats.cluster) if c != AVERAGE] + [AVERAGE]
    lines = ["| method | " + " | ".join(map(markdown_cell, clusters)) + " |", "|---|" + "---|" * len(clusters)]
    for method, group in stats.groupby("method", sort=False):
        by_cluster = group.set_index("cluster")
        cells = [_cell(*by_cluster.loc[c, ["mean", "std"]]) if c in by_cluster.index else "-" for c in clusters]
        lines.append(f"| {_label(method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def em_start_table(metrics: pd.DataFrame) -> str:
    """Per method with ``train_em`` rows (evaluate's, on the training rankings): clustering accuracy
    of the partition EM started from and of the one it ended with (each under its own matching), the
    ARI between the two (mixtures only), for runs with anchors the train stage's check of their
    estimates (`train.check_estimates`), and in how many seeds and at which E-steps EM fell back to
    exact scores (`train.exact_fallback`); mean ± std over seeds, "-" where a method has no such row.
    Empty when no run has train_em rows."""
    rows = metrics[metrics.split == EM_START_SPLIT]
    if rows.empty:
        return ""
    stats = rows.groupby(["method", "metric"], sort=False)["value"].agg(["mean", "std"])
    lines = ["| method | clustering accuracy % at the start | clustering accuracy % at the end | ARI start-end | "
             "estimates' relative error | % keeping their cluster under exact scores | exact fallback |",
             "|---|---|---|---|---|---|---|"]
    columns = [("clustering_accuracy_start", _cell), ("clustering_accuracy_final", _cell),
               ("start_final_ari", _plain_cell), ("estimates_relative_error", _plain_cell),
               ("estimates_same_cluster", _cell)]  # a k = 1 run (k1) has the estimates' check only
    for method in dict.fromkeys(rows.method):
        cells = [cell(*stats.loc[(method, metric)]) if (method, metric) in stats.index else "-"
                 for metric, cell in columns]
        lines.append(f"| {_label(method)} | " + " | ".join(cells + [_fallback_cell(metrics, method)]) + " |")
    return "\n".join(lines)


def _fallback_cell(metrics: pd.DataFrame, method: str) -> str:
    """'n of N seeds, at E-step i, j, ...' for a method's exact_fallback_iteration rows; '-' without."""
    runs = metrics[metrics.method == method]
    steps = runs.value[(runs.split == EM_START_SPLIT) & (runs.metric == "exact_fallback_iteration")]
    if steps.empty:
        return "-"
    at = ", ".join(str(int(step)) for step in sorted(steps))
    return f"{len(steps)} of {runs.seed.nunique()} seeds, at E-step {at}"


def _plain_cell(mean: float, std: float) -> str:
    """As `_cell`, unscaled (evaluate writes NaN for an estimates' error over scores with no spread)."""
    if np.isnan(mean):
        return "-"
    return f"{mean:.2f}" if np.isnan(std) else f"{mean:.2f} ± {std:.2f}"


def all_variants_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Every headline metric (columns) per method (rows), mean over seeds, as fractions; the
    clustering columns NaN ("-") for a single-cluster method, where they mean nothing."""
    overall = metrics[(metrics.split == SPLIT) & (metrics.cluster == "all")]
    columns = ["clustering_accuracy", "ari", "nmi", *(f"ranking_accuracy_{v}" for v in RANKING_VARIANTS)]
    table = overall.pivot_table(index="method", columns="metric", values="value", aggfunc="mean", sort=False)
    table = table[[c for c in columns if c in table.columns]]
    clustering = [c for c in ("clustering_accuracy", "ari", "nmi") if c in table.columns]
    table.loc[[m for m in table.index if not _is_mixture(m)], clustering] = np.nan
    return table


def _is_mixture(method: str) -> bool:
    """Whether clustering accuracy means anything for ``method`` (k > 1)."""
    return METHODS[method].is_mixture if method in METHODS else True


def _label(method: str) -> str:
    return f"{METHODS[method].paper} (`{method}`)" if method in METHODS else method


def sampling_note(metrics: pd.DataFrame) -> str:
    """The standard error the sampling of the ``SPLIT`` rankings gives a value, which the ± over seeds
    leaves out: a mean over n independent rankings of a value in [0, 1] (a ranking's clustering hit,
    its fraction of pairs ordered right) has at most 0.5 / sqrt(n); the Average over K clusters at most
    the mean of its clusters' bounds, however they correlate (UltraFeedback's criteria share prompts).
    "" without the counts (evaluations before evaluate-11)."""
    counts = metrics[(metrics.metric == RANKINGS) & (metrics.split == SPLIT)]
    if counts.empty:
        return ""
    first = counts[(counts.method == counts.method.iloc[0]) & (counts.seed == counts.seed.iloc[0])]  # one data set
    total = int(first[first.cluster == "all"].value.item())
    per_cluster = {c: int(n) for c, n in zip(first.cluster, first.value, strict=True) if c != "all" and n > 0}
    note = f"The {SPLIT} split holds {total} rankings"
    bounds = f"{50 / np.sqrt(total):.1f} points on all of them"
    if per_cluster:
        note += " (" + ", ".join(f"{c} {n}" for c, n in per_cluster.items()) + ")"
        one = [50 / np.sqrt(n) for n in per_cluster.values()]
        bounds += (f", {np.mean(one):.1f} on the Average over clusters, {min(one):.1f} to {max(one):.1f} on one "
                   "cluster")
    return (note + ". The sampling of these rankings gives a value a standard error of up to " + bounds
            + " (at 50%: a mean over n independent rankings of a value in [0, 1] has at most 50 / sqrt(n); rankings "
            "that share a prompt, as UltraFeedback's criteria do, are not independent, and the bound on all of them "
            "is then larger; ranking accuracy rests only on the rankings that order at least one pair, so where "
            "some tie every response its n is smaller and its bound larger). The ± here are over seeds on this one "
            "sample and leave that out.")


def chance_level(metrics: pd.DataFrame) -> float | None:
    """Clustering accuracy of a constant guess, 1 / (number of true labels); None without labels.
    The labels are the clusters of the clustering_accuracy rows (other rows, such as the generated-
    response diagnostics, are per EM cluster)."""
    labels = set(metrics.cluster[metrics.metric == "clustering_accuracy"]) - {"all"}
    return 1 / len(labels) if labels else None


def comparison_plot(metrics: pd.DataFrame, chance: float | None) -> bytes:
    """Two bar panels with std error bars: clustering accuracy (mixture methods) and ranking
    accuracy (leave pair out, every method: routed without the pair it predicts, so that methods
    with more clusters gain nothing from the routing alone)."""
    figure = Figure(figsize=(10, 3.8))
    axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.5]})
    for ax, metric, title in ((axes[0], "clustering_accuracy", "clustering accuracy"),
                              (axes[1], "ranking_accuracy_leave_pair_out", "ranking accuracy (leave pair out)")):
        stats = _averages(metrics, metric).reset_index()
        if metric == "clustering_accuracy":
            stats = stats[[_is_mixture(m) for m in stats.method]]
        x = np.arange(len(stats))
        ax.bar(x, 100 * stats["mean"], yerr=100 * stats["std"].fillna(0.0), capsize=3,
               color=["tab:orange" if m == "moplex" else "tab:blue" for m in stats.method])
        ax.set_xticks(x, stats.method, rotation=35, ha="right")
        ax.set_ylim(0, 100)
        ax.set_ylabel(f"% ({SPLIT})")
        ax.set_title(title)
        if metric == "clustering_accuracy" and chance is not None:
            ax.axhline(100 * chance, color="grey", linestyle="--", linewidth=1)
            ax.text(len(stats) - 0.5, 100 * chance + 1, "chance", ha="right", fontsize=7, color="grey")
    figure.tight_layout()
    return png_bytes(figure)


def write_comparison(store: ArtifactStore, dataset: str, evaluations: list[tuple[str, int, str | Path]],
                     overrides: list[str] | None = None) -> Path:
    """The `compare` artifact of these evaluations ((method, seed, evaluate folder) each); returns its folder.

    The version hashes the dataset name, methods, seeds and the ``overrides`` the base config was made
    with (``--set`` values, named in the report; ``root=`` says where, not what, and is left out); the
    evaluate artifacts are its inputs and pin everything else, so a rerun that reuses every stage
    reuses the report too.
    """
    inputs = {}
    for method, seed, path in evaluations:
        manifest = read_manifest(path)
        inputs[f"{method}/seed{seed}"] = f"{manifest['stage']}/{manifest['version']}"
    methods = list(dict.fromkeys(m for m, _, _ in evaluations))
    seeds = sorted({seed for _, seed, _ in evaluations})
    identity = {"dataset": dataset, "methods": methods, "seeds": seeds}
    changed = [o for o in overrides or [] if not o.startswith("root=")]  # where it is stored, not what
    if changed:  # without any, the identity holds what it held before overrides were recorded
        identity["overrides"] = changed
    ref = ArtifactRef(STAGE, store.version(STAGE, identity, inputs, CODE_VERSION))
    if store.is_complete(STAGE, ref.version):
        return store.path(STAGE, ref.version)
    metrics = collect_metrics(evaluations)
    chance = chance_level(metrics)
    with store.writer(STAGE, ref.version, config=identity, inputs=inputs, code_version=CODE_VERSION) as writer:
        if not writer.complete:
            writer.write_table("comparison.parquet", metrics)
            writer.write_file("plots/comparison.png", comparison_plot(metrics, chance))
            refs = [(method, seed, inputs[f"{method}/seed{seed}"]) for method, seed, _ in evaluations]
            writer.write_file("report.md", _report(metrics, dataset, seeds, refs, chance, changed))
            writer.summary.update(identity)
    return store.path(STAGE, ref.version)


def _report(metrics: pd.DataFrame, dataset: str, seeds: list[int], evaluations: list[tuple[str, int, str]],
            chance: float | None, overrides: list[str]) -> str:
    """The report; ``evaluations`` are (method, seed, ``evaluate/VERSION``), named so under the root."""
    methods = list(dict.fromkeys(m for m, _, _ in evaluations))
    chance_note = f"; chance clustering accuracy is {100 * chance:.1f}%. " if chance else ". "
    fits = sorted(set(metrics.split[metrics.metric == MATCHED_ADAPTER]))  # where each evaluation fitted its matching
    in_sample = (f" (the {SPLIT} split itself, for a source without another: its clustering accuracy and "
                 "oracle ranking accuracy are in-sample, upper bounds)") if SPLIT in fits else ""
    matched = (f"Cluster ids are matched to the true labels on {' and '.join(fits)}{in_sample}" if fits
               else "No cluster is matched to a label")
    changed = ("The base config was changed by " + ", ".join(f"`{o}`" for o in overrides)
               + "; every method below is that base with its own overrides.") if overrides else ""
    lines = [
        f"# moplex method comparison on `{dataset}`",
        "",
        *([changed, ""] if changed else []),
        f"{len(methods)} methods x {len(seeds)} seeds (train.seed = {', '.join(map(str, seeds))}), {SPLIT} split; "
        "% mean ± std over seeds (sample std). " + matched + chance_note + "Ranking accuracy is routed by each ranking's own posterior (the paper's number, which "
        "a method with more clusters raises by routing alone) and, in the Table 3 shape and the plot, without the "
        "pair it predicts (leave pair out, the number to compare methods by); the oracle and marginal variants "
        "are in the last table and in comparison.parquet. In the Table 3 and 4 "
        "shapes a method's value is, per seed, the mean over the true clusters (each cluster weighted alike, as "
        "the paper's tables average their columns); the last table's are over all rankings, as in each run's "
        "own report.",
        "",
        *([note, ""] if (note := sampling_note(metrics)) else []),
        "## Paper Table 3 shape",
        "",
        summary_shape(metrics, dataset),
        "",
        "![comparison](plots/comparison.png)",
        "",
        "## What EM kept of its start (training rankings)",
        "",
        "Every mixture starts from the same `train.init` (by default `linearized`, a linear Plackett-Luce mixture "
        "over the base model's output-layer gradients: MoPLEx's start, which the baselines' own papers do not "
        "have), under its own likelihood; the start column says how much of a method's clustering it owes "
        "to that start.",
        "",
        em_start_table(metrics) or ("No run has a start to compare with: k = 1 methods have none, and train "
                                    "artifacts before train-5 did not keep it."),
        "",
        "## Paper Table 4 shape: ranking accuracy per true cluster",
        "",
        per_cluster_shape(metrics),
        "",
        "## Clustering accuracy per true cluster (recall of each label)",
        "",
        per_cluster_shape(metrics, "clustering_accuracy"),
        "",
        "## Every headline metric (mean over seeds, fractions)",
        "",
        markdown_table(all_variants_table(metrics)),
        "",
        "## Methods",
        "",
        "| method | paper row | overrides of the base config | what it is |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{m}` | {METHODS[m].paper} | {', '.join(f'`{o}`' for o in METHODS[m].overrides) or '-'} | "
              f"{METHODS[m].description} |" for m in methods if m in METHODS]
    lines += ["", "## Runs", "", "| method | seed | evaluation (under the root) |", "|---|---|---|"]
    lines += [f"| {m} | {s} | `{p}` |" for m, s, p in evaluations]
    return "\n".join(lines) + "\n"
