"""The identifiability study (paper section 3, figure 4; appendix B.1).

For k clusters and rankings of length m, fit the PL mixture by EM from the symmetry-breaking
initialisation and compare its held-out clustering accuracy with the oracle: the posterior under
the true parameters. Proposition 1 says the mixture is not identifiable for m <= 2k - 1; the
oracle shows how much cluster information a single ranking carries at all. Pairwise data (m = 2) is
also augmented to m' = 2 + k, in the three modes of `moplex_core.data.synthetic`: `below` and
`random` append extras that the data always puts last (the paper's practice), `top_m` observes the
top 2 of 2 + k alike responses (the space of the paper's Proposition 2).

The oracle is the Bayes posterior under the process that generated the data: for `below` and
`random` the ranking of the originals alone (the extras' place in the data says nothing about the
cluster), for `top_m` the exact partial-ranking likelihood. EM always fits eq. 5, as moplex does.

The scorer is the per-cluster linear model on the responses' integers, which contains the true
model (scores = integers / noise), so EM's gap to the oracle is estimation, not misspecification.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from moplex_core.data.synthetic import SyntheticConfig, SyntheticRankings, generate_synthetic
from moplex_core.em import EMConfig, Rankings, fit_mixture
from moplex_core.evaluate import EvalSplit, evaluate_mixture
from moplex_core.pl import PAD
from moplex_core.scorers.linear import LinearScorer


@dataclass(frozen=True)
class StudyConfig:
    n_train: int = 2000
    n_val: int = 500
    n_test: int = 20000
    """Large, so that EM and the oracle (which cost nothing to score) are compared to about 0.3 points,
    not the 1.4 of 1,000 rankings."""
    ks: tuple[int, ...] = (2, 3, 4)
    ms: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)
    augment_modes: tuple[str, ...] = ("below", "random", "top_m")
    noise: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2)
    max_iter: int = 100
    restarts: int = 4
    """The first from k-means, the others from k-means with other seeds, or from a Dirichlet draw where
    k-means finds the same partition again (`moplex_core.em`)."""
    init: str = "kmeans"

    def __post_init__(self) -> None:
        # Checked before the first cell: a cell that fails after others have fitted loses them all
        # (the results are written at the end).
        repeated = {name: values for name, values in (("ks", self.ks), ("ms", self.ms), ("seeds", self.seeds))
                    if len(set(values)) != len(values)}
        if repeated:
            raise ValueError(f"{', '.join(f'{name} = {list(values)}' for name, values in repeated.items())} repeat a "
                             "value: each value is a cell (a seed) of its own, which a repeat would count twice")
        if min(self.ks) < 2:
            raise ValueError(f"every k must be at least 2 (a one-cluster mixture has no clustering to identify), "
                             f"got ks = {list(self.ks)}")
        if min(self.ms) < 2:
            raise ValueError(f"every m must be at least 2 (a ranking orders two responses or more), got ms = {list(self.ms)}")
        if not self.noise > 0:
            raise ValueError(f"noise must be above 0 (the oracle's true PL scores are the utilities / noise), "
                             f"got {self.noise}")
        if min(self.n_val, self.n_test) < 1:
            raise ValueError(f"n_val = {self.n_val} and n_test = {self.n_test} must be at least 1: the matching is "
                             "fitted on validation and the study's numbers are test's")
        if self.n_train < max(self.ks):
            raise ValueError(f"n_train = {self.n_train} training rankings cannot fit k = {max(self.ks)} clusters: "
                             f"EM needs at least k rankings")


@dataclass
class StudyOutputs:
    results: pd.DataFrame
    parquet: Path
    plot: Path
    markdown: Path
    table_markdown: str


class _OracleScorer:
    """The true mixture's scores (integers / noise); used only for posteriors."""

    k: int

    def __init__(self, data: SyntheticRankings) -> None:
        self.k = data.config.k
        self._scores = data.true_scores()

    def score(self, inputs: torch.Tensor, iteration: int = 0) -> torch.Tensor:
        return self._scores[inputs]


def settings(config: StudyConfig) -> list[tuple[int, int, int, str]]:
    """(k, m, n_generated, augment) for every cell of the study."""
    cells = [(k, m, 0, "none") for k in config.ks for m in config.ms]
    cells += [(k, 2, k, mode) for k in config.ks for mode in config.augment_modes]
    return cells


# Each augmentation mode's own data draw (4, 5 and 6 were the lengths of the first three names; top_m
# shared below's 5, which paired the two columns instead of drawing them independently).
_MODE_SEED = {"none": 4, "below": 5, "random": 6, "top_m": 7}


def run_cell(config: StudyConfig, k: int, m: int, n_generated: int, augment: str, seed: int) -> list[dict]:
    """Fit one (k, m, augmentation, seed) cell; one result row for EM and one for the oracle."""
    n = config.n_train + config.n_val + config.n_test
    data_seed = seed * 1_000_003 + k * 1009 + m * 101 + n_generated * 11 + _MODE_SEED[augment]
    data = generate_synthetic(
        SyntheticConfig(
            n=n,
            k=k,
            m=m,
            noise=config.noise,
            n_generated=n_generated,
            augment_mode="below" if augment == "none" else augment,
            seed=data_seed,
        )
    )
    prefix = None if data.ranked_prefix is None else torch.as_tensor(data.ranked_prefix)
    rankings = Rankings(torch.as_tensor(data.tiers), prefix)
    # The Bayes posterior ignores extras whose place in the data is fixed (see the module docstring).
    oracle_tiers = torch.as_tensor(data.tiers).clone()
    if augment in ("below", "random"):
        oracle_tiers[:, m:] = PAD
    oracle_rankings = Rankings(oracle_tiers, prefix)
    features = data.features()
    train = np.arange(config.n_train)
    val = np.arange(config.n_train, config.n_train + config.n_val)
    test = np.arange(config.n_train + config.n_val, n)

    started = time.perf_counter()
    em_config = EMConfig(
        k=k, max_iter=config.max_iter, restarts=config.restarts, init=config.init, seed=seed
    )
    result, scorer = fit_mixture(
        lambda: LinearScorer(k, k), features[train], rankings.subset(train), em_config
    )
    seconds = time.perf_counter() - started

    oracle = _OracleScorer(data)
    rows = []
    for method, model, inputs_of, observed, alpha in (
        ("em", scorer, lambda idx: features[idx], rankings, result.best.alpha),
        ("oracle", oracle, lambda idx: torch.as_tensor(idx), oracle_rankings, data.true_alpha()),
    ):
        splits = {
            name: EvalSplit(inputs_of(idx), observed.subset(idx), data.labels[idx])
            for name, idx in (("validation", val), ("test", test))
        }
        metrics = evaluate_mixture(model, alpha, splits)
        on_test = metrics[(metrics.split == "test") & (metrics.cluster == "all")].set_index("metric").value
        rows.append(
            {
                "k": k,
                "m": m,
                "m_prime": m + n_generated,
                "augment": augment,
                "seed": seed,
                "method": method,
                "accuracy": on_test["clustering_accuracy"],
                "ari": on_test["ari"],
                "nmi": on_test["nmi"],
                "ranking_accuracy_oracle": on_test["ranking_accuracy_oracle"],
                "heldout_ll": on_test["heldout_log_likelihood"],
                "iterations": result.best.iteration + 1 if method == "em" else 0,
                "seconds": seconds if method == "em" else 0.0,
            }
        )
    return rows


def run_study(config: StudyConfig, out_dir: Path, progress: bool = True) -> StudyOutputs:
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    cells = [(cell, seed) for cell in settings(config) for seed in config.seeds]
    rows: list[dict] = []
    bar = tqdm(cells, desc="identifiability", unit="fit", disable=not progress)
    # Thousands of small [n, k, M] ops: one thread is faster than two here (measured 3.8 vs 4.2 ms
    # per M-step objective on 2 cores) and keeps results independent of the core count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for (k, m, g, augment), seed in bar:
            bar.set_postfix_str(f"k={k} m={m} m'={m + g} aug={augment} seed={seed}", refresh=False)
            rows.extend(run_cell(config, k, m, g, augment, seed))
    finally:
        torch.set_num_threads(threads)
    results = pd.DataFrame(rows)
    results.attrs["config"] = asdict(config)

    parquet = out_dir / "results.parquet"
    results.to_parquet(parquet, index=False)
    table = summary_table(results, config.max_iter)
    markdown = out_dir / "table.md"
    markdown.write_text(
        "# Identifiability study: held-out clustering accuracy (mean ± sample std over seeds; the em − oracle "
        "rows: paired by seed, mean ± standard error)\n\n"
        f"Config: `{asdict(config)}`\n\n" + table + "\n"
    )
    plot = out_dir / "accuracy_vs_m.png"
    plot_study(results, plot)
    return StudyOutputs(results, parquet, plot, markdown, table)


def summary_table(results: pd.DataFrame, max_iter: int | None = None) -> str:
    """Markdown: one row per (k, method), one column per m, then the augmented m = 2 columns; cells
    are mean ± sample std over seeds. Where both methods ran, a row per k of EM minus the oracle,
    paired by seed (the same data), mean ± its standard error. With ``max_iter``, an EM cell whose best
    fit stopped there in some seed (not converged) is marked `*`, and a note below says so."""
    def cell(values: pd.Series, error: bool = False) -> str:
        if not len(values):
            return ""
        text = f"{values.mean():+.3f}" if error else f"{values.mean():.3f}"
        if len(values) < 2:  # one seed has no spread to show
            return text
        return f"{text} ± {values.std() / np.sqrt(len(values)) if error else values.std():.3f}"

    plain = results[results.augment == "none"]
    ms = sorted(plain.m.unique())
    modes = [a for a in ("below", "random", "top_m") if a in set(results.augment)]
    columns = [("none", m) for m in ms] + [(a, None) for a in modes]
    header = ["k", "method"] + [f"m={m}" for m in ms] + [f"m=2→m'=2+k ({a})" for a in modes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def at(frame: pd.DataFrame, augment: str, m: int | None) -> pd.DataFrame:
        return frame[(frame.augment == augment) & ((frame.m == m) if m is not None else True)]

    def capped(frame: pd.DataFrame) -> str:
        stopped = max_iter is not None and "iterations" in frame and bool((frame.iterations >= max_iter).any())
        return "*" if stopped else ""

    for k, by_k in results.groupby("k", sort=True):
        for method, frame in by_k.groupby("method", sort=True):
            lines.append("| " + " | ".join([str(k), method] + [cell(at(frame, a, m).accuracy) + capped(at(frame, a, m))
                                                               for a, m in columns]) + " |")
        if set(by_k.method) >= {"em", "oracle"}:
            gaps = []
            for a, m in columns:
                paired = at(by_k, a, m).pivot_table(index="seed", columns="method", values="accuracy").dropna()
                gaps.append(cell(paired.em - paired.oracle, error=True) if len(paired) else "")
            lines.append("| " + " | ".join([str(k), "em − oracle (± s.e.)"] + gaps) + " |")
    if max_iter is not None and "iterations" in results and (results.iterations >= max_iter).any():
        lines += ["", f"`*`: in at least one seed EM's best fit stopped at max_iter = {max_iter} iterations, not "
                      "converged (results.parquet's `iterations`)."]
    return "\n".join(lines)


def plot_study(results: pd.DataFrame, path: Path) -> None:
    """accuracy_vs_m.png, drawn with matplotlib's object API as report.py's plots are: no pyplot and no
    global backend, so a notebook that calls this keeps its own (``matplotlib.use("Agg")`` here
    switched an inline backend off for the rest of the session)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    ax, ax_aug = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    colors = dict(zip(sorted(results.k.unique()), colormaps["tab10"].colors))
    plain = results[results.augment == "none"]
    for (k, method), frame in plain.groupby(["k", "method"]):
        stats = frame.groupby("m").accuracy.agg(["mean", "std"]).reset_index()
        ax.errorbar(
            stats.m, stats["mean"], yerr=stats["std"].fillna(0), color=colors[k], capsize=3,
            linestyle="--" if method == "oracle" else "-", marker="o" if method == "em" else None,
            label=f"k={k} {'oracle' if method == 'oracle' else 'EM'}",
        )
        if method == "em":
            ax.axhline(1 / k, color=colors[k], linewidth=0.6, alpha=0.4)
    ax.set_xlabel("ranking length m")
    ax.set_ylabel("held-out clustering accuracy")
    ax.set_title("EM (solid) vs oracle posterior (dashed); thin lines = chance")
    ax.legend(fontsize=7, ncol=2)

    groups = [("none", "m=2"), ("below", "+below"), ("random", "+random"), ("top_m", "top-2 of 2+k")]
    width = 0.8 / max(len(colors), 1)
    labelled: set[tuple[int, str]] = set()  # the legend names each (k, method) at its first bar drawn
    for i, k in enumerate(sorted(colors)):
        for j, (augment, _) in enumerate(groups):
            frame = results[(results.k == k) & (results.augment == augment) & (results.m == 2)]
            for method, hatch in (("em", None), ("oracle", "//")):
                acc = frame[frame.method == method].accuracy
                if len(acc) == 0:
                    continue
                x = j + (i - len(colors) / 2 + 0.5) * width + (0.0 if method == "em" else width / 2)
                ax_aug.bar(x, acc.mean(), width / 2, yerr=acc.std() if len(acc) > 1 else 0.0, color=colors[k],
                           hatch=hatch, edgecolor="black", linewidth=0.4,
                           label=None if (k, method) in labelled else f"k={k} {method}")
                labelled.add((k, method))
    ax_aug.set_xticks(range(len(groups)), [g[1] for g in groups], fontsize=8)
    ax_aug.set_title("m = 2 pairs, augmented to m' = 2 + k")
    ax_aug.set_ylim(0, 1)
    if labelled:
        ax_aug.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
