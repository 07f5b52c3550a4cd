"""``python -m chaos [--short] [--seed N] [--workdir DIR]``: the kill schedule, then the bad-input catalogue.

Prints the table of each and the two counts (kill points survived, bad inputs rejected cleanly);
the exit status is 1 if any kill point or bad input failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from chaos import format_table
from chaos.bad_inputs import format_results, run_catalogue
from chaos.kills import KillResult, kill_schedule, run_schedule


def kill_table(results: Sequence[KillResult]) -> str:
    """One row per kill point, then what went wrong at each failed one."""
    rows = [[r.point.case, r.point.describe(), r.landed or "-", "yes" if r.completed else "NO", r.reused or "-",
             r.equal or "-", f"{r.seconds:.1f}"] for r in results]
    table = format_table(["stage", "kill point", "landed", "rerun completed", "reused work", "equal to reference",
                          "seconds"], rows)
    return "\n\n".join([table, *(f"FAILED {r.name}:\n  {r.detail}" for r in results if not r.ok)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[1])
    parser.add_argument("--short", action="store_true",
                        help="one kill point per stage and the catalogue's representative subset (what CI runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (which points, which delays)")
    parser.add_argument("--workdir", help="keep the artifact roots and logs here (default: a temporary folder, "
                        "removed at the end)")
    args = parser.parse_args(argv)
    import torch
    from transformers.utils import logging as transformers_logging

    torch.set_num_threads(1)  # the stages' tensors are tiny; more threads only contend on a shared machine
    transformers_logging.disable_progress_bar()  # the reference runs' model loading bars

    with tempfile.TemporaryDirectory(prefix="moplex-chaos-") as tmp:
        workdir = Path(args.workdir or tmp)
        points = kill_schedule(args.seed, short=args.short)
        print(f"kill schedule (seed {args.seed}, {'short' if args.short else 'full'}): {len(points)} points, "
              "after the uninterrupted reference runs", flush=True)
        started = time.perf_counter()
        kills = run_schedule(points, workdir / "kills", lambda r: print(
            f"  {'survived' if r.ok else 'FAILED  '} {r.point.case}: {r.point.describe()} ({r.seconds:.1f} s)",
            flush=True))
        print(f"\n{kill_table(kills)}\n\nkill schedule: {time.perf_counter() - started:.0f} s\n")

        print("bad-input catalogue", flush=True)
        started = time.perf_counter()
        bad_inputs = run_catalogue(short=args.short, workdir=workdir / "bad-inputs", progress=lambda r: print(
            f"  {'ok  ' if r.ok else 'FAIL'} {r.name}", flush=True))
        print(f"\n{format_results(bad_inputs)}\n\nbad-input catalogue: {time.perf_counter() - started:.0f} s\n")

    survived, rejected = sum(r.ok for r in kills), sum(r.ok for r in bad_inputs)
    print(f"kill points survived: {survived}/{len(kills)}")
    print(f"bad inputs rejected cleanly: {rejected}/{len(bad_inputs)}")
    return 0 if survived == len(kills) and rejected == len(bad_inputs) else 1


if __name__ == "__main__":
    sys.exit(main())
