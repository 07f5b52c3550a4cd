"""Plackett-Luce core on the CPU, side by side with choix on the same data.

    python benchmarks/pl_core.py [--n 100000] [--items 200] [--m 8] [--k 4]

Prints one markdown table: our k = 1 `item` fit vs choix.ilsr_rankings — final log-likelihood per
ranking and wall time (choix.opt_rankings is left out: its Python-level Newton-CG did not finish
n = 20,000 in 10 minutes here) — then the PL log-likelihood's throughput and the time of
one EM iteration (M-step + E-step) of a k-cluster item mixture.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from moplex_core.em import EMConfig, Rankings, fit_mixture
from moplex_core.pl import log_likelihood
from moplex_core.scorers.item import ItemScorer


def draw_rankings(n: int, n_items: int, m: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(items int64 [n, m], tiers int64 [n, m]) from a k-cluster PL mixture over a pool of items."""
    rng = np.random.default_rng(seed)
    utilities = rng.normal(scale=1.5, size=(k, n_items))
    labels = rng.integers(0, k, size=n)
    items = np.argsort(rng.random((n, n_items)), axis=1)[:, :m]  # m distinct items per ranking
    noisy = utilities[labels[:, None], items] + rng.gumbel(size=(n, m))
    tiers = np.argsort(np.argsort(-noisy, axis=1), axis=1)
    return items, tiers


def per_ranking_ll(utilities: np.ndarray, items: torch.Tensor, rankings: Rankings) -> float:
    scores = torch.as_tensor(utilities, dtype=torch.float64)[items]  # [n, m]
    return log_likelihood(scores, rankings.index).mean().item()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import choix

    items_np, tiers_np = draw_rankings(args.n, args.items, args.m, 1, args.seed)
    items, rankings = torch.as_tensor(items_np), Rankings(torch.as_tensor(tiers_np))
    choix_data = [row[np.argsort(t)] for row, t in zip(items_np, tiers_np)]  # best first

    rows = []
    scorer = ItemScorer(1, args.items, l2=1e-9)
    _, seconds = timed(lambda: fit_mixture(lambda: scorer, items, rankings, EMConfig(k=1, max_iter=1)))
    ours = scorer.theta[0].numpy()
    rows.append(("moplex item scorer, k=1 (L-BFGS, float64)", per_ranking_ll(ours, items, rankings), seconds))
    params, seconds = timed(lambda: choix.ilsr_rankings(args.items, choix_data, alpha=0.0, tol=1e-10))
    rows.append(("choix.ilsr_rankings (tol 1e-10)", per_ranking_ll(params, items, rankings), seconds))

    print(f"## PL core on the CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} torch threads), n={args.n:,} rankings, {args.items} items, m={args.m}\n")
    print("| fit (k = 1) | log-likelihood per ranking | wall time (s) | vs moplex |")
    print("|---|---|---|---|")
    for name, ll, seconds in rows:
        print(f"| {name} | {ll:.6f} | {seconds:.2f} | {seconds / rows[0][2]:.1f}x |")
    gap = max(abs(r[1] - rows[0][1]) for r in rows[1:])
    print(f"\nlargest log-likelihood gap to moplex: {gap:.2e} per ranking")

    index = rankings.index
    scores = torch.randn(args.n, args.m, dtype=torch.float64)
    log_likelihood(scores, index)
    reps = 20
    _, seconds = timed(lambda: [log_likelihood(scores, index) for _ in range(reps)])
    forward = args.n * reps / seconds
    scores.requires_grad_(True)

    def forward_backward():
        for _ in range(reps):
            torch.autograd.grad(log_likelihood(scores, index).sum(), scores)

    _, seconds = timed(forward_backward)
    backward = args.n * reps / seconds

    items_np, tiers_np = draw_rankings(args.n, args.items, args.m, args.k, args.seed + 1)
    items, rankings = torch.as_tensor(items_np), Rankings(torch.as_tensor(tiers_np))
    config = EMConfig(k=args.k, max_iter=5, tol=0, init="dirichlet", seed=args.seed)
    iteration_seconds: list[float] = []
    last = [time.perf_counter()]

    def on_iteration(_state) -> None:
        now = time.perf_counter()
        iteration_seconds.append(now - last[0])
        last[0] = now

    fit_mixture(lambda: ItemScorer(args.k, args.items), items, rankings, config, on_iteration=on_iteration)
    print("\n| PL core throughput | value |")
    print("|---|---|")
    print(f"| log-likelihood, forward (float64) | {forward:,.0f} rankings/s |")
    print(f"| log-likelihood, forward + backward | {backward:,.0f} rankings/s |")
    print(f"| one EM iteration, k={args.k} item mixture (median of iterations 2-5) | "
          f"{np.median(iteration_seconds[1:]):.2f} s |")


if __name__ == "__main__":
    main()
