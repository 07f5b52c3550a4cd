"""The `moplex` command line. Each subcommand is a thin door onto moplex_core (or flows/, lazily)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _experiment_identifiability(args: argparse.Namespace) -> int:
    from moplex_core.experiments.identifiability import StudyConfig, run_study

    config = StudyConfig(
        n_train=args.n,
        seeds=tuple(range(args.seed, args.seed + args.seeds)),
        ks=tuple(args.k),
        ms=tuple(args.m),
        noise=args.noise,
    )
    outputs = run_study(config, Path(args.out), progress=not args.quiet)
    print(outputs.table_markdown)
    print(f"\nresults: {outputs.parquet}\nplot:    {outputs.plot}\ntable:   {outputs.markdown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    experiment = sub.add_parser("experiment", help="studies and diagnostics from the paper")
    exp_sub = experiment.add_subparsers(dest="experiment", required=True)
    ident = exp_sub.add_parser(
        "identifiability",
        help="held-out clustering accuracy vs ranking length m (paper section 3, figure 4)",
    )
    ident.add_argument("--out", default="data/artifacts/experiments/identifiability")
    ident.add_argument("--seed", type=int, default=0, help="first seed")
    ident.add_argument("--seeds", type=int, default=3, help="number of seeds")
    ident.add_argument("--n", type=int, default=2000, help="training rankings per run")
    ident.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    ident.add_argument("--m", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    ident.add_argument("--noise", type=float, default=1.0, help="Gumbel noise scale")
    ident.add_argument("--quiet", action="store_true", help="no progress bar")
    ident.set_defaults(func=_experiment_identifiability)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
