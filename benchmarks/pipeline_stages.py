"""The pipeline's stages in one process without Prefect: wall time and peak device memory per stage.

    PYTHONPATH=. python3 benchmarks/pipeline_stages.py --root DIR [--preset synthetic-demo]
                                                       [--set KEY=VALUE ...] [--threads N]

Runs the stages of a preset (``--set`` as ``moplex run --set``) through
`moplex_core.pipeline.run_stages`, the order the Prefect flow runs them in, with each stage's
function called directly (`moplex_core.pipeline.in_this_process`), into the artifact store at
``--root``: the same artifacts as ``moplex run PRESET --root DIR`` (a complete version is found,
not rebuilt: rerun it and every stage says "reused"). Made for a machine that has a GPU but no
Prefect (the lent H200: torch, transformers and peft, no Prefect and no pydantic, whose wheels
travel with the call, docs/gpu-efficiency.md), where the stages' ``device: auto`` means CUDA and ``dtype: auto``
bf16; on the CPU it says where ``make demo``'s time goes.

Prints one markdown table (stage, version, rows of its Parquet, reused, seconds, peak GPU memory
allocated during the stage, "-" on the CPU) and the evaluate stage's metrics over all clusters.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from moplex_core.artifacts import read_manifest
from moplex_core.config import pipeline_preset, with_overrides
from moplex_core.evaluate import METRICS_FILE, RANKINGS
from moplex_core.pipeline import in_this_process, run_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path, help="artifact root")
    parser.add_argument("--preset", default="synthetic-demo", help="a pipeline preset (moplex run --list)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as moplex run --set")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = with_overrides(pipeline_preset(args.preset), [*args.set, f"root={args.root.resolve()}"])
    cuda = torch.cuda.is_available()
    run = in_this_process(config.root)
    rows = []

    def timed(name: str, *stage_args, **stage_kwargs) -> str:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        began = datetime.now(timezone.utc).replace(microsecond=0)
        start = time.perf_counter()
        path = run(name, *stage_args, **stage_kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if cuda else "-"
        manifest = read_manifest(path)
        reused = datetime.fromisoformat(manifest["finished"]) < began  # finished by an earlier run
        rows.append((name, manifest["version"], manifest["rows"] or "-", "yes" if reused else "", seconds, peak))
        print(f"{name}: {path} ({seconds:.1f} s)", file=sys.stderr, flush=True)
        return path

    start = time.perf_counter()
    dirs = run_stages(config, timed)
    total = time.perf_counter() - start
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"## Pipeline stages of `{args.preset}` in one process ({device}; torch {torch.__version__})\n")
    print("| stage | version | rows | reused | s | peak GPU GiB |\n|---|---|---|---|---|---|")
    for name, version, n, reused, seconds, peak in rows:
        print(f"| {name} | {version} | {n} | {reused} | {seconds:.1f} | {peak} |")
    print(f"| all | | | | {total:.1f} | |\n")
    metrics = pd.read_parquet(Path(dirs["evaluate"]) / METRICS_FILE)
    overall = metrics[(metrics["cluster"] == "all") & (metrics["metric"] != RANKINGS)].pivot_table(index="metric", columns="split", values="value",
                                                                sort=False)
    print(f"Metrics over all clusters ({dirs['evaluate']}/report.md has the rest):\n")
    print("| metric | " + " | ".join(overall.columns) + " |\n|---|" + "---|" * len(overall.columns))
    for metric, values in overall.iterrows():
        print(f"| {metric} | " + " | ".join("-" if pd.isna(v) else f"{v:.4f}" for v in values) + " |")


if __name__ == "__main__":
    main()
