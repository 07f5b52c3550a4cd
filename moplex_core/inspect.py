"""Readable text reports of artifacts (`moplex inspect PATH`).

PATH may be an artifact version folder (finished or not), its ``manifest.json``, any Parquet file,
a stage folder or the artifact root (both listed). Every version report has the manifest, the files,
and for each table (the row shards together, then every other Parquet file): schema, row counts
per split and cluster when those columns exist, and the first rows. A stage adds its own section by
registering a function with `stage_section`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moplex_core.artifacts import (CHECKPOINTS, MANIFEST, ArtifactStore, is_stage_folder, is_version_folder,
                                   off_the_manifest, output_files, readable_manifest, run_changes, shard_paths)
from moplex_core.artifacts.layout import SHARD_RE, STAGE_ORDER, VERSION_NAME
from moplex_core.artifacts.writer import last_started_run
from moplex_core.display import printable

StageSection = Callable[[Path, list[Path]], list[str]]
_SHARDS_LISTED = 8  # a version with more lists its shards in one line
_STAGE_SECTIONS: dict[str, StageSection] = {}
_CELL = 70
_METRIC_COLUMNS = {"metric", "value", "split", "cluster"}  # a metrics table (evaluate's, compare's)
_UNREADABLE = (pa.ArrowException, OSError, UnicodeDecodeError)
"""What reading a damaged Parquet file raises: one cut short by a kill, tables that do not agree, a
changed byte in its text."""


def stage_section(stage: str) -> Callable[[StageSection], StageSection]:
    """Register ``fn(version_dir, shard_paths) -> lines``, added to the report of ``stage`` artifacts."""

    def register(fn: StageSection) -> StageSection:
        _STAGE_SECTIONS[stage] = fn
        return fn

    return register


def inspect_path(path: str | Path, rows: int = 3, *, verify: bool = False, damaged: list[str] | None = None) -> str:
    """The report of ``path`` (see `moplex inspect --help`), every character of the data that a
    terminal would act on (escape sequences, carriage returns, bidi overrides) written as an escape.
    With ``verify`` a version's files (a listing's every version's) are checked against the sha256 their
    manifest records, not only their sizes: each file read once. The folders of the versions it
    reports DAMAGED are appended to ``damaged`` when given (`moplex inspect` exits 1 on any)."""
    return printable(_report(Path(path), rows, verify, [] if damaged is None else damaged))


def _report(path: Path, rows: int, verify: bool, damaged: list[str]) -> str:
    if path.is_file() and path.name == MANIFEST and is_version_folder(path.parent):
        return _version_report(path.parent, rows, verify, damaged)
    if path.is_file() and path.suffix == ".parquet":
        try:
            return "\n".join(_readable_table_report(path.name, [path], rows))
        except _UNREADABLE as err:  # asked for by name: an error, not a line of a report
            raise ValueError(f"{path} is not a readable Parquet file ({err})") from None
    if path.is_dir() and is_version_folder(path):
        return _version_report(path, rows, verify, damaged)
    if path.is_dir() and path.parent.name in STAGE_ORDER and path in _partial_versions(path.parent.parent,
                                                                                        path.parent.name):
        return f"{path}: PARTIAL, {_partial_state(path)} ({_bytes(_folder_bytes(path))} on disk)"
    if path.is_dir():
        version = next((parent for parent in path.resolve().parents if is_version_folder(parent)), None)
        return _listing(path, verify, damaged) if version is None else _folder_in_version(path, version)
    if path.exists():
        raise FileNotFoundError(f"{path} is not an artifact folder, a manifest.json or a Parquet file "
                                "(it exists: open it with a viewer of its own kind)")
    raise FileNotFoundError(
        f"{path} is not an artifact folder, a manifest.json or a Parquet file (nothing exists there)"
    )


def _version_report(version_dir: Path, rows: int, verify: bool, damaged_versions: list[str]) -> str:
    manifest: dict[str, Any] = readable_manifest(version_dir) or {}  # {} unfinished, or damaged after the fact
    complete = bool(manifest)
    stage = manifest.get("stage", version_dir.parent.name)
    title = f"artifact {stage}/{manifest.get('version', version_dir.name)}"
    lines = [title, "=" * len(title), f"path:     {version_dir}"]
    shards = shard_paths(version_dir)
    off = off_the_manifest(version_dir, manifest, hashes=verify) if complete else []
    damaged = sorted(set(off) & set(output_files(manifest))) if complete else []
    if damaged:
        damaged_versions.append(str(version_dir))
        refused = ("a stage refuses a file missing or cut short by its name, and a row shard changed in place when "
                   "it reads it, but reads another changed file as it is" if verify
                   else "a stage that finds this version refuses it by these names")
        lines.append(f"status:   DAMAGED: {', '.join(damaged)} missing or not the size{' or sha256' if verify else ''} "
                     f"{MANIFEST} records (an interrupted copy, a damaged disk, an edit, a deletion by hand?): "
                     f"{refused}; delete the version folder and rerun its stage")
    if complete:
        lines += [
            *([] if damaged else
              [f"status:   complete{' (resumed after an interruption)' if manifest.get('resumed') else ''}"
               f"{'; every file the stages read has the sha256 its manifest records' if verify else ''}"]),
            f"rows:     {_size(manifest)}",
            f"code:     {manifest.get('code_version') or '-'}",
            f"started:  {manifest.get('started')}   finished: {manifest.get('finished')}",
            *_earlier_runs(manifest),
            "inputs:   " + (", ".join(f"{k} = {v}" for k, v in manifest["inputs"].items()) or "none"),
            "config:", *_key_lines(manifest["config"]),
        ]
        if manifest.get("summary"):
            lines += ["summary:", *_key_lines(manifest["summary"])]
        checkpoints = {name: entry for name, entry in manifest["files"].items() if name.startswith(f"{CHECKPOINTS}/")}
        shard_names = sorted(name for name in manifest["files"] if SHARD_RE.match(name))
        folded = shard_names if len(shard_names) > _SHARDS_LISTED else []  # hundreds of shards would bury the rest
        lines += ["files:"] + [
            f"  {name:<40} {entry['bytes']:>12,} B  sha256 {entry['sha256'][:12]}"
            for name, entry in sorted(manifest["files"].items()) if name not in checkpoints and name not in folded
        ]
        if folded:
            lines.append(f"  {folded[0] + ' .. ' + folded[-1]:<40} "
                         f"{sum(manifest['files'][name]['bytes'] for name in folded):>12,} B  in {len(folded)} shards "
                         "(each with its sha256 in manifest.json)")
        if checkpoints:
            gone = len(off) - len(damaged)  # nothing reads them once the version is finished: free to delete
            lines.append(f"  {CHECKPOINTS + '/':<40} {sum(e['bytes'] for e in checkpoints.values()):>12,} B  in "
                         f"{len(checkpoints)} files: every EM iteration's checkpoint (`moplex inspect "
                         f"{version_dir / CHECKPOINTS}` lists them; a Parquet file there opens on its own)"
                         + (f"; {gone} of them deleted or changed since, which no stage minds: none reads them once "
                            "the version is finished" if gone else ""))
        libs = manifest.get("library_versions", {})
        lines.append("libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(libs.items())))
        if manifest.get("runtime"):  # torch's thread count (manifests since commit 88a0104)
            lines.append("runtime:  " + ", ".join(f"{k} {v}" for k, v in sorted(manifest["runtime"].items())))
    elif (version_dir / MANIFEST).is_file():
        damaged_versions.append(str(version_dir))
        lines.append(f"status:   DAMAGED: {MANIFEST} cannot be read (damaged after it was written); delete the "
                     "version folder and rerun the stage")
    else:
        code = _started_by(version_dir)
        lines.append(f"status:   INCOMPLETE (no {MANIFEST}): {_so_far(version_dir)}; rerun the stage with the same "
                     f"config to resume, on a moplex whose stage writes {code or 'the same code version'}: one whose "
                     "stage code changed since (an upgrade) builds another version and never finishes this one, "
                     "which can then be deleted")
        run = last_started_run(version_dir) or {}
        if code:
            lines.append(f"code:     {code} (that of the last run that worked on it)")
        if run.get("started"):
            lines.append(f"started:  {run['started']} (the last run that worked on it)")
        if isinstance(run.get("inputs"), dict):
            lines.append("inputs:   " + (", ".join(f"{k} = {v}" for k, v in run["inputs"].items()) or "none"))
        if isinstance(run.get("config"), dict):
            lines += ["config:", *_key_lines(run["config"])]
    if shards:
        lines += [""] + _table_report("rows (part-*.parquet)", shards, rows)
        section = _STAGE_SECTIONS.get(stage)
        if section is not None:
            try:
                lines += [""] + section(version_dir, shards)
            except _UNREADABLE as err:
                lines += ["", f"-- {stage} section: unreadable: {err} --"]
    last = {path.parent for path in _last_iterations(version_dir)}
    others = sorted(p for p in version_dir.rglob("*.parquet") if p not in shards
                    and not any(part.startswith(".") for part in p.relative_to(version_dir).parts)
                    and not (p.relative_to(version_dir).as_posix().startswith(f"{CHECKPOINTS}/")
                             and (complete or (p.parent.name.startswith("iter-") and p.parent not in last))))
    for other in others:
        lines += [""] + _table_report(other.relative_to(version_dir).as_posix(), [other], rows)
    return "\n".join(lines)


def _table_report(title: str, files: list[Path], rows: int) -> list[str]:
    try:
        return _readable_table_report(title, files, rows)
    except _UNREADABLE as err:
        return [f"-- {title}: unreadable: {err} --"]


def _readable_table_report(title: str, files: list[Path], rows: int) -> list[str]:
    schema = pq.read_schema(files[0])
    n = sum(pq.read_metadata(f).num_rows for f in files)
    lines = [f"-- {title}: {n} rows --", "schema:", _indent(schema.to_string(show_schema_metadata=False))]
    keys = [name for name in ("cluster", "split") if name in schema.names]
    if _METRIC_COLUMNS <= set(schema.names):  # rows of metrics: their values, not counts
        lines += _metric_values(files)
    elif keys and n:
        counts = _value_counts(files, keys)  # one row per value (pair), however many rows the files hold
        frame = pd.DataFrame({name: _labels(counts.column(name)) for name in keys})
        rows_of = counts.column(_ROWS).to_numpy()
        if len(keys) == 2:
            total = "(total)"  # a name no cluster or split has (evaluate's metrics use cluster "all")
            while total in set(frame["cluster"]) | set(frame["split"]):
                total = f"({total})"
            table = pd.crosstab(frame["cluster"], frame["split"], values=rows_of, aggfunc="sum", margins=True,
                                margins_name=total).fillna(0).astype(int)
            lines += ["rows per cluster x split:", _indent(table.to_string())]
        else:
            per_value = pd.Series(rows_of, index=frame[keys[0]], name="count").groupby(level=0, observed=True).sum()
            lines += [f"rows per {keys[0]}:", _indent(per_value.sort_index().rename_axis(keys[0]).to_string())]
    head = _head(files, rows)
    for i, record in enumerate(head):
        lines.append(f"row {i}:")
        width = max(len(k) for k in record)
        lines += [f"  {k:<{width}}  {_cell(v)}" for k, v in record.items()]
    return lines


def _metric_values(files: list[Path]) -> list[str]:
    """A metrics table's (evaluate's metrics.parquet, compare's comparison.parquet) values over all
    rankings: metric x split, per method where it holds several, the mean where several seeds."""
    frame = pd.concat(pq.read_table(f).to_pandas() for f in files)
    frame = frame[frame["cluster"] == "all"]
    if frame.empty:
        return []
    index = ["method", "metric"] if "method" in frame and frame["method"].nunique() > 1 else ["metric"]
    table = frame.pivot_table(index=index, columns="split", values="value", aggfunc="mean", sort=False,
                              dropna=False)  # a metric without a value anywhere (ARI of one ranking) shows as "-"
    rows = frame[index].drop_duplicates()  # what the table holds, in its order: not every method x metric pair
    table = table.reindex(pd.MultiIndex.from_frame(rows) if len(index) > 1 else pd.Index(rows[index[0]]))
    seeds = frame["seed"].nunique() if "seed" in frame else 1
    title = f"values over all rankings ({' x '.join(index)} x split{f'; mean of {seeds} seeds' if seeds > 1 else ''}):"
    return [title, _indent(table.apply(_row_text, axis=1).to_string())]


def _row_text(row: pd.Series) -> pd.Series:
    """One metric's values as text: whole numbers where every value is one and one is above 1 (counts
    such as ``rankings``; a fraction of 1 or 0 is no count), four decimals otherwise; "-" where a split
    lacks the metric."""
    values = row.dropna()
    whole = bool(len(values)) and bool((values == values.round()).all()) and bool((values.abs() > 1).any())
    return row.map(lambda v: "-" if pd.isna(v) else f"{v:.0f}" if whole else f"{v:.4f}")


def _labels(column: pa.ChunkedArray) -> pd.Categorical:
    """A column's values as text in their own order (integers as numbers: 2 before 10), "<null>" last;
    pandas would turn an integer column with nulls into floats (1.0) that cannot sort beside "<null>"."""
    values = column.to_pylist()
    present = sorted({v for v in values if v is not None})
    order = [str(v) for v in present] + (["<null>"] if None in values else [])
    return pd.Categorical(["<null>" if v is None else str(v) for v in values], categories=order, ordered=True)


_ROWS = "__rows"
_COUNT_BATCH = 1 << 20  # rows read at a time to count values: 5M rows of cluster x split in 1.1 s, 232 MB


def _value_counts(files: list[Path], keys: list[str]) -> pa.Table:
    """The ``keys`` columns' distinct values (pairs) and how many rows hold each (column ``_ROWS``),
    counted a batch at a time: a file of millions of rows costs a batch of memory, not its columns."""
    parts = []
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=_COUNT_BATCH, columns=keys):
            parts.append(pa.Table.from_batches([batch]).group_by(keys).aggregate([([], "count_all")]))
    counted = pa.concat_tables(parts).group_by(keys).aggregate([("count_all", "sum")])
    return counted.select([*keys, "count_all_sum"]).rename_columns([*keys, _ROWS])


def _counting_columns(files: list[Path], names: tuple[str, ...]) -> pa.Table:
    present = [c for c in names if c in pq.read_schema(files[0]).names]
    return pa.concat_tables(pq.read_table(f, columns=present) for f in files)


def _head(files: list[Path], rows: int) -> list[dict[str, Any]]:
    head: list[dict[str, Any]] = []
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=max(rows, 1)):
            head += batch.to_pylist()[: rows - len(head)]
            break
        if len(head) >= rows:
            break
    return head


def _cell(value: Any) -> str:
    text = f"{len(value)} items: {value!r}" if isinstance(value, list) else repr(value)
    return text if len(text) <= _CELL else text[: _CELL - 3] + "..."


def _started_by(version_dir: Path) -> str | None:
    """The stage code version of the last run that worked on an unfinished version, as its start
    marker records it (since commit 53ff48d); None where it records none or cannot be read."""
    code = (last_started_run(version_dir) or {}).get("code_version")
    return code if isinstance(code, str) and code else None


def _earlier_runs(manifest: dict[str, Any]) -> list[str]:
    """For a version written over several runs: each earlier run's start, and what it ran with that
    the finishing run did not (config values, library versions)."""
    runs = manifest.get("runs") or []
    if len(runs) < 2:
        return []
    lines = [f"runs:     {len(runs)} (this version was worked on by {len(runs) - 1} earlier run(s))"]
    for i, run in enumerate(runs[:-1], 1):
        changes = run_changes(run, manifest)
        lines.append(f"  run {i} started {run['started']}: " + ("; ".join(changes) if changes else "same config and libraries"))
    return lines


def _key_lines(mapping: dict[str, Any], width: int = 200) -> list[str]:
    """One line per key; a mapping too long for a line (the cache's `model_files` digests) by its keys."""
    lines = []
    for key, value in sorted(mapping.items()):
        text = json.dumps(value, sort_keys=True)
        if len(text) > width and isinstance(value, dict):
            names = sorted(value)
            text = (f"{len(value)} entries: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''} "
                    f"(values in {MANIFEST})")
        lines.append(f"  {key}: {text}")
    return lines


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _size(manifest: dict[str, Any], short: bool = False) -> str:
    """A finished version's rows, or its files where the stage writes named files, not row shards."""
    if manifest["shards"]:
        return f"{manifest['rows']:,} rows" if short else f"{manifest['rows']:,} in {manifest['shards']} shard(s)"
    files = len(manifest["files"])
    return f"{files} files" if short else f"no part-*.parquet shards: the stage writes the {files} named files below"


def _made_from(stage: str, record: dict[str, Any], kept: dict[str, bool | None]) -> str:
    """What a version was made from, in a few words: an ingest's dataset (and file or folder name),
    another stage's upstream versions by short version, each that is not a finished version of the root
    now marked ``(gone)``, ``(unfinished)`` or ``(partial)`` (``kept``: each version of the root, whether
    finished; None for a folder of one left in part, `_partial_versions`)."""
    if stage == "ingest":
        config = record.get("config") or {}
        return str(config.get("dataset", "")) + (f" {Path(str(config['path'])).name}" if config.get("path") else "")
    refs = [_short_ref(ref) + ("" if kept.get(ref) else " (gone)" if ref not in kept else
                                " (partial)" if kept[ref] is None else " (unfinished)") for ref in _upstream(record)]
    return ("from " + ", ".join(refs)) if refs else ""


# The tiny model's stage and folder, ROOT/model/VERSION/model: moplex_core.tiny_model's STAGE and MODEL_DIR, not
# imported here, as that module loads transformers (ten seconds before a listing).
_TINY_MODEL = "model"


def _upstream(record: dict[str, Any]) -> list[str]:
    """The versions a version (its manifest, or an unfinished one's last run record) was made from, as
    ``stage/version``: its input artifacts, and the pipeline's tiny model where its config's ``model``
    is one (the cache, augment and train stages load it; a moved root's is found in the root that holds
    them, as `moplex_core.cache.cache_model` does)."""
    inputs, config = record.get("inputs"), record.get("config")
    refs = [str(value) for value in (inputs.values() if isinstance(inputs, dict) else ())
            if "/" in str(value) and not str(value).startswith(("sha256:", "hub:"))]
    model = PurePath(config["model"]) if isinstance(config, dict) and isinstance(config.get("model"), str) else None
    if model is not None and len(model.parts) >= 3 and model.name == model.parent.parent.name == _TINY_MODEL:
        refs.append(f"{_TINY_MODEL}/{model.parent.name}")
    return sorted(set(refs))


def _short_ref(ref: str) -> str:
    stage, _, version = ref.partition("/")
    return f"{stage}/{version[:4]}"


def _bytes(size: float) -> str:
    """A size on disk in a few characters, in powers of 1000 as `ls -h --si` and `df -H` write them."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 999.95:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _folder_in_version(folder: Path, version_dir: Path) -> str:
    """A folder inside an artifact (a train artifact's adapters/ or em/): its files, and where the
    artifact's own report is."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    lines = [f"{folder}: a folder of the artifact {version_dir.parent.name}/{version_dir.name} "
             f"(`moplex inspect {version_dir}` reports it; a Parquet file here opens on its own)"]
    lines += [f"  {str(p.relative_to(folder)):<48} {p.stat().st_size:>12,} B" for p in files] or ["  (no files)"]
    return "\n".join(lines)


def _listing(directory: Path, verify: bool, damaged: list[str]) -> str:
    """A stage folder or an artifact root: one line per version, with what a user deciding what to keep
    needs: whether it finished, its size on disk, when it finished (an unfinished one: when its last run
    started), what it was made from, which versions of the root were made from it (``used by``: their
    manifests name it), and where a stage has several versions, the settings they differ in. A finished
    version is DAMAGED where a file its stages read is not the size (with ``verify``, the sha256) its
    manifest records."""
    is_stage_dir = is_stage_folder(directory)
    store = ArtifactStore(directory.parent if is_stage_dir else directory)
    everything = store.list()  # the whole root, for what a stage folder's versions are made from and used by
    infos = [info for info in everything if not is_stage_dir or info.ref.stage == directory.name]
    everywhere = _partial_versions(store.root, None)  # the pipeline's stages' folders
    partial = _partial_versions(store.root, directory.name) if is_stage_dir else everywhere
    if not infos and not partial:
        return f"{directory}: no artifacts"
    records = {str(info.ref): info.manifest or last_started_run(info.path) or {} for info in everything}
    kept: dict[str, bool | None] = {str(info.ref): info.complete for info in everything}
    kept.update((f"{p.parent.name}/{p.name}", None) for p in {*partial, *everywhere})
    used_by: dict[str, list[str]] = {}
    for ref, record in records.items():
        for upstream in _upstream(record):
            used_by.setdefault(upstream, []).append(_short_ref(ref))
    differing = _differing_settings({ref: record for ref, record in records.items()
                                     if isinstance(record.get("config"), dict)})
    lines, total = [], 0
    for info in infos:
        ref = str(info.ref)
        if info.complete:
            off = off_the_manifest(info.path, info.manifest, hashes=verify)
            size = _folder_bytes(info.path) if off else sum(entry["bytes"] for entry in info.manifest["files"].values())
            broken = bool(set(off) & set(output_files(info.manifest)))
            status = "DAMAGED " if broken else "complete"
            if broken:
                damaged.append(str(info.path))
            what = f"{_size(info.manifest, short=True):>16}  {info.manifest['finished']}"
        elif (info.path / MANIFEST).is_file():  # there, but not a manifest a stage can read
            size = _folder_bytes(info.path)
            status, what = "DAMAGED ", f"{MANIFEST} cannot be read"
            damaged.append(str(info.path))
        else:
            size = _folder_bytes(info.path)
            started = records[ref].get("started")
            status, what = "INCOMPLETE", f"{_so_far(info.path)} so far" + (f", started {started}" if started else "")
        total += size
        users = used_by.get(ref)
        fields = [f"{ref:<32} {status}  {_bytes(size):>8}  {what}", _made_from(info.ref.stage, records[ref], kept),
                  f"used by {', '.join(users)}" if users else "", f"[{differing[ref]}]" if differing.get(ref) else ""]
        lines.append("  " + "  ".join(field for field in fields if field))
    for folder in partial:
        size = _folder_bytes(folder)
        total += size
        lines.append(f"  {folder.parent.name + '/' + folder.name:<32} PARTIAL     {_bytes(size):>8}  "
                     f"{_partial_state(folder)}")
    checked = ", every file's sha256 checked" if verify else ""
    partly = f" and {len(partial)} partial folder(s)" if partial else ""
    return "\n".join([f"artifacts under {directory} ({len(infos)} version(s){partly}, {_bytes(total)} on disk"
                      f"{checked}):", *lines])


def _partial_state(folder: Path) -> str:
    """What a partial folder (`_partial_versions`) holds, and what to do with it."""
    which = (f"a {MANIFEST} without a stage, version and code version" if (folder / MANIFEST).is_file()
             else f"neither {MANIFEST} nor a run's start marker")
    return f"{which}: a version deleted, copied in part or edited; delete it before its stage runs again"


def _partial_versions(root: Path, stage: str | None) -> list[Path]:
    """The folders of the pipeline's stage folders under ``root`` (or of ``stage``'s) named as a stage
    names its versions that are not versions (`is_version_folder`): what a deletion or a copy by hand
    that stopped half way leaves. A folder of another name is the user's (a model kept in ROOT/model/),
    which no stage writes to; other folders of the root, an experiment's, are not looked at."""
    stages = [stage] if stage else [name for name in STAGE_ORDER if (root / name).is_dir()]
    return [folder for name in stages for folder in sorted((root / name).iterdir())
            if folder.is_dir() and VERSION_NAME.fullmatch(folder.name) and not is_version_folder(folder)]


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files below ``folder``, hidden ones too (a killed writer's temporaries); a link
    is not followed."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _differing_settings(records: dict[str, dict[str, Any]], most: int = 6) -> dict[str, str]:
    """For each stage with several versions, each version's settings (config keys, dotted, and
    ``code``, its stage's code version) whose values differ among them, as ``key=value`` (up to
    ``most`` keys, long values cut), so that a listing tells the versions apart; ``records``: each
    version's manifest, or an unfinished one's last run record, by ``stage/version``."""
    by_stage: dict[str, list[str]] = {}
    for ref in records:
        by_stage.setdefault(ref.partition("/")[0], []).append(ref)
    shown: dict[str, str] = {}
    for versions in by_stage.values():
        if len(versions) < 2:
            continue
        flat = [{**_flatten(records[ref]["config"]), "code": records[ref].get("code_version")} for ref in versions]
        keys = sorted({key for settings in flat for key in settings
                       if len({json.dumps(s.get(key), sort_keys=True) for s in flat}) > 1})
        for ref, settings in zip(versions, flat, strict=True):
            cells = [f"{key}={_short(settings[key]) if key in settings else '-'}" for key in keys[:most]]
            shown[ref] = " ".join(cells) + (f" (+{len(keys) - most} more)" if len(keys) > most else "")
    return shown


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _short(value: Any, width: int = 24) -> str:
    """A setting's value in at most ``width`` characters; a long one keeps its end (where two file
    paths differ, as often as not)."""
    text = json.dumps(value, separators=(",", ":"))
    if len(text) <= width:
        return text
    return f'"...{text[-(width - 4):]}' if isinstance(value, str) else "..." + text[-(width - 3):]  # quotes kept


def _last_iterations(version_dir: Path) -> list[Path]:
    """The state.json of each restart's last finished EM iteration of a train version, in restart order."""
    restarts = sorted((version_dir / CHECKPOINTS).glob("restart-*"))
    return [done[-1] for done in (sorted(r.glob("iter-*/state.json")) for r in restarts) if done]


def _so_far(version_dir: Path) -> str:
    """What an unfinished version has finished: EM iterations (train), else row shards."""
    last = _last_iterations(version_dir)
    if last:
        done = len(list((version_dir / CHECKPOINTS).glob("restart-*/iter-*/state.json")))
        return f"{done} finished EM iteration(s), the last {last[-1].parent.relative_to(version_dir).as_posix()}"
    if version_dir.parent.name == "train":  # it writes no shards: stopped before its first EM iteration ended
        return "no finished EM iteration"
    return f"{len(shard_paths(version_dir))} finished shard(s)"


@stage_section("ingest")
def _rankings_section(version_dir: Path, shards: list[Path]) -> list[str]:
    table = _counting_columns(shards, ("responses", "ranking", "ranked_prefix"))
    m = pc.list_value_length(table.column("responses")).to_pandas()
    tiers = pc.list_value_length(table.column("ranking")).to_pandas()
    partial = pc.sum(pc.less(table.column("ranked_prefix"), pc.list_value_length(table.column("ranking")))).as_py()
    return [
        "-- rankings --",
        "responses per ranking (m): " + _distribution(m),
        "tiers per ranking:         " + _distribution(tiers),
        f"rankings with ties: {int((tiers < m).sum())}   partially observed (ranked_prefix < tiers): {partial or 0}",
    ]


def _distribution(values: pd.Series) -> str:
    return ", ".join(f"{k}: {v}" for k, v in values.value_counts().sort_index().items())


@stage_section("augment")
def _augmented_section(version_dir: Path, shards: list[Path]) -> list[str]:
    table = _counting_columns(shards, ("generated", "generation", "generated_finished"))
    got = pc.list_value_length(table.column("generated")).to_pandas()
    generation = table.column("generation")
    attempts = pc.struct_field(generation, "attempts").to_pandas()
    settings = pa.table({name: pc.struct_field(generation, name)
                         for name in ("backend", "model", "temperature", "top_p", "max_new_tokens", "seed")})
    chars = pc.utf8_length(pc.list_flatten(table.column("generated"))).to_pandas()
    ended = pc.list_flatten(table.column("generated_finished")) if "generated_finished" in table.column_names else None
    cut = None if ended is None else int(pc.sum(pc.invert(ended)).as_py() or 0)
    shortfall = version_dir / "shortfall.parquet"
    short = pq.read_metadata(shortfall).num_rows if shortfall.is_file() else None
    lines = [
        "-- augmented --",
        "generated per ranking:     " + _distribution(got),
        "attempts per ranking:      " + _distribution(attempts),
        "generated text length:     " + (f"median {chars.median():.0f} chars, max {chars.max()}" if len(chars) else "-"),
        "cut at max_new_tokens:     " + ("not recorded (augment-2 or older)" if cut is None
                                         else f"{cut} of {len(chars)} texts (the cache scores them without EOS)"),
        "shortfall.parquet rows:    " + ("missing (the stage did not finish)" if short is None else str(short)),
        "generation settings:",
    ]
    distinct = settings.to_pandas().drop_duplicates()
    return lines + [_indent(distinct.to_string(index=False))]


@stage_section("cache")
def _cache_section(version_dir: Path, shards: list[Path]) -> list[str]:
    table = _counting_columns(shards, ("ref_logp", "input_ids", "split"))
    sizes = pc.list_value_length(table.column("ref_logp")).to_pandas()
    ref_logp = pc.list_flatten(table.column("ref_logp")).to_pandas()
    tokens = pc.list_value_length(pc.list_flatten(table.column("input_ids"))).to_pandas()
    return [
        "-- cache --",
        "responses per example (m'): " + _distribution(sizes),
        "examples per split:         " + _distribution(table.column("split").to_pandas()),
        "tokens per sequence:        " + (f"median {tokens.median():.0f}, max {tokens.max()}" if len(tokens) else "-"),
        "ref_logp:                   " + (f"median {ref_logp.median():.3f}, min {ref_logp.min():.3f}" if len(ref_logp) else "-"),
    ]

