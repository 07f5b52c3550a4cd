"""Prefect tasks of the end-to-end pipeline: the failure switch and the run's Prefect artifacts."""

from __future__ import annotations

import base64
import re
from collections.abc import Collection
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from moplex_core.artifacts import read_manifest
from moplex_core.config import FaultConfig
from moplex_core.evaluate import METRICS_FILE


class InjectedFault(RuntimeError):
    """The failure asked for by ``fault.stage`` (a test of retries, not a bug)."""


@task(name="injected-fault", cache_policy=NO_CACHE)
def fail_on_purpose(fault: FaultConfig, stage: str, run_count: int, retry: str) -> None:
    """Raise `InjectedFault` for ``stage`` (`flows.pipeline.moplex_pipeline` calls it where
    ``fault.stage`` is ``stage`` and this is one of the first ``fault.times`` runs); ``retry``: how to
    retry this flow run (`flows.pipeline.how_to_retry`)."""
    raise InjectedFault(
        f"stage {stage!r} fails on purpose (fault.stage = {fault.stage!r}, run {run_count} of the first "
        f"{fault.times} that fail). Retry this flow run ({retry}): the finished stages are "
        "reused, or set fault.stage to null."
    )


@task(name="publish-run-artifacts", cache_policy=NO_CACHE)
def publish_run_artifacts(stage_dirs: dict[str, str], reused: dict[str, bool], pipeline: bool = True) -> None:
    """Prefect artifacts of one pipeline run: the stage versions with their row counts and whether this
    run wrote or reused each (``reused``, `flows.pipeline.stage_outcome`), the metrics table, the
    report (plots embedded as data URIs) and the paths of every stage's Parquet files. Not ``pipeline``:
    a stage's own run (a stage deployment), whose version table and file list are its run's alone (no
    key: they do not stand in the UI's Artifacts page for a whole run's); an evaluation's metrics and
    report keep their keys (the latest evaluation's, from a pipeline or not)."""
    manifests = {stage: read_manifest(path) for stage, path in stage_dirs.items()}
    create_table_artifact(
        key="moplex-stages" if pipeline else None,
        table=[{"stage": stage, "version": m["version"], "this run": "reused" if reused.get(stage) else "wrote",
                "rows": m["rows"], "shards": m["shards"], "finished": m["finished"], "resumed": m["resumed"],
                "path": stage_dirs[stage]}
               for stage, m in manifests.items()],
        description="Artifact version and row count of every stage of this run; 'this run': whether it wrote the "
                    "version or found it complete (written by an earlier run, or an earlier attempt of this one).",
    )
    if "evaluate" in stage_dirs:
        evaluation = Path(stage_dirs["evaluate"])
        metrics = pd.read_parquet(evaluation / METRICS_FILE)
        create_table_artifact(key="moplex-metrics", table=metrics.astype({"value": float}).to_dict("records"),
                              description=f"{evaluation / METRICS_FILE}")
        create_markdown_artifact(key="moplex-report", markdown=_embed_plots(evaluation, manifests["evaluate"]["files"]),
                                 description=f"{evaluation}/report.md")
    create_markdown_artifact(key="moplex-files" if pipeline else None, markdown=_files_markdown(stage_dirs, manifests),
                             description="Where each stage's Parquet files are, on the machine that ran the stage.")


def _files_markdown(stage_dirs: dict[str, str], manifests: dict[str, dict]) -> str:
    """Every stage's top-level Parquet files as paths to copy (a browser opens no file:// link from the
    UI, nor one on another machine), and the command that reports each version."""
    lines = ["| stage | version | file |", "|---|---|---|"]
    for stage, path in stage_dirs.items():
        for name in sorted(manifests[stage]["files"]):
            if name.endswith(".parquet") and "/" not in name:
                lines.append(f"| {stage} | {manifests[stage]['version']} | `{(Path(path) / name).resolve()}` |")
    commands = "\n".join(f"    moplex inspect {Path(path).resolve()}" for path in stage_dirs.values())
    return "\n".join([*lines, "", "Each version's report (rows, columns, summary, EM iterations):", "", commands])


def _embed_plots(evaluation: Path, files: Collection[str]) -> str:
    """report.md with every ![...](plots/x.png) of the version's own ``files`` (its manifest's, which
    `read_manifest` has checked: no '..', nothing outside the folder) inlined, so the Prefect UI shows the
    plots; any other image reference stays as it is, never read (a report.md from elsewhere may name any file)."""
    def inline(match: re.Match) -> str:
        if match.group(2) not in files:
            return match.group(0)
        png = (evaluation / match.group(2)).read_bytes()
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(png).decode()})"

    return re.sub(r"!\[([^\]]*)\]\((plots/[^)]+\.png)\)", inline, (evaluation / "report.md").read_text())
