"""LM path end to end on the CPU: synthetic text rankings -> cache -> EM over k LoRA adapters.

Runs the Prefect flows (ingest -> cache -> train) on the paper's synthetic data (appendix B.1,
k = 3, m = 4) rendered as text, with a tiny Qwen3 model pre-trained briefly on that text, twice:
without augmentation (m' = m) and with m' - m = 4 generated responses ranked below the originals
(the synthetic generator's `below` extras: integers below every original's). Prints held-out
clustering accuracy (Hungarian matching fitted on validation, applied to test) and ranking accuracy
for both, then the approximation-error table (paper Table 1) for both estimation modes, each also
with the input term alone (the paper's estimator).

    .venv/bin/python benchmarks/lm_synthetic_cpu.py [--n 600] [--iterations 8] [--init linearized]
                                                    [--first-epochs N] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect starts a temporary local server; on a busy 2-core machine it needs longer than the default.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from moplex_core.artifacts import ArtifactStore, load_table, read_manifest  # noqa: E402
from moplex_core.cache import load_policy_inputs  # noqa: E402
from moplex_core.config import CacheConfig, IngestConfig, SplitConfig, SyntheticOptions, TrainConfig  # noqa: E402
from moplex_core.data.synthetic import render_response  # noqa: E402
from moplex_core.em import Rankings  # noqa: E402
from moplex_core.evaluate import EvalSplit, cache_label_names, em_start_rows, evaluate_mixture  # noqa: E402
from moplex_core.experiments.approximation import ApproximationConfig, run_approximation  # noqa: E402
from moplex_core.lm.tiny import build_tiny_model  # noqa: E402
from moplex_core.train import load_posteriors, load_trained  # noqa: E402


def below_extras(rankings_dir: Path, store: ArtifactStore, n_generated: int, k: int, seed: int) -> Path:
    """An `augmented` artifact: every ranking plus n_generated responses whose k integers lie below
    every original's (synthetic `below` mode), ranked below the originals by construction."""
    table = load_table(rankings_dir)
    rng = np.random.default_rng(seed)
    generated = [[render_response(rng.integers(-10, 0, size=k)) for _ in range(n_generated)]
                 for _ in range(table.num_rows)]
    table = table.append_column("generated", pa.array(generated, pa.list_(pa.string())))
    inputs = {"rankings": f"{read_manifest(rankings_dir)['stage']}/{read_manifest(rankings_dir)['version']}"}
    version = store.version("augment", {"synthetic_below": n_generated, "seed": seed}, inputs)
    with store.writer("augment", version, config={"synthetic_below": n_generated, "seed": seed},
                      inputs=inputs) as writer:
        if not writer.complete:
            writer.write_shard(0, table)
    return store.path("augment", version)


def evaluate(train_dir: str, cache_dir: str) -> dict[str, float]:
    scorer, alpha, _ = load_trained(train_dir)
    splits = {}
    for name in ("validation", "test"):
        inputs, clusters = load_policy_inputs(cache_dir, name)
        labels = np.array([int(c.removeprefix("c")) for c in clusters])
        splits[name] = EvalSplit(inputs, Rankings(inputs.tiers, inputs.ranked_prefix, inputs.example_ids), labels)
    metrics = evaluate_mixture(scorer.exact(), alpha, splits)
    test = metrics[(metrics.split == "test") & (metrics.cluster == "all")].set_index("metric").value
    return {"clustering_accuracy": test["clustering_accuracy"], "ranking_accuracy_oracle": test.get(
        "ranking_accuracy_oracle", float("nan")), "heldout_ll": test["heldout_log_likelihood"]}


def start_and_end_accuracy(train_dir: str, cache_dir: str) -> tuple[float, float]:
    """Clustering accuracy on the train split of the responsibilities EM started from and of those it
    ended with (both kept in the train artifact), each under its own Hungarian matching on the train split."""
    rows = em_start_rows(load_posteriors(train_dir), cache_dir, cache_label_names(cache_dir))
    metrics = rows.set_index("metric").value
    return float(metrics["clustering_accuracy_start"]), float(metrics["clustering_accuracy_final"])


def _relative(check: dict) -> str:
    return "-" if check["relative_error"] is None else format(check["relative_error"], ".2f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=600, help="rankings (60/20/20 train/validation/test)")
    parser.add_argument("--iterations", type=int, default=8, help="EM iterations")
    parser.add_argument("--anchors", type=int, default=2, help="anchors a per example; 0 = all (exact, a = m')")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO scale of the scores")
    parser.add_argument("--lr", type=float, default=2e-3, help="LoRA learning rate")
    parser.add_argument("--first-epochs", type=int, default=None,
                        help="passes of the first M-step (train.first_epochs; default: the 2 of every M-step)")
    parser.add_argument("--init", default="linearized", choices=("linearized", "kmeans", "dirichlet", "labels"),
                        help="EM start (train.init; labels: the true clusters)")
    parser.add_argument("--exact-fallback", type=float, default=None, metavar="RELATIVE_ERROR",
                        help="train.exact_fallback: every response exact once an E-step's estimates are off by "
                             "more than this many times the spread of the exact scores")
    parser.add_argument("--backtracks", type=int, default=0,
                        help="redo an M-step after which the LL fell at half the lr, up to this many times "
                             "(train.backtracks)")
    parser.add_argument("--anchor-weighting", default="mean", choices=("mean", "nearest"),
                        help="train.anchor_weighting: the anchors' mean estimate (the paper's) or the nearest's")
    parser.add_argument("--anchor-draw", default="uniform", choices=("uniform", "by_length"),
                        help="train.anchor_draw: a uniform draw of anchors (the paper's) or one per length stratum")
    parser.add_argument("--seed", type=int, default=0,
                        help="train.seed (LoRA init, EM start, shuffling, anchors); the data and tiny model stay fixed")
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--approx-seeds", type=int, default=3,
                        help="seeds of the approximation-error table; 0 skips it")
    parser.add_argument("--approx-examples", type=int, default=30)
    parser.add_argument("--root", default=None, help="artifact root (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest on a shared 2-core machine

    from flows.cache import cache_flow
    from flows.ingest import ingest_flow
    from flows.train import train_flow

    root = Path(args.root or tempfile.mkdtemp(prefix="moplex-lm-bench-"))
    store = ArtifactStore(root)
    k, m = 3, 4
    ingest = IngestConfig(dataset="synthetic", synthetic=SyntheticOptions(n=args.n, k=k, m=m),
                          split=SplitConfig(fractions=(0.6, 0.2, 0.2)))
    started = time.time()
    rankings_dir = Path(ingest_flow(ingest, str(root)))
    augmented_dir = below_extras(rankings_dir, store, n_generated=4, k=k, seed=0)

    model_dir = root / "tiny-model"
    if not (model_dir / "config.json").is_file():
        rows = load_table(augmented_dir).to_pylist()
        pairs = [(r["prompt"], t) for r in rows for t in r["responses"] + r["generated"]]
        build_tiny_model(model_dir, pairs, hidden_size=64, layers=2, pretrain_steps=args.pretrain_steps)

    cache_config = CacheConfig(model=str(model_dir), score_batch_size=96, dtype="float32", device="cpu")
    train_config = TrainConfig(k=k, anchors=args.anchors or None, beta=args.beta, lora_r=8, lora_alpha=16.0,
                               lr=args.lr, epochs=2, first_epochs=args.first_epochs,
                               batch_size=16, em_iterations=args.iterations, tol=0.0, init=args.init,
                               backtracks=args.backtracks, exact_fallback=args.exact_fallback, seed=args.seed,
                               anchor_weighting=args.anchor_weighting, anchor_draw=args.anchor_draw,
                               dtype="float32", device="cpu")
    results = {}
    for label, source in (("m' = m = 4 (no augmentation)", rankings_dir), ("m' = 8 (4 below extras)", augmented_dir)):
        t0 = time.time()
        cache_dir = cache_flow(cache_config, str(source), str(root))
        train_dir = train_flow(train_config, cache_dir, str(root))
        start, end = start_and_end_accuracy(train_dir, cache_dir)
        trained = json.loads((Path(train_dir) / "result.json").read_text())
        check, fell_back = trained["estimation_check"], trained["fell_back"]
        if check is not None:
            estimates = (f"{_relative(check)} ({check['same_cluster']:.2f}); by iteration "
                         + " / ".join(_relative(m) for m in check["by_iteration"]))
        else:
            estimates = "exact" if fell_back is None else "-"
        if fell_back is not None:
            estimates += f"; exact from E-step {fell_back['iteration']} ({_relative(fell_back)})"
        results[label] = {**evaluate(train_dir, cache_dir), "seconds": time.time() - t0, "start": start, "end": end,
                          "estimates": estimates}

    print(f"\nk = {k}, m = {m}, {args.n} rankings (60/20/20), a = {args.anchors} anchors, "
          f"{args.iterations} EM iterations, first M-step {args.first_epochs or 2} epochs (then 2), "
          f"{args.backtracks} backtracks, exact fallback {args.exact_fallback}, train seed {args.seed}, "
          "tiny Qwen3 (hidden 64, 2 layers), CPU\n")
    print(f"| data | train clustering acc. at the {args.init} start -> at the end | test clustering acc. | "
          "test ranking acc. (oracle) | test LL/ranking | estimates' relative error (same cluster); each E-step's | "
          "seconds |")
    print("|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['start']:.3f} -> {r['end']:.3f} | {r['clustering_accuracy']:.3f} | "
              f"{r['ranking_accuracy_oracle']:.3f} | {r['heldout_ll']:.3f} | {r['estimates']} | {r['seconds']:.0f} |")

    if args.approx_seeds > 0:
        inputs, _ = load_policy_inputs(cache_flow(cache_config, str(augmented_dir), str(root)), "train")
        approx = run_approximation(model_dir, inputs, ApproximationConfig(
            k=k, seeds=tuple(range(args.approx_seeds)), examples=args.approx_examples), out=root / "approximation")
        print("\nRelative squared error (eps/r)^2 of single-anchor estimates by embedding distance, "
              f"mean ± std over {args.approx_seeds} seeds (m' = 8):\n")
        print(approx.markdown)
    print(f"\ntotal {time.time() - started:.0f} s; artifacts under {root}")


if __name__ == "__main__":
    main()
