"""``python -m chaos [--short] [--seed N] [--workdir DIR]``: the kill schedule, then the bad-input catalogue.

Prints a table of each and the two counts (kill points survived, bad inputs rejected cleanly). The
exit status is 1 if any case failed, or if the catalogue (chaos/bad_inputs.py) is not there to run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from chaos.kills import KillResult, kill_schedule, run_schedule


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def kill_table(results: Sequence[KillResult]) -> str:
    rows = [[r.point.case, r.point.describe(), r.landed or "-", "yes" if r.completed else "NO",
             r.reused or "-", r.equal or "-", f"{r.seconds:.1f}"] for r in results]
    table = format_table(["stage", "kill point", "landed", "rerun completed", "reused work", "equal to reference",
                          "seconds"], rows)
    failures = [f"FAILED {r.name}:\n  {r.detail}" for r in results if not r.ok]
    return "\n\n".join([table, *failures])


def load_catalogue() -> Callable[..., list] | None:
    """chaos.bad_inputs.run_catalogue, or None while that module does not exist."""
    try:
        from chaos.bad_inputs import run_catalogue
    except ModuleNotFoundError as err:
        if err.name != "chaos.bad_inputs":
            raise
        return None
    return run_catalogue


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[1])
    parser.add_argument("--short", action="store_true", help="one kill point per stage (what CI runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (which points, which delays)")
    parser.add_argument("--workdir", help="keep the reference and killed artifact roots here (default: a temporary "
                        "folder, removed at the end)")
    args = parser.parse_args(argv)
    import torch
    from transformers.utils import logging as transformers_logging

    torch.set_num_threads(1)  # the stages' tensors are tiny; more threads only contend on a shared machine
    transformers_logging.disable_progress_bar()  # the reference runs' model loading bars

    points = kill_schedule(args.seed, short=args.short)
    print(f"kill schedule (seed {args.seed}, {'short' if args.short else 'full'}): {len(points)} points; "
          "building the reference runs", flush=True)
    started = time.perf_counter()

    def show(result: KillResult) -> None:
        print(f"  {'survived' if result.ok else 'FAILED  '} {result.name} ({result.seconds:.1f} s)", flush=True)

    if args.workdir:
        kills = run_schedule(points, args.workdir, show)
    else:
        with tempfile.TemporaryDirectory(prefix="moplex-chaos-") as workdir:
            kills = run_schedule(points, workdir, show)
    print(f"\n{kill_table(kills)}\n")
    survived = sum(r.ok for r in kills)
    print(f"kill schedule: {time.perf_counter() - started:.0f} s\n")

    run_catalogue = load_catalogue()
    if run_catalogue is None:
        catalogue_line = "bad inputs rejected cleanly: not run (chaos/bad_inputs.py does not exist yet)"
        catalogue_ok = False
    else:
        started = time.perf_counter()
        cases = run_catalogue(short=args.short)
        print(format_table(["bad input", "rejected cleanly", "detail"],
                           [[c.name, "yes" if c.ok else "NO", c.detail] for c in cases]))
        print(f"\nbad-input catalogue: {time.perf_counter() - started:.0f} s\n")
        rejected = sum(c.ok for c in cases)
        catalogue_line = f"bad inputs rejected cleanly: {rejected}/{len(cases)}"
        catalogue_ok = rejected == len(cases)

    print(f"kill points survived: {survived}/{len(kills)}")
    print(catalogue_line)
    return 0 if survived == len(kills) and catalogue_ok else 1


if __name__ == "__main__":
    sys.exit(main())
