"""Approximation error of the first-order score estimate (paper Table 1 and appendix table 5).

For each seed: ``examples`` examples are drawn at random among those with distinct responses (the
paper's "randomly selected examples"), k adapters are trained briefly on them (so that r != 0), then
for every example one anchor y_i is drawn and every other response y_j is estimated from it alone
(moplex_core.estimate, both modes, each also with the input term alone, the paper's estimator, whose
first-order term leaves out the target term) and compared with its exact score r_c(y_j):

    relative squared error  (eps / r)^2 = ((r_hat_c(y_j) - r_c(y_j)) / r_c(y_j))^2
    distance                ||h(x, y_j) - h(x, y_i)|| / ||h(x, y_i)||   (response positions, the
                            shorter response padded with zero embeddings, so a tail one of the two
                            has counts in full; ||h(x, y_i)|| over the anchor's whole prompt + response)

bucketed in 5% bins of distance. Per seed the mean error of a bin is taken; the table shows the
mean and standard deviation of those over seeds, in percent, as the paper does. A DPO score r near 0
(adapters close to the base model) makes that ratio explode, so each mode also gets the measure
`train.estimation_check` reports, which does not divide by r: the mean |r_hat - r| over the mean
spread (std) of a slate's exact scores, its relative error (`estimate.estimation_gap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from moplex_core.estimate import (
    ESTIMATION_MODES,
    anchor_pass,
    contraction,
    embedding_distance,
    estimate_delta,
    response_embeddings,
)
from moplex_core.lm.logprobs import embed
from moplex_core.lm.multi_lora import LoRASettings
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, PolicyInputs

BIN_WIDTH = 0.05
INPUT_TERM_ONLY = " (input term only)"
"""Suffix of the modes whose first-order term is the contraction alone (the paper's Algorithm 1)."""
MODES = (*ESTIMATION_MODES, *(mode + INPUT_TERM_ONLY for mode in ESTIMATION_MODES))


@dataclass(frozen=True)
class ApproximationConfig:
    k: int = 3
    beta: float = 0.1
    seeds: tuple[int, ...] = (0, 1, 2)
    examples: int = 50
    train_epochs: int = 2
    """M-step passes, with seeded Dirichlet responsibilities, before measuring (so that r != 0)."""
    lr: float = 1e-3
    lora: LoRASettings = LoRASettings(r=8, alpha=16.0)
    max_distance: float = 0.5
    """Distances at or beyond this go to one last bin."""


@dataclass(frozen=True)
class ApproximationOutputs:
    errors: pd.DataFrame  # one row per (seed, example, cluster, j, mode)
    table: pd.DataFrame  # bin x mode: mean, std over seeds (percent), pairs
    markdown: str


def measure_errors(scorer: LoRAPolicyScorer, inputs: PolicyInputs, seed: int) -> pd.DataFrame:
    """Single-anchor errors of every mode in `MODES` for every example, cluster and non-anchor response."""
    rng = np.random.default_rng(seed)
    exact = scorer.exact_scores(inputs) / scorer.beta  # delta_c(y_j): [n, k, M]
    spreads = [exact[e, :, :len(seqs)].std(-1) for e, seqs in enumerate(inputs.sequences)]  # [k] each (ddof 1)
    rows = []
    for e, seqs in enumerate(inputs.sequences):
        m = len(seqs)
        anchor = int(rng.integers(m))
        emb, lengths = (t.cpu() for t in response_embeddings(scorer.model, seqs))
        ids = torch.tensor(seqs[anchor].input_ids, device=scorer.model.device)[None]
        with torch.no_grad():
            anchor_norm = embed(scorer.model, ids).double().norm().cpu()
        distance = embedding_distance(emb, anchor, anchor_norm)  # [m]
        ref_logp, s_ref = inputs.ref_logp[e, :m], inputs.ref_contraction[e, :m, :m]
        with scorer.lora.requires_grad(False):  # adapters off: pi_ref's input term alone, for the paper's estimator
            ref = anchor_pass(scorer.model, [seqs[anchor]], scorer.pad_token_id, input_grads=True)
        s_ref_inputs = s_ref.clone()
        inputs_only_ref = contraction(ref.input_grads.cpu(), torch.tensor([anchor]), emb, lengths)  # [1, m]
        s_ref_inputs[anchor] = inputs_only_ref[0].to(s_ref.dtype)
        for c in range(scorer.k):
            with scorer.lora.route([c]), scorer.lora.requires_grad(False):
                passed = anchor_pass(scorer.model, [seqs[anchor]], scorer.pad_token_id, input_grads=True,
                                     alternatives=[seqs])
            inputs_only = contraction(passed.input_grads.cpu(), torch.tensor([anchor]), emb, lengths)  # [1, m]
            s_policy = inputs_only + passed.target_terms.cpu()  # [1, m]
            for mode in MODES:
                s_pol, s_rf = (inputs_only, s_ref_inputs) if mode.endswith(INPUT_TERM_ONLY) else (s_policy, s_ref)
                estimate = estimate_delta(mode.removesuffix(INPUT_TERM_ONLY), torch.tensor([anchor]),
                                          passed.logp.cpu(), s_pol, ref_logp, s_rf)
                for j in range(m):
                    if j == anchor:
                        continue
                    r = exact[e, c, j].item()
                    rows.append((seed, inputs.example_ids[e], c, j, mode, distance[j].item(),
                                 ((estimate[j].item() - r) / r) ** 2 if r != 0 else np.nan,
                                 abs(estimate[j].item() - r), spreads[e][c].item()))
    return pd.DataFrame(rows, columns=["seed", "example_id", "cluster", "response_idx", "mode", "distance",
                                       "relative_squared_error", "abs_error", "slate_spread"])


def relative_errors(errors: pd.DataFrame) -> dict[str, float | None]:
    """Per mode: the mean |r_hat - r| over the mean spread of a slate's exact scores (each (seed,
    example, cluster) once), as `estimate.estimation_gap` and `train.estimation_check` take it; None
    where every slate's exact scores are equal."""
    out: dict[str, float | None] = {}
    for mode, frame in errors.groupby("mode", sort=False):
        spread = frame.drop_duplicates(["seed", "example_id", "cluster"])["slate_spread"].mean()
        out[mode] = float(frame["abs_error"].mean() / spread) if spread > 0 else None
    return out


def summarise(errors: pd.DataFrame, max_distance: float = 0.5) -> pd.DataFrame:
    """Mean and std over seeds of the per-seed mean error in each 5% distance bin (percent); the std is
    NaN in a bin one seed alone reached (``seeds``)."""
    frame = errors.dropna(subset=["relative_squared_error"]).copy()
    last = int(round(max_distance / BIN_WIDTH))
    frame["bin"] = np.minimum((frame.distance / BIN_WIDTH).astype(int), last)
    per_seed = frame.groupby(["mode", "bin", "seed"]).agg(error=("relative_squared_error", "mean"),
                                                        pairs=("relative_squared_error", "size")).reset_index()
    table = per_seed.groupby(["mode", "bin"]).agg(mean=("error", "mean"), std=("error", "std"),
                                                 seeds=("error", "size"), pairs=("pairs", "sum")).reset_index()
    table["mean"] *= 100
    table["std"] *= 100
    table["distance"] = [f"{b * 5}%-{(b + 1) * 5}%" if b < last else f">= {last * 5}%" for b in table["bin"]]
    return table


def approximation_markdown(table: pd.DataFrame, relative: dict[str, float | None]) -> str:
    """The paper's table by distance, then each mode's relative error (`relative_errors`)."""
    modes = [m for m in MODES if m in set(table["mode"])]
    lines = ["| distance | " + " | ".join(f"{m} (eps/r)^2" for m in modes) + " | pairs |",
             "|---|" + "---|" * len(modes) + "---|"]
    for b in sorted(set(table["bin"])):
        cells, pairs = [], 0
        for mode in modes:
            row = table[(table["bin"] == b) & (table["mode"] == mode)]
            cells.append("-" if not len(row) else f"{row['mean'].iloc[0]:.1f}% (one seed)" if row["seeds"].iloc[0] < 2
                         else f"{row['mean'].iloc[0]:.1f} ± {row['std'].iloc[0]:.1f}%")
            pairs = int(row["pairs"].iloc[0]) if len(row) else pairs
        label = table[table["bin"] == b]["distance"].iloc[0]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {pairs} |")
    said = ", ".join(f"{mode} {'-' if relative.get(mode) is None else f'{relative[mode]:.2f}'}" for mode in modes)
    lines += ["", f"Relative error, mean |r_hat - r| over the mean spread of a slate's exact scores (as "
                  f"train.estimation_check; above 1 the estimates say less about an order than their error does): "
                  f"{said}"]
    return "\n".join(lines)


def sample_examples(inputs: PolicyInputs, n: int, seed: int) -> list[int]:
    """``n`` examples drawn at random (seeded), in table order, among those with distinct token
    sequences: rows that share a prompt and its responses (UltraFeedback's 4 criteria of one prompt)
    measure the same estimates, and count once."""
    distinct: dict[tuple, int] = {}
    for i, sequences in enumerate(inputs.sequences):
        distinct.setdefault(tuple(tuple(s.input_ids) for s in sequences), i)
    rows = sorted(distinct.values())
    picked = np.random.default_rng([seed, 1]).choice(len(rows), size=min(n, len(rows)), replace=False)
    return sorted(rows[i] for i in picked)


def run_approximation(
    model: str | Path, inputs: PolicyInputs, config: ApproximationConfig, out: Path | None = None,
    *, progress: bool = False,
) -> ApproximationOutputs:
    """Train k adapters briefly per seed, measure every mode, write errors.parquet, table.parquet and table.md
    to ``out``."""
    if not config.seeds:
        raise ValueError("the approximation experiment needs at least one seed")
    if inputs.ref_contraction is None:
        raise ValueError("the approximation experiment estimates scores from the reference contractions s_ref, and "
                         "this cache has none (cache.contractions = false); give a cache built with them")
    frames = []
    for seed in config.seeds:
        examples = inputs.subset(sample_examples(inputs, config.examples, seed))
        scorer = LoRAPolicyScorer(model, config.k, beta=config.beta, anchors=None, lora=config.lora, lr=config.lr,
                                  epochs=config.train_epochs, batch_size=8, seed=seed, progress=progress)
        gamma = torch.as_tensor(np.random.default_rng(seed).dirichlet(np.ones(config.k), len(examples)))
        scorer.fit(examples, examples.rankings(), gamma, 0)
        frames.append(measure_errors(scorer, examples, seed))
    errors = pd.concat(frames, ignore_index=True)
    table = summarise(errors, config.max_distance)
    markdown = approximation_markdown(table, relative_errors(errors))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        errors.to_parquet(out / "errors.parquet", index=False)
        table.to_parquet(out / "table.parquet", index=False)
        (out / "table.md").write_text(markdown + "\n")
    return ApproximationOutputs(errors, table, markdown)

