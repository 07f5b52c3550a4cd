"""Cost of the cache stage with and without the reference contractions (`cache.contractions`).

    python benchmarks/cache_passes.py [--n 300] [--m 8] [--threads 1] [--qwen3-0.6b]

A cache for EM with anchors needs, per response, log pi_ref and the row of s_ref: a forward and an
input-gradient backward. A cache that is only ever scored exactly (`moplex assign`'s, or a train
stage with train.anchors = null) needs log pi_ref alone: forward passes only
(`cache.contractions = false`). This runs the cache stage (`moplex_core.cache.run_cache`) on the
same synthetic rankings both ways and prints one markdown table: seconds, responses/s and the
speed-up. Both produce the same log pi_ref (checked).

By default the model is a tiny offline Qwen3 (2 layers, hidden 64, pre-trained 40 steps);
``--qwen3-0.6b`` builds one of Qwen3-0.6B's shape with random weights (no download; float32 on the
CPU). Responses are the synthetic rankings' short digit lists (about 10 tokens each).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from moplex_core.artifacts import ArtifactStore, load_table
from moplex_core.cache import run_cache
from moplex_core.config import CacheConfig, IngestConfig, SyntheticOptions
from moplex_core.ingest import run_ingest

from bench_models import add_model_options, bench_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="rankings")
    parser.add_argument("--m", type=int, default=8, help="responses per ranking")
    parser.add_argument("--score-batch-size", type=int, default=32)
    add_model_options(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = bench_model(args, Path(tmp))
        store = ArtifactStore(Path(tmp) / "artifacts")
        rankings = run_ingest(IngestConfig(dataset="synthetic", synthetic=SyntheticOptions(n=args.n, m=args.m)),
                              store).path
        warm_up = run_ingest(IngestConfig(dataset="synthetic", synthetic=SyntheticOptions(n=3, m=args.m)), store).path
        run_cache(CacheConfig(model=str(model_dir), device="cpu"), warm_up, store, progress=False)  # kernels, allocator
        responses = args.n * args.m
        rows, logp = [], {}
        for contractions in (True, False):
            config = CacheConfig(model=str(model_dir), score_batch_size=args.score_batch_size, device="cpu",
                                 contractions=contractions)
            start = time.perf_counter()
            result = run_cache(config, rankings, store, progress=False)
            seconds = time.perf_counter() - start
            logp[contractions] = load_table(result.path, columns=["ref_logp"]).column("ref_logp")
            rows.append((contractions, seconds, responses / seconds))
    gap = max(abs(a - b) for x, y in zip(logp[True].to_pylist(), logp[False].to_pylist(), strict=True)
              for a, b in zip(x, y, strict=True))
    assert gap < 1e-4, f"log pi_ref differs by {gap} nats between the two caches"

    print(f"cache stage, {name}; {platform.processor() or 'cpu'}, {torch.get_num_threads()} CPU thread(s); "
          f"torch {torch.__version__}; {args.n} rankings x {args.m} responses, score_batch_size "
          f"{args.score_batch_size}; largest log pi_ref difference between the two: {gap:.2g} nats\n")
    print("| cache.contractions | passes | seconds | responses/s | speed-up |")
    print("|---|---|---|---|---|")
    for contractions, seconds, rate in rows:
        passes = "forward + input-gradient backward" if contractions else "forward only"
        print(f"| {str(contractions).lower()} | {passes} | {seconds:.2f} | {rate:,.1f} | {rows[0][1] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
