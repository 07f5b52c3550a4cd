"""The evaluation report: report.md and its PNG plots, written into an `evaluate` artifact.

    plots/cluster_accuracy.png   per true cluster: clustering accuracy and the labelled ranking
                                 accuracies (evaluate.RANKING_VARIANTS), on the last split
                                 that did not fit the matching (the fit split when it is the only one)
    plots/em_log_likelihood.png  training log-likelihood per ranking at every EM iteration
    plots/confusion_<split>.png  mean posterior gamma per true label (rows) and EM cluster (columns)

Plots are drawn with matplotlib's object API (no pyplot, no global backend): a library must not
change the process's plotting state.
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moplex_core.display import markdown_cell
from moplex_core.em import estimates_off_by, likelihood_falls
from moplex_core.evaluate import EM_START_SPLIT, MATCHED_ADAPTER, RANKING_VARIANTS, RANKINGS

HEADLINE = ("clustering_accuracy", "clustering_accuracy_many_to_one", "ari", "nmi",
            *(f"ranking_accuracy_{v}" for v in RANKING_VARIANTS),
            "heldout_log_likelihood")
ESTIMATION_ROWS = ("estimated_entries", "mean_abs_error", "score_spread", "relative_error", "same_cluster",
                   "log_likelihood_estimated", "log_likelihood_exact")


def headline_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """The averages ("all" rows): one row per metric, one column per split, in HEADLINE order (the
    rankings' counts are said apart, `ranking_counts`)."""
    averages = metrics[(metrics.cluster == "all") & (metrics.metric != RANKINGS)]
    overall = averages.pivot_table(index="metric", columns="split", values="value", sort=False,
                                   dropna=False)  # NaN shows as -
    order = [m for m in HEADLINE if m in overall.index]
    return overall.loc[order + [m for m in overall.index if m not in order]]


def ranking_counts(metrics: pd.DataFrame, split: str | None = None) -> str:
    """How many rankings the values rest on: per split ("validation 60, test 60"), or per true cluster
    of ``split`` ("c0 15, c1 25"); "" where evaluate did not count them (before evaluate-11). A line of
    report.md: a true label in it is shown as its text (`markdown_cell`), as in the tables."""
    rows = metrics[metrics.metric == RANKINGS]
    rows = rows[rows.cluster == "all"] if split is None else rows[(rows.split == split) & (rows.cluster != "all")]
    names = rows.split if split is None else rows.cluster
    return ", ".join(f"{markdown_cell(name)} {int(n)}" for name, n in zip(names, rows.value, strict=True))


def per_cluster_table(metrics: pd.DataFrame, split: str) -> pd.DataFrame:
    """Per true cluster of ``split``: clustering accuracy and ranking accuracies (columns)."""
    rows = metrics[(metrics.split == split) & (metrics.cluster != "all")
                   & ~metrics.metric.str.startswith("generated_")]
    # a label with no rankings in the split (NaN) stays, as "-", rather than leaving the table
    table = rows.pivot_table(index="cluster", columns="metric", values="value", sort=False, dropna=False)
    return table[[m for m in HEADLINE if m in table.columns]]


def write_report(writer, metrics: pd.DataFrame, diagnostics: pd.DataFrame, em_result: dict[str, Any],
                 confusion: dict[str, pd.DataFrame], inputs: dict[str, str], likelihood: str,
                 mixture: pd.DataFrame) -> None:
    """report.md and plots/*.png into an open ArtifactWriter of the evaluate stage; ``em_result`` is
    the train artifact's result.json, ``likelihood`` its observation model (train.likelihood),
    ``mixture`` its adapters' weights and training rankings (`moplex_core.evaluate.mixture_table`)."""
    history, halvings = em_result["history"], em_result.get("step_halvings", [])  # absent before train-8
    start_rows = metrics[metrics.split == EM_START_SPLIT]
    metrics = metrics[metrics.split != EM_START_SPLIT]
    matched = metrics[metrics.metric == MATCHED_ADAPTER]
    metrics = metrics[metrics.metric != MATCHED_ADAPTER]
    splits = list(dict.fromkeys(metrics.split))
    fit = matched.split.iloc[0] if not matched.empty else None
    outside = [name for name in splits if name != fit]  # the per-cluster view: a split that did not fit the matching
    last = outside[-1] if outside else splits[-1]
    method = metrics["method"].iloc[0]
    clusters = per_cluster_table(metrics, last)
    # The plots' labels are a dataset's text: "$\frac$" or "$5_$" there is not TeX for matplotlib to parse
    # (a ValueError that failed the stage).
    with matplotlib.rc_context({"text.parse_math": False}):
        plots = {"em_log_likelihood.png": _log_likelihood_plot(history)}
        if not clusters.empty:
            plots["cluster_accuracy.png"] = _cluster_accuracy_plot(clusters, last)
        plots.update({f"confusion_{name}.png": _confusion_plot(frame, name) for name, frame in confusion.items()})
    for name, png in plots.items():
        writer.write_file(f"plots/{name}", png)

    lines = [
        f"# moplex evaluation: {method}",
        "",
        "Inputs: " + ", ".join(f"{k} `{v}`" for k, v in inputs.items()) + f"; seed {int(metrics['seed'].iloc[0])}.",
        "",
        "Exact scores of every response. "
        + (f"Cluster ids are matched to the true labels (Hungarian) on `{fit}` and the matching is applied to every "
           f"split (so `{fit}`'s own clustering accuracy is in-sample); with more clusters than labels, "
           "`clustering_accuracy_many_to_one` also gives each cluster its majority label there. " if fit is not None else
           "The rankings carry no cluster labels: no clustering accuracy and no oracle routing. ")
        + "Ranking accuracy is, averaged over rankings, the fraction of a ranking's known pairs of original "
        "responses (different tiers; with a top-l ranking also a top item against one below it) that the scores "
        "order correctly, with each ranking scored by: `posterior` its own argmax-gamma cluster (gamma computed "
        "from that ranking, the paper's number, optimistic: it gains with k even from adapters that know "
        "nothing), `leave_pair_out` for each pair the argmax-gamma cluster of the ranking without that pair, "
        "`oracle` the cluster matched to its true label, `marginal` the mixture's probability that one "
        "response precedes the other (sum over clusters of alpha times its pairwise probability; no label, no "
        "ranking). Rows `all` average over rankings; the paper's average over clusters is the mean of the "
        "per-cluster rows. `heldout_log_likelihood` is the mixture's log-likelihood per ranking under this run's "
        + ("Plackett-Luce model" if likelihood == "pl" else "product of each ranking's Bradley-Terry pair probabilities")
        + " over the slates as cached (generated responses, where there are any, in every denominator): compare it "
        "only between runs of one observation model (train.likelihood) on the same slates.",
        "",
        *([f"Which adapter serves which true label (the matching fitted on `{fit}`):", "",
           markdown_table(pd.DataFrame({"adapter": [f"c{int(v)}" for v in matched.value]},
                                       index=pd.Index(matched.cluster, name="true label"))), ""]
          if fit is not None else []),
        "## Overall",
        "",
        markdown_table(headline_table(metrics)),
        "",
        *([f"Rankings: {totals}.", ""] if (totals := ranking_counts(metrics)) else []),
        "## The mixture",
        "",
        "Each adapter's mixing weight alpha and the training rankings EM's final posteriors put on it (argmax "
        "gamma), with their mean posterior there (1: no doubt; 1/k: none told apart).",
        "",
        markdown_table(mixture),
        "",
    ]
    if not clusters.empty:
        counts = ranking_counts(metrics, last)
        lines += [f"## Per cluster ({last}{', in-sample: the split the matching was fitted on' if last == fit else ''})",
                  "", markdown_table(clusters), "", *([f"Rankings per true cluster: {counts}.", ""] if counts else []),
                  "![per-cluster accuracy](plots/cluster_accuracy.png)", ""]
    lines += ["## EM training log-likelihood", "",
              f"{len(history)} iteration(s), numbered from 0 as the train log and `em/restart-RR/iter-NNNN` number "
              "them; log-likelihood per training ranking: "
              + ", ".join(f"{v:.4f}" for v in history), ""]
    fell_back = em_result.get("fell_back")
    falls = likelihood_falls(history, None if fell_back is None else fell_back["iteration"])
    if falls:
        lines += [f"It fell at iteration(s) {', '.join(map(str, falls))}. Soft EM does not lower it unless an M-step "
                  "lowers its own "
                  "weighted objective: steps too large (`train.lr`; `train.backtracks` redoes such an M-step at "
                  "half the rate) or too few to recover (`train.epochs`); "
                  "estimated scores (anchors) add noise, and hard EM (`train.hard`) may lower it.", ""]
    redone = [f"{t} ({h}x)" for t, h in enumerate(halvings) if h]
    if redone:
        lines += [f"The M-step was redone at half its learning rate (`train.backtracks`), at iteration(s) "
                  f"{', '.join(redone)} (times halved), because the log-likelihood had fallen after it; once the "
                  "halvings are spent the last attempt is kept, fallen or not.", ""]
    lines += ["![EM log-likelihood](plots/em_log_likelihood.png)", ""]
    lines += _estimation_section(em_result.get("estimation_check"), fell_back)
    lines += _em_start_section(start_rows)
    for name in confusion:
        lines += [f"## Posterior confusion ({name})", "", "Mean gamma per true label (rows) and EM cluster (columns).",
                  "", f"![posterior confusion {name}](plots/confusion_{name}.png)", ""]
    if not diagnostics.empty:
        lines += ["## Generated responses (paper 4.1)", "",
                  "Per EM cluster (rankings grouped by argmax gamma), that cluster's exact scores: the fraction of "
                  "generated responses scored below every original, the fraction of rankings whose generated "
                  "scores are pairwise distinct (Proposition 2's assumption), and their coefficient of variation.",
                  "", markdown_table(diagnostics.set_index(["split", "cluster"])), ""]
    writer.write_file("report.md", "\n".join(lines))


def _em_start_section(rows: pd.DataFrame) -> list[str]:
    """What EM kept of the responsibilities it started from, on the training rankings (none for k = 1,
    whose ``train_em`` rows are the estimation check's alone)."""
    value = rows.set_index("metric").value
    if "start_final_ari" not in value:
        return []
    lines = ["## EM's start and end (training rankings)", "",
             f"Adjusted Rand index between the partition EM started from (argmax of its initial "
             f"responsibilities) and the one it ended with: {value['start_final_ari']:.4f} (1 = unchanged).", ""]
    if "clustering_accuracy_start" in value:
        table = pd.DataFrame({when: [value[f"clustering_accuracy_{when}"], value[f"ari_{when}"]]
                              for when in ("start", "final")}, index=["clustering_accuracy", "ari"])
        lines += ["Against the true labels (each partition under its own matching, fitted on the training "
                  "rankings):", "", markdown_table(table)]
    return lines + [""]


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub table (pandas' to_markdown needs tabulate, which we do not depend on)."""
    index_names = [markdown_cell(n or "") for n in frame.index.names]
    header = index_names + [markdown_cell(c) for c in frame.columns]
    rows = []
    for key, values in zip(frame.index, frame.itertuples(index=False), strict=True):
        keys = list(key) if isinstance(key, tuple) else [key]
        rows.append([markdown_cell(k) for k in keys] + [markdown_cell(_cell(v)) for v in values])
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def _cell(value: object) -> str:
    if isinstance(value, (float, np.floating)):
        return "-" if np.isnan(value) else f"{value:.4f}"
    return str(value)


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _cluster_accuracy_plot(clusters: pd.DataFrame, split: str) -> bytes:
    series = [c for c in ["clustering_accuracy", *(f"ranking_accuracy_{v}" for v in RANKING_VARIANTS)]
              if c in clusters.columns]
    figure = Figure(figsize=(3.2 + 1.2 * len(clusters), 3.6))
    ax = figure.subplots()
    width = 0.8 / len(series)
    x = np.arange(len(clusters))
    for i, name in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, clusters[name].to_numpy(), width,
               label=name.replace("ranking_accuracy_", "ranking "))
    long = clusters.index.astype(str).str.len().max() > 8  # PERSONA's profiles: slanted, or they overlap
    ax.set_xticks(x, clusters.index.astype(str), rotation=30 if long else 0, ha="right" if long else "center",
                  fontsize=7 if long else None)
    ax.set_xlabel("true label")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(f"per-cluster accuracy ({split})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    figure.tight_layout()
    return png_bytes(figure)


def _estimation_section(check: dict[str, Any] | None, fell_back: dict[str, Any] | None) -> list[str]:
    fallback = [] if fell_back is None else [
        f"At E-step {fell_back['iteration']} the estimates were {estimates_off_by(fell_back['relative_error'])}, "
        "so EM redid that iteration's M-step and E-step, and computed every later "
        "step, with every response exact (`train.exact_fallback`): the final partition rests on exact scores.", ""]
    if check is None:
        return ["## The anchors' estimates", "", *fallback] if fallback else []
    rows = pd.DataFrame({"value": [check[key] for key in ESTIMATION_ROWS]}, index=list(ESTIMATION_ROWS))
    if check["holds"]:
        verdict = "within the spread of the exact scores, and keep nine in ten rankings' most probable cluster"
    else:
        verdict = "off by more than the spread of the exact scores, or change the most probable cluster of more " \
                  "than one ranking in ten" + ("" if fell_back else ": EM's clusters rest on estimates that do not " \
                  "hold here (raise `train.anchors`, `null` for exact scores, or `train.exact_fallback`)")
    heading = "at the end of training" if fell_back is None else "until EM fell back to exact scores"
    return [f"## The anchors' estimates {heading}", "",
            f"The last E-step with estimates (iteration {check['iteration']}) against exact scores under the same "
            "adapters, on "
            f"{check['examples']} training examples (`train.estimation_check`): mean |r_hat - r| over the estimated "
            "responses, the mean std of a slate's exact scores, their ratio, the fraction of rankings whose most "
            "probable cluster is the same, and the log-likelihood per ranking under each. The estimates are "
            f"{verdict}.", "", markdown_table(rows.round(4)), "", *_estimation_by_iteration(check.get("by_iteration")),
            *fallback]


def _estimation_by_iteration(by_iteration: list[dict[str, Any]] | None) -> list[str]:
    """When the estimates stopped holding: each E-step's relative error and same-cluster fraction
    (absent before train-9, whose result.json has the last iteration's only)."""
    if not by_iteration:
        return []
    table = pd.DataFrame(by_iteration).set_index("iteration")[["relative_error", "same_cluster", "holds"]]
    table[["relative_error", "same_cluster"]] = table[["relative_error", "same_cluster"]].astype(float)
    return ["Each EM iteration's E-step, on the same examples:", "", markdown_table(table.round(4)), ""]


def _log_likelihood_plot(history: list[float]) -> bytes:
    figure = Figure(figsize=(4.5, 3.2))
    ax = figure.subplots()
    ax.plot(np.arange(len(history)), history, marker="o")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations, not 0.2 of one
    ax.set_xlabel("EM iteration (iter-NNNN)")
    ax.set_ylabel("log-likelihood per ranking (train)")
    ax.set_title("EM")
    return png_bytes(figure)


def _confusion_plot(confusion: pd.DataFrame, split: str) -> bytes:
    figure = Figure(figsize=(1.5 + 0.8 * confusion.shape[1], 1.2 + 0.6 * confusion.shape[0]))
    ax = figure.subplots()
    image = ax.imshow(confusion.to_numpy(), vmin=0, vmax=1, cmap="Blues")
    ax.set_xticks(range(confusion.shape[1]), confusion.columns)
    ax.set_yticks(range(confusion.shape[0]), confusion.index)
    ax.set_xlabel("EM cluster")
    ax.set_ylabel("true label")
    for (r, c), value in np.ndenumerate(confusion.to_numpy()):  # NaN: a label with no rankings in the split
        ax.text(c, r, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7)
    figure.colorbar(image, ax=ax, fraction=0.05)
    ax.set_title(f"mean posterior ({split})")
    return png_bytes(figure)
