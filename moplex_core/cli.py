"""The `moplex` command line. Each subcommand is a thin door onto moplex_core (or flows/, lazily)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import textwrap
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, get_args

if TYPE_CHECKING:
    from moplex_core.artifacts import ArtifactStore
    from moplex_core.config import PipelineConfig


def _experiment_identifiability(args: argparse.Namespace) -> int:
    from moplex_core.experiments.identifiability import StudyConfig, run_study

    try:
        config = StudyConfig(
            n_train=args.n,
            n_test=args.n_test,
            seeds=tuple(range(args.seed, args.seed + args.seeds)),
            ks=tuple(args.k),
            ms=tuple(args.m),
            noise=args.noise,
            max_iter=args.max_iter,
            restarts=args.restarts,
        )
    except ValueError as err:
        print(f"moplex experiment identifiability: {err}", file=sys.stderr)
        return 1
    outputs = run_study(config, Path(args.out), progress=not args.quiet)
    print(outputs.table_markdown)
    print(f"\nresults: {outputs.parquet}\nplot:    {outputs.plot}\ntable:   {outputs.markdown}")
    return 0


def _experiment_approximation(args: argparse.Namespace) -> int:
    from moplex_core.artifacts import ArtifactError, read_manifest
    from moplex_core.cache import cache_model, contractions_out_of_date, load_policy_inputs
    from moplex_core.experiments.approximation import ApproximationConfig, run_approximation

    config = ApproximationConfig(k=args.k, seeds=tuple(range(args.seed, args.seed + args.seeds)), examples=args.examples)
    if args.lora_targets:
        config = replace(config, lora=replace(config.lora, target_modules=tuple(args.lora_targets.split(","))))
    try:
        cache, store = _input_and_its_root(args.cache, args.root)
        read_manifest(cache, ("cache",))  # refuses an unfinished artifact or one of another stage
        out_of_date = contractions_out_of_date(cache)
        if out_of_date:
            raise ValueError(out_of_date)
        inputs, _ = load_policy_inputs(cache, args.split)
        out = Path(args.out) if args.out else store.root / "experiments" / "approximation"
        outputs = run_approximation(cache_model(cache, args.model), inputs, config, out, progress=not args.quiet)
    except (ValueError, ArtifactError) as err:
        print(f"moplex experiment approximation: {err}", file=sys.stderr)
        return 1
    print(outputs.markdown)
    print(f"\nerrors: {out / 'errors.parquet'}\ntable:  {out / 'table.md'}, {out / 'table.parquet'}")
    return 0


def _experiment_compare(args: argparse.Namespace) -> int:
    # Runs the compare flow (several pipeline subflows) in this process, like `moplex run`.
    from moplex_core.methods import METHODS
    from moplex_core.experiments.compare import plan_runs

    methods = args.methods or list(METHODS)
    try:
        base, overrides = _preset_run(args.data, args)
        runs = plan_runs(base, methods, list(range(args.seed, args.seed + args.seeds)))
    except ValueError as err:
        print(f"moplex experiment compare: {err}", file=sys.stderr)
        return 1
    print(f"{len(runs)} runs: {', '.join(methods)} x seeds {args.seed}..{args.seed + args.seeds - 1} on {args.data}",
          file=sys.stderr)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from flows.compare import run_compare_in_process

    try:
        completed, message = run_compare_in_process(methods, args.seeds, args.seed, args.data, overrides)
    except RuntimeError as err:
        return _prefect_unreachable("moplex experiment compare", err)
    print(message if completed else f"moplex experiment compare: {message}",
          file=sys.stdout if completed else sys.stderr)
    return 0 if completed else 1


def _preset_run(preset: str, args: argparse.Namespace) -> tuple[PipelineConfig, list[str]]:
    """The pipeline preset ``preset`` with ``--set`` and then ``--root`` applied (a ValueError before
    Prefect starts; ``--root`` apart, so that an error in the others lists only what was typed after
    ``--set``), and the overrides a flow run takes: the settings typed and the root, as checked here
    (paths made absolute), so that a retry from another directory runs the same settings."""
    from moplex_core.config import as_assignments, pipeline_preset, with_overrides

    config = with_overrides(pipeline_preset(preset), args.set)
    if args.root is not None:
        config = with_overrides(config, [f"root={args.root}"])
    root = Path(config.root).absolute()
    in_the_way = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:  # found before Prefect starts, not by the first stage's writer
        raise ValueError(f"the artifact root {root} cannot be a folder: {in_the_way} is a file (give --root DIR)")
    return config, as_assignments(config, [*(a.partition("=")[0] for a in args.set), "root"])


def _prefect_unreachable(command: str, err: RuntimeError) -> int:
    """A flow run that could not start because Prefect's server did not answer: the temporary one did
    not come up, or the one PREFECT_API_URL names is not running (failures inside a run come back as
    its state); any other RuntimeError is raised as it is."""
    reached = re.search(r"Failed to reach API at (\S+?)/?$", str(err), flags=re.MULTILINE)
    if reached:
        url = urllib.parse.urlsplit(reached.group(1))
        start = "prefect server start" + ("" if url.port in (None, 4200) else f" --port {url.port}")
        print(f"{command}: the run could not start: no Prefect server answers at {reached.group(1)} "
              f"(PREFECT_API_URL). Start it (`{start}`), or run on a temporary local server: "
              "`prefect config unset PREFECT_API_URL` (or unset the environment variable).", file=sys.stderr)
        return 1
    if "ephemeral Prefect API server" not in str(err):
        raise err
    timeout = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    print(f"{command}: the run could not start: {err}\nPrefect's temporary server gets "
          f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={timeout} s to start (its first start in a "
          "new PREFECT_HOME also creates the database); rerun, raise that variable, or start one server "
          "with `prefect server start` and set PREFECT_API_URL to its address.", file=sys.stderr)
    return 1


def _say_done(result, rows: str, note: str = "") -> None:
    """One line for a stage run from the command line: what it wrote, or that it had nothing to do."""
    if result.built:
        print(f"{result.ref}: wrote {result.rows} {rows} to {result.path}{note}")
    else:
        print(f"{result.ref} is already complete at {result.path} ({result.rows} {rows}{note}); nothing to do")


def _ingest(args: argparse.Namespace) -> int:
    # Runs the stage in this process, without Prefect (moplex_core never imports it); the Prefect
    # flow (flows/ingest.py) calls the same run_ingest.
    from moplex_core.artifacts import ArtifactError, ArtifactStore
    from pydantic import ValidationError

    from moplex_core.config import IngestConfig, describe_validation_error, ingest_preset, with_overrides
    from moplex_core.data.sources import DatasetUnavailableError, HubUnreachableError
    from moplex_core.ingest import run_ingest

    if args.dataset is None and args.preset is None:
        print("moplex ingest: give --dataset NAME or --preset NAME", file=sys.stderr)
        return 1
    try:
        base = ingest_preset(args.preset).model_dump(mode="json") if args.preset else {}
        data = {**base, **{k: v for k, v in (("dataset", args.dataset), ("path", args.path)) if v is not None}}
        config = with_overrides(IngestConfig.model_validate(data), args.set)
        result = run_ingest(config, ArtifactStore(args.root))
    except ValidationError as err:  # the flags themselves; a bad --set is a ValueError of its own
        print(f"moplex ingest: invalid settings:\n{describe_validation_error(err)}", file=sys.stderr)
        return 1
    except (ValueError, DatasetUnavailableError, HubUnreachableError, ArtifactError) as err:
        print(f"moplex ingest: {err}", file=sys.stderr)
        return 1
    _say_done(result, "rankings", f"; {result.rejected} source row(s) rejected, listed in rejected.parquet"
              if result.rejected else "")
    return 0


def _augment(args: argparse.Namespace) -> int:
    # In this process, without Prefect, like `moplex ingest`; flows/augment.py calls the same run_augment.
    from moplex_core.artifacts import ArtifactError
    from moplex_core.augment import ShortfallError, run_augment
    from moplex_core.config import AugmentConfig, with_overrides

    try:
        rankings, store = _input_and_its_root(args.rankings, args.root)
        data = {k: v for k, v in (("backend", args.backend), ("model", args.model)) if v is not None}
        # validated once, flags and --set together, so a missing setting reads like a bad --set
        config = with_overrides(AugmentConfig.model_construct(**data), args.set)
        result = run_augment(config, rankings, store, progress=not args.quiet)
    except (ValueError, ArtifactError, ShortfallError, OSError, RuntimeError) as err:
        print(f"moplex augment: {err}", file=sys.stderr)
        return 1
    short = f"; {result.shortfall.num_rows} shortfall row(s) in shortfall.parquet" if result.shortfall.num_rows else ""
    _say_done(result, "augmented rankings", short)
    return 0


def _cache(args: argparse.Namespace) -> int:
    # In this process, without Prefect, like `moplex ingest`; flows/cache.py calls the same run_cache.
    from moplex_core.artifacts import ArtifactError
    from moplex_core.cache import run_cache
    from moplex_core.config import CacheConfig, with_overrides

    try:
        rankings, store = _input_and_its_root(args.rankings, args.root)
        # validated once, flags and --set together, as augment's
        config = with_overrides(CacheConfig.model_construct(model=args.model), args.set)
        result = run_cache(config, rankings, store, progress=not args.quiet)
    except (ValueError, ArtifactError, OSError, RuntimeError) as err:
        print(f"moplex cache: {err}", file=sys.stderr)
        return 1
    _say_done(result, "cached examples")
    return 0


def _input_and_its_root(text: str, root: str | None) -> tuple[Path, ArtifactStore]:
    """The input artifact a user typed (a folder, or STAGE/VERSION under ``root``), and the store of
    ``root``, or without one of the input's own root (`artifacts.default_root`), where the command's
    new artifacts go, beside their input. Resolved first, so that ROOT/STAGE/PREFIX finds that root."""
    from moplex_core.artifacts import DEFAULT_ROOT, ArtifactStore, default_root

    artifact = ArtifactStore(root or DEFAULT_ROOT).resolve(text)
    return artifact, ArtifactStore(root or default_root(artifact))


def _assign(args: argparse.Namespace) -> int:
    # In this process, without Prefect, like `moplex ingest`.
    from moplex_core.artifacts import ArtifactError
    from moplex_core.assign import run_assign
    from moplex_core.display import markdown_cell

    try:
        train, store = _input_and_its_root(args.train, args.root)
    except (ValueError, ArtifactError, OSError) as err:
        print(f"moplex assign: {err}", file=sys.stderr)
        return 1
    root = str(store.root)
    if Path(args.rankings).expanduser().is_file():
        print(f"moplex assign: {args.rankings} is a file; assign takes a rankings artifact. Ingest the file first: "
              f"`moplex ingest --dataset generic --path {shlex.quote(args.rankings)} --set 'split.fractions=[1,0,0]' "
              f"--root {shlex.quote(root)}`, "
              "then give the ingest/<version> it names", file=sys.stderr)
        return 1
    try:
        result = run_assign(train, store.resolve(args.rankings), store, model=args.model,
                            device=args.device, score_batch_size=args.score_batch_size, progress=not args.quiet)
    except (ValueError, ArtifactError, OSError) as err:
        print(f"moplex assign: {err}", file=sys.stderr)
        return 1
    except KeyError as err:  # a manifest without what a finished train or cache artifact records
        print(f"moplex assign: an input artifact's manifest lacks {err}; was it written by moplex?", file=sys.stderr)
        return 1
    _say_done(result, "rankings")
    summary = store.manifest(result.ref.stage, result.ref.version)["summary"]
    mean = summary["mean_posterior_of_assigned"]
    print("\n| cluster (adapter) | rankings | mean posterior |\n|---|---|---|")
    for name, count in summary["assigned"].items():
        print(f"| {name} | {count} | {mean[name]:.3f} |" if name in mean else f"| {name} | 0 | - |")
    if "labels_by_assigned" in summary:
        names = list(summary["assigned"])
        print(f"\n| true label | {' | '.join(f'adapter {n}' for n in names)} |\n|---|{'---|' * len(names)}")
        for label, row in summary["labels_by_assigned"].items():
            print(f"| {markdown_cell(label)} | {' | '.join(str(row[n]) for n in names)} |")
        agreement = summary["agreement_with_labels"]
        ari = agreement["adjusted_rand_index"]
        print(f"\nagreement with the labels: {agreement['accuracy_best_matching']:.1%} under the best matching of "
              "adapters to labels (fitted on these rankings), adjusted Rand index "
              + ("undefined (one label or one ranking: no partition to agree with)" if ari is None else f"{ari:.3f}"))
    else:
        print("\n(not every ranking carries a `cluster` label, so there is no table of labels by adapter)")
    return 0


def _run(args: argparse.Namespace) -> int:
    # The command-line twin of the Prefect flow flows/pipeline.py, run in this process; moplex_core
    # never imports prefect, so the flow is imported here, lazily.
    from moplex_core.config import preset_description, preset_names

    if args.list or args.preset is None:
        if not args.list:
            print("moplex run: name a preset, e.g. `moplex run synthetic-demo`; these are the presets:", file=sys.stderr)
        print("pipeline presets (data/presets/*.json):")
        width = max(shutil.get_terminal_size().columns, 60)
        for name in preset_names():
            print(textwrap.fill(preset_description(name), width, initial_indent=f"  {name:<22} ",
                                subsequent_indent=" " * 25) or f"  {name}")
        return 0 if args.list else 1
    try:
        config, overrides = _preset_run(args.preset, args)
    except ValueError as err:
        print(f"moplex run: {err}", file=sys.stderr)
        return 1
    if args.show_config:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from flows.pipeline import run_in_process

    try:
        completed, message = run_in_process(args.preset, overrides, config.root)
    except RuntimeError as err:
        return _prefect_unreachable("moplex run", err)
    print(message if completed else f"moplex run: {message}", file=sys.stdout if completed else sys.stderr)
    return 0 if completed else 1


def _inspect(args: argparse.Namespace) -> int:
    from moplex_core.artifacts import ArtifactError, ArtifactStore
    from moplex_core.inspect import inspect_path

    store = ArtifactStore(args.root)
    try:
        if args.path is None:  # the root's listing
            if not store.root.is_dir():
                raise ArtifactError(f"no artifacts to list: the root is {store.missing_root()}")
            target = store.root
        else:
            target = store.resolve(args.path)  # a stage's name: its folder under --root, listed
        damaged: list[str] = []
        print(inspect_path(target, rows=args.rows, verify=args.verify, damaged=damaged))
    except (FileNotFoundError, ArtifactError, ValueError) as err:
        print(f"moplex inspect: {err}", file=sys.stderr)
        return 1
    if damaged:  # a check a script can use: the report above says which files
        print(f"moplex inspect: {len(damaged)} version(s) DAMAGED", file=sys.stderr)
        return 1
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
    ident.add_argument("--out", type=_given("a folder"), default="data/artifacts/experiments/identifiability",
                       help="folder for results.parquet, table.md and accuracy_vs_m.png (default: %(default)s)")
    ident.add_argument("--seed", type=_int_at_least(0), default=0, help="first seed (default: %(default)s)")
    ident.add_argument("--seeds", type=_positive_int, default=3, help="number of seeds (default: %(default)s)")
    ident.add_argument("--n", type=_positive_int, default=2000, help="training rankings per run (default: %(default)s)")
    ident.add_argument("--n-test", type=_positive_int, default=20000,
                       help="test rankings per run, scored by EM and the oracle alike (default: %(default)s)")
    ident.add_argument("--k", type=_int_at_least(2), nargs="+", default=[2, 3, 4], help="numbers of clusters (default: 2 3 4)")
    ident.add_argument("--m", type=_int_at_least(2), nargs="+", default=[2, 3, 4, 5, 6, 7, 8],
                       help="ranking lengths, responses per ranking (default: 2 to 8)")
    ident.add_argument("--noise", type=_positive_float, default=1.0,
                       help="Gumbel noise scale (above 0: the true PL scores are the integer utilities / noise) (default: %(default)s)")
    ident.add_argument("--max-iter", type=_positive_int, default=100, help="EM iterations at most (default: %(default)s)")
    ident.add_argument("--restarts", type=_positive_int, default=4,
                       help="EM restarts, the best log-likelihood kept (default: %(default)s)")
    ident.add_argument("--quiet", action="store_true", help="no progress bar")
    ident.set_defaults(parser=ident, func=_experiment_identifiability)

    approx = exp_sub.add_parser(
        "approximation",
        help="relative error of first-order score estimates by embedding distance (paper Table 1), "
        "delta and logpi modes",
    )
    approx.add_argument("--cache", type=_artifact, required=True,
                        help="a cache artifact: its folder, or cache/<version prefix> under --root (its model is pi_ref)")
    approx.add_argument("--root", type=_folder, help="artifact root for cache/<version>, and of the default --out "
                        "(default: the cache artifact's, given as a folder, else data/artifacts)")
    approx.add_argument("--model", type=_model, help="where the cache's base model is now, when it moved: a folder "
                        "with the same files (default: where the cache recorded it, or the root's own tiny model)")
    approx.add_argument("--out", type=_given("a folder"), help="folder for errors.parquet, table.parquet and "
                        "table.md (default: ROOT/experiments/approximation)")
    approx.add_argument("--split", default="train", help="cache split to measure on (default: %(default)s)")
    approx.add_argument("--k", type=_positive_int, default=3, help="adapters trained briefly before measuring (default: %(default)s)")
    approx.add_argument("--seed", type=_int_at_least(0), default=0, help="first seed (default: %(default)s)")
    approx.add_argument("--seeds", type=_positive_int, default=3, help="number of seeds (default: %(default)s)")
    approx.add_argument("--examples", type=_positive_int, default=50, help="examples per seed (default: %(default)s)")
    approx.add_argument("--lora-targets", metavar="NAMES",
                        help="the model's linear layers that take the adapters, comma-separated (default: the "
                             "Qwen3/Llama projections q_proj,...,down_proj; GPT-2: c_attn,c_fc,c_proj)")
    approx.add_argument("--quiet", action="store_true", help="no progress bar")
    approx.set_defaults(parser=approx, func=_experiment_approximation)

    from moplex_core.config import DatasetName
    from moplex_core.methods import METHODS

    compare = exp_sub.add_parser(
        "compare",
        help="baselines and ablations (methods) x seeds on one dataset preset, one report in the shape of "
        "paper Tables 3 and 4",
        description="Run every METHOD (a preset of the one engine: "
        + "; ".join(f"{m.name} = {m.paper}" for m in METHODS.values())
        + ") with train seeds SEED..SEED+SEEDS-1 on the pipeline preset --data, as subflows of one Prefect "
        "flow, and write a `compare` artifact: report.md (tables, % mean +- std over seeds), "
        "plots/comparison.png, comparison.parquet. Shared stages are computed once; a rerun reuses every "
        "finished run.",
    )
    compare.add_argument("methods", nargs="*", metavar="METHOD", help=f"default: all ({', '.join(METHODS)})")
    compare.add_argument("--data", default="synthetic-compare",
                         help="the base pipeline preset: MoPLEx itself (generated responses, train.anchors < m') (default: %(default)s)")
    compare.add_argument("--seeds", type=_positive_int, default=3, help="number of train seeds (default: %(default)s)")
    compare.add_argument("--seed", type=_int_at_least(0), default=0, help="first train seed (default: %(default)s)")
    compare.add_argument("--root", type=_folder, help="artifact root (default: the preset's)")
    compare.add_argument("--threads", type=_positive_int, help="torch CPU threads (as moplex run)")
    compare.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a field of the base PipelineConfig before the methods' own; repeatable")
    compare.set_defaults(parser=compare, func=_experiment_compare)

    ingest = sub.add_parser(
        "ingest",
        help="read a preference dataset into a versioned rankings artifact (no Prefect needed)",
        description="Read a preference dataset into a versioned rankings artifact. A second run with "
        "the same config and source does nothing.",
    )
    ingest.add_argument("--dataset", choices=get_args(DatasetName),
                        help="the dataset's adapter (its raw schema); give this or --preset")
    ingest.add_argument("--preset", help="a named IngestConfig (moplex_core.config.INGEST_PRESETS)")
    ingest.add_argument("--path", type=_given("a file or folder"),
                        help="local file or folder in the dataset's raw schema (instead of the hub)")
    ingest.add_argument("--root", type=_folder, default="data/artifacts", help="artifact root (default: %(default)s)")
    ingest.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field, dotted for nested ones (e.g. ultrafeedback.min_distinct_rankings=3); repeatable",
    )
    ingest.set_defaults(parser=ingest, func=_ingest)

    augment = sub.add_parser(
        "augment",
        help="add generated responses to a rankings artifact (paper 4.1; no Prefect needed)",
        description="Add n_generated responses, ranked below the originals, to every ranking of a "
        "rankings artifact. Resumes an interrupted run; a second run with the same config does nothing.",
    )
    augment.add_argument("--rankings", type=_artifact, required=True,
                         help="the rankings artifact: its folder, or stage/version under --root (e.g. ingest/3fa2)")
    augment.add_argument("--backend", choices=["hf", "vllm", "borrow"],
                         help="hf: transformers generate (default); vllm: a subprocess under vllm_python; "
                         "borrow: responses of the other rankings of the same prompt, no model")
    augment.add_argument("--model", type=_model, help="local model directory or hub name (hf, vllm)")
    augment.add_argument("--root", type=_folder, help="artifact root (default: the rankings artifact's, given as a "
                         "folder, else data/artifacts)")
    augment.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override an AugmentConfig field (e.g. n_generated=4, temperature=1.0, vllm_python=...); repeatable",
    )
    augment.add_argument("--quiet", action="store_true", help="no progress bar")
    augment.set_defaults(parser=augment, func=_augment)

    cache = sub.add_parser(
        "cache",
        help="score a rankings or augmented artifact under the base model: reference log-probs and "
        "contractions (paper 4.2; no Prefect needed)",
        description="Write the cache stage's artifact of a rankings or augmented artifact: every response's "
        "log pi_ref and, with contractions (the default), the anchor contractions s_ref, as the pipeline's cache "
        "stage does; `moplex experiment approximation --cache` reads it. Resumes an interrupted run; a second "
        "run with the same config does nothing.",
    )
    cache.add_argument("--rankings", type=_artifact, required=True,
                       help="the rankings or augmented artifact: its folder, or stage/version under --root "
                       "(e.g. augment/9c1e)")
    cache.add_argument("--model", type=_model, required=True, help="the base model pi_ref: a local model directory "
                       "or a cached hub name (the pipeline's tiny model is its folder, ROOT/model/VERSION/model)")
    cache.add_argument("--root", type=_folder, help="artifact root (default: the rankings artifact's, given as a "
                       "folder, else data/artifacts)")
    cache.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a CacheConfig field (e.g. max_prompt_tokens=256, score_batch_size=8, dtype=bfloat16, "
        "contractions=false); repeatable",
    )
    cache.add_argument("--quiet", action="store_true", help="no progress bar")
    cache.set_defaults(parser=cache, func=_cache)

    assign = sub.add_parser(
        "assign",
        help="route new rankings to a trained mixture's clusters: each ranking's posterior and adapter (no Prefect needed)",
        description="Score every response of a rankings artifact (from `moplex ingest`) under each adapter of a "
        "finished train artifact and write each ranking's posterior over the clusters and its most likely "
        "adapter (train/<version>/adapters/cN) to an `assign` artifact. The rankings are first cached with the "
        "train artifact's own cache settings, forward passes only (exact scores need no reference contractions). "
        "A second run with the same inputs does nothing.",
    )
    assign.add_argument("train", type=_artifact, help="the train artifact: its folder, or train/<version> under --root")
    assign.add_argument("rankings", type=_artifact,
                        help="the rankings artifact: its folder, or ingest/<version> under --root")
    assign.add_argument("--root", type=_folder, help="artifact root (the cache and assign artifacts go here; "
                        "default: the train artifact's, given as a folder, else data/artifacts)")
    assign.add_argument("--model", type=_model, help="where the base model the adapters were trained on is now, when "
                        "it moved: a folder with the same files (default: where the train artifact's cache recorded "
                        "it, or the root's own tiny model)")
    assign.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    assign.add_argument("--score-batch-size", type=_positive_int, default=32,
                        help="rows (one response under one adapter) per scoring pass (default: %(default)s)")
    assign.add_argument("--quiet", action="store_true", help="no progress bar")
    assign.set_defaults(parser=assign, func=_assign)

    run = sub.add_parser(
        "run",
        help="run the whole pipeline (ingest -> augment -> cache -> train -> evaluate) on a preset, as a Prefect flow",
        description="Run the moplex-pipeline Prefect flow in this process on a named preset "
        "(data/presets/PRESET.json). Finished stages are reused; an interrupted one resumes. Without "
        "PREFECT_API_URL, Prefect starts a temporary local server and keeps the run in PREFECT_HOME.",
    )
    run.add_argument("preset", nargs="?", help="e.g. synthetic-demo (see --list)")
    run.add_argument("--list", action="store_true", help="list the presets and exit")
    run.add_argument("--root", type=_folder,
                     help="artifact root (default: the preset's, data/artifacts; wins over --set root=...)")
    run.add_argument("--threads", type=_positive_int, help="torch CPU threads (1 is fastest for the tiny model on a busy "
                     "2-core machine; default: torch's)")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a PipelineConfig field, dotted (e.g. train.em_iterations=3, ingest.synthetic.n=120, "
        "augment.n_generated=4); repeat --set for each",
    )
    run.add_argument("--show-config", action="store_true",
                     help="print the config the run would use (the preset with --set and --root applied) as JSON "
                          "and exit without running")
    run.set_defaults(parser=run, func=_run)

    inspect = sub.add_parser(
        "inspect", help="readable report of an artifact folder, manifest.json or Parquet file",
        description="A readable report of an artifact version (manifest, schema, counts per cluster and split, "
                    "first rows, the stage's own summary), a manifest.json, a Parquet file, or a listing of a "
                    "root or stage folder.")
    inspect.add_argument("path", nargs="?", type=_given("a path (leave it out for the listing of --root)"),
                         help="a version folder, manifest.json, Parquet file, root or stage folder, or stage/version "
                              "under --root (a version prefix is enough, e.g. ingest/3fa2); without it, the listing "
                              "of --root")
    inspect.add_argument("--root", type=_folder, default="data/artifacts", help="artifact root for stage/version (default: %(default)s)")
    inspect.add_argument("--rows", type=_int_at_least(0), default=3, help="first rows to show per table (default: %(default)s)")
    inspect.add_argument("--verify", action="store_true",
                         help="check every file of a version (of each version listed) against the sha256 its manifest "
                              "records, not only its size (reads every file); with or without it, exit 1 when a "
                              "version is DAMAGED")
    inspect.set_defaults(parser=inspect, func=_inspect)
    return parser


def _given(what: str) -> Callable[[str], str]:
    """An argparse type: ``what`` (a path or a model), not empty or blank: ``--root "$ROOT"`` with ROOT
    unset would fall back to the default root unseen, and an empty path or model is the working
    directory to the OS, which would be read or hashed in its place."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected {what}, got an empty value")
        return text
    return parse


_folder = _given("a folder (leave --root out for the default)")
_model = _given("a local model folder or a hub name")
_artifact = _given("an artifact: its folder, or STAGE/VERSION under --root")


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {low}, got {text!r}")
        return value
    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


_positive_int = _int_at_least(1)


def main(argv: list[str] | None = None) -> int:
    # moplex_core's warnings (over-long responses cut by the cache, ...) go to the Prefect run's log,
    # and so to the UI, as well as to stderr. Prefect reads this when it is first imported (below,
    # lazily); prefect.yaml sets it for deployed runs.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "moplex_core")
    # Its logs outside a flow run (a library call after a run, in the same process) have no run's log
    # to go to: the console only, not one warning each.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # Prefect's 20 s for its temporary server to start is too short on a busy 2-core machine,
    # above all for the first start in a new PREFECT_HOME (it creates the database then).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # The temporary server `moplex run` starts would send Prefect's usage telemetry: off unless asked for.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A heartbeat event every 30 s against a server (a temporary server gets none:
    # flows.pipeline.local_run_settings), as processes.FLOW_HEARTBEAT_SECONDS says why.
    from moplex_core.processes import FLOW_HEARTBEAT_SECONDS

    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(FLOW_HEARTBEAT_SECONDS))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        settings = [e for e in extra if "=" in e and not e.startswith("-")]
        hint = (f" (each setting takes its own --set: {' '.join(f'--set {e}' for e in settings)})"
                if settings and hasattr(args, "set") else "")
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}{hint}")  # its usage
    bars: contextlib.AbstractContextManager = contextlib.nullcontext()
    if getattr(args, "quiet", False):  # transformers' own bars too (a hub download), for this command only
        from moplex_core.lm.loading import transformers_bars

        bars = transformers_bars(False)
    try:
        with bars:
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM or SIGHUP (moplex_core.processes.StopSignal)
        study = getattr(args, "experiment", None) in ("identifiability", "approximation")  # written at their end
        said = ("" if args.command == "inspect" else
                " Nothing was written: a study writes its results when it ends." if study else
                " Finished stages and the shards and EM iterations written so far are kept: the same command "
                "resumes from them.")
        print(f"\nmoplex {args.command}{f' {args.experiment}' if study else ''}: interrupted.{said}", file=sys.stderr)
        return getattr(stop, "status", 130)
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket broke: a real error
        # The reader went away (`moplex inspect ... | head`): stop quietly, as cat does. stdout now
        # points at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def console_main() -> int:
    """The `moplex` command (the console script): `main`, with SIGTERM and SIGHUP stopping it as
    Ctrl-C does, so that what a stage started (a vLLM worker and its engine, a Prefect server) is
    ended and finished work is kept. Left out of `main`, which tests call in their own process."""
    from moplex_core.processes import stop_on_signals_until_exit

    stop_on_signals_until_exit()
    return main()


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (its write end then polls as an error)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (captured), or no poll on this platform
        return False


if __name__ == "__main__":
    sys.exit(console_main())
