"""Raw records of a dataset, read from a local file or folder, or from the Hugging Face hub by name.

A local source is a file or a folder of files in the dataset's raw schema (the schema the hub
serves): ``.jsonl`` / ``.jsonl.gz`` (one JSON object per line), ``.json`` (one JSON array of
objects) or ``.parquet``. Records are yielded one at a time, each with where it came from, so
adapters can name the file and line of a bad record. A record that cannot be read or does not have
the dataset's raw schema goes to `RawRejects`: in strict validation it stops the ingest with a
`RawSchemaError` naming it, in drop validation it is set aside (for rejected.parquet) and the others
are read on.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moplex_core.artifacts import is_version_folder
from moplex_core.hashing import files_fingerprint, sha256_file
from moplex_core.schema import DROP_MODE, json_text

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
_HUB_SPLIT_ORDER = ("train", "validation", "test")
NEWLINE = b"\n"

log = logging.getLogger(__name__)


class DatasetUnavailableError(RuntimeError):
    """The dataset cannot be read, and trying again would not help: offline, gated, unknown, or no
    local data where pointed."""


class HubUnreachableError(OSError):
    """The hub did not answer (a connection error, a timeout, a server error): trying again may help,
    and the pipeline retries it."""


class RawSchemaError(ValueError):
    """A raw record does not have the dataset's schema; the message names the record and field.
    ``field``: that field's path in the raw record (``completions[1].annotations.honesty.Rating``), where
    the error is about one, for rejected.parquet's ``field`` column."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Record:
    where: str  # e.g. "uf.jsonl line 3" or "openbmb/UltraFeedback (train) row 12"
    data: dict[str, Any]
    unreadable: RawSchemaError | None = None
    """Why the record could not be read (``data`` is then empty and ``raw`` holds its text)."""
    raw: str | None = None

    def require(self, fields: Iterable[str], dataset: str) -> None:
        missing = [f for f in fields if f not in self.data]
        if missing:
            raise RawSchemaError(
                f"{self.where}: a {dataset} record needs field(s) {missing}; it has {sorted(self.data)}. "
                f"Point the path at data in the {dataset} raw schema (DESIGN.md 6).", field=missing[0]
            )


@dataclass
class RawRejects:
    """The records an ingest could not read or that lack the dataset's raw schema. In strict
    validation (``drop`` False) the first one raises `RawSchemaError`, or with ``read_on`` (an
    ingest's strict mode) the source is read on and `raise_if_any` names them all at the end, up to
    `READ_ON_LIMIT`; in drop validation each is kept in ``rows`` (where, reason, the record as JSON
    text) and the others are read on. ``within``: the local source (a file or folder); the rows name
    its files relative to it, a single file not at all ("line 3"; the error raised names the whole
    path), so that rejected.parquet does not depend on where the source lies or what it is called, as
    its version does not."""

    drop: bool = False
    within: str | None = None
    read_on: bool = False
    rows: list[dict[str, str]] = field(default_factory=list)
    _strict: list[str] = field(default_factory=list, init=False, repr=False)  # read_on: reasons so far, whole paths

    def readable(self, records: Iterable[Record]) -> Iterator[Record]:
        """The records that could be read (see ``Record.unreadable``)."""
        for record in records:
            if record.unreadable is None:
                yield record
            else:
                self._reject(record, record.unreadable)

    @contextmanager
    def reading(self, record: Record) -> Iterator[None]:
        """Around an adapter's work on one record: a `RawSchemaError` rejects that record."""
        try:
            yield
        except RawSchemaError as err:
            self._reject(record, err)

    def _reject(self, record: Record, err: RawSchemaError) -> None:
        if not self.drop and not self.read_on:
            raise RawSchemaError(f"{err}; to set such records aside in rejected.parquet and read the rest, ingest in "
                                 f"drop mode: {DROP_MODE}", field=err.field) from err
        if not self.drop:
            self._strict.append(str(err))
            if len(self._strict) == READ_ON_LIMIT:
                self.raise_if_any(stopped=True)
            return
        text = record.raw if record.unreadable is not None else json_text(record.data)
        self.rows.append({"where": self.relative(record.where), "field": err.field, "reason": self.relative(str(err)),
                          "record": text})

    def raise_if_any(self, stopped: bool = False, then: RawSchemaError | None = None) -> None:
        """Strict with ``read_on``: raise `RawSchemaError` naming every record set aside (``stopped``:
        reading stopped at `READ_ON_LIMIT` of them; ``then``: the error that ended the reading after
        them, often their consequence)."""
        reasons, self._strict = self._strict, []  # raised once: the limit's error is not named again as `then`
        if not reasons:
            return
        count = f"the first {len(reasons)} (reading stopped there)" if stopped else str(len(reasons))
        after = f"\nAfter them, reading stopped at: {then}" if then is not None else ""
        raise RawSchemaError(
            f"{count} source record(s) cannot be read or lack the dataset's fields:\n"
            + "\n".join(f"  {reason}" for reason in reasons) + after
            + f"\nTo set such records aside in rejected.parquet and read the rest, ingest in drop mode: {DROP_MODE}")

    def relative(self, text: str) -> str:
        """``text`` with the local source left out of the paths it names: a folder's files relative to it,
        a single file's name dropped."""
        if self.within is None:
            return text
        source = Path(self.within)
        return text.replace(f"{source}{os.sep}" if source.is_dir() else f"{source} ", "")


STRICT = RawRejects()  # for adapters called without an ingest's settings
READ_ON_LIMIT = 50
"""How many unreadable records a strict ingest names before it stops reading (a file in another format
would otherwise be read to its end for one error per line)."""


def local_files(path: str | Path, *, say_skipped: bool = False) -> list[Path]:
    """The data files of a local source: the file itself, or every data file below a folder, sorted.
    ``say_skipped`` warns of a folder's other visible files (not read: a .csv, a README)."""
    path = Path(path)
    if path.is_file():
        if not path.name.endswith(DATA_SUFFIXES):
            raise DatasetUnavailableError(f"{path} is not a data file; expected one of {', '.join(DATA_SUFFIXES)}"
                                          f"{_lower_case_hint([path])}")
        return [path]
    if path.is_dir():
        if is_version_folder(path):
            raise DatasetUnavailableError(f"{path} is a moplex artifact, not a dataset: give the file or folder the "
                                          "rankings came from (an ingest artifact is read with load_table)")
        files, artifacts, others = [], [], []
        for folder, subfolders, names in os.walk(path):
            folder = Path(folder)
            # Hidden entries are never data; moplex's own artifacts (a root under the data folder,
            # such as the default data/artifacts beside data/raw) are not the user's records.
            visible = [d for d in subfolders if not d.startswith(".")]
            artifacts += [folder / d for d in visible if is_version_folder(folder / d)]
            subfolders[:] = sorted(d for d in visible if folder / d not in artifacts)
            files += [folder / n for n in names if n.endswith(DATA_SUFFIXES) and not n.startswith(".")
                      and (folder / n).is_file()]  # not a dangling link or a FIFO
            others += [folder / n for n in names if not n.endswith(DATA_SUFFIXES) and not n.startswith(".")]
        if others and say_skipped:
            log.warning("%s: %d file(s) that are not %s files are not read, e.g. %s", path, len(others),
                        ", ".join(DATA_SUFFIXES), ", ".join(str(f.relative_to(path)) for f in others[:3]))
        if artifacts:
            log.info("%s: skipped %d moplex artifact version folder(s), e.g. %s", path, len(artifacts), artifacts[0])
        if not files:
            skipped = f" (only moplex artifacts: {len(artifacts)} version folder(s))" if artifacts else ""
            if others:
                skipped += (f"; it holds {len(others)} other file(s), e.g. "
                            f"{', '.join(str(f.relative_to(path)) for f in sorted(others)[:3])}{_lower_case_hint(others)}")
            raise DatasetUnavailableError(f"{path} holds no {', '.join(DATA_SUFFIXES)} files{skipped}")
        return sorted(files)
    raise DatasetUnavailableError(f"{path} does not exist; pass the file or folder that holds the dataset")


def _lower_case_hint(files: list[Path]) -> str:
    """A hint for files whose suffix is a data file's but for its case (suffixes are matched as written)."""
    upper = [f.name for f in files if f.name.lower().endswith(DATA_SUFFIXES)]
    return f" (a suffix is matched as written: rename {upper[0]} with its suffix in lower case)" if upper else ""


def source_fingerprint(path: str | Path) -> str:
    """``sha256:<hash>`` of a local source's content: a file's bytes, or a folder's data files (their
    names relative to the folder, and bytes). Where the source lives and a single file's name do not
    count, so moving or renaming it keeps the artifact version."""
    path = Path(path)
    return files_fingerprint({f.relative_to(path).as_posix() if path.is_dir() else "": sha256_file(f)
                              for f in local_files(path)})


def iter_local_records(path: str | Path) -> Iterator[Record]:
    """Every record of a local source, in file order. A file that cannot be read as its format says
    (a .json file that is not UTF-8 or not JSON, a damaged gzip or Parquet file) raises
    `RawSchemaError` naming the file (and line); a line of a .jsonl file that cannot be read (not
    UTF-8, not JSON, not an object, a lone UTF-16 surrogate escape) is yielded as an unreadable
    record, for `RawRejects` to raise or set aside."""
    for file in local_files(path, say_skipped=True):
        if file.name.endswith(".parquet"):
            yield from _parquet_records(file)
        elif file.name.endswith(".json"):
            raw = file.read_bytes()
            _refuse_utf16(raw, file)
            text = _utf8(raw.removeprefix(codecs.BOM_UTF8), str(file), whole_file=True)
            rows = _parse_json(text, str(file), whole_file=True)
            if not isinstance(rows, list):
                raise RawSchemaError(f"{file} must hold a JSON array of records (or use .jsonl, one per line)")
            escapes = _SURROGATE_ESCAPE.search(text) is not None
            for row, data in enumerate(rows):
                where = f"{file} record {row}"
                try:
                    record = Record(where, _as_object(data, where))
                    if escapes:
                        _no_lone_surrogates(record.data, where)
                except RawSchemaError as err:
                    record = Record(where, {}, err, json.dumps(data))
                yield record
        else:
            opener = gzip.open if file.name.endswith(".gz") else open
            try:
                with opener(file, "rb") as f:
                    for line_no, raw in enumerate(f, start=1):
                        where = f"{file} line {line_no}"
                        if line_no == 1:
                            _refuse_utf16(raw, file)
                            raw = raw.removeprefix(codecs.BOM_UTF8)  # as Windows tools write UTF-8
                        try:
                            line = _utf8(raw, where, whole_file=False)
                            if not line.strip():
                                continue
                            record = Record(where, _as_object(_parse_json(line, where, whole_file=False), where))
                            if _SURROGATE_ESCAPE.search(line):
                                _no_lone_surrogates(record.data, where)
                        except RawSchemaError as err:
                            text = raw.decode("utf-8", errors="backslashreplace").rstrip("\r\n")
                            record = Record(where, {}, err, text)
                        yield record
            except (gzip.BadGzipFile, EOFError, zlib.error) as err:
                raise RawSchemaError(f"{file} is not a readable gzip file ({err}); recompress it or pass the "
                                     ".jsonl uncompressed") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the JSON escape of a UTF-16 surrogate


def _no_lone_surrogates(value: Any, where: str, path: str = "", name: str | None = None) -> None:
    """Raise when a string in a parsed JSON value holds an unpaired surrogate (``"\\ud83d"`` without
    its pair is valid JSON but no text: it cannot be written as UTF-8, so nothing could hash or store it).
    ``path``: where ``value`` lies in the record (a key: where its object lies); ``name``: what the
    message calls it where that is not its path (a key)."""
    if isinstance(value, str):
        at = next((i for i, ch in enumerate(value) if "\ud800" <= ch <= "\udfff"), None)
        if at is not None:
            raise RawSchemaError(f"{where}, field {name or path!r}: character {at} is a lone UTF-16 surrogate "
                                 f"(\\u{ord(value[at]):04x}, half of an emoji or other character whose other half is "
                                 "missing), which is no text; fix or drop that character in the source",
                                 field=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_lone_surrogates(key, where, path, f"{path} (a key)" if path else "a key")
            _no_lone_surrogates(item, where, f"{path}.{key}" if path else str(key))  # the key has none (above)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_lone_surrogates(item, where, f"{path}[{i}]")


def _parquet_records(file: Path) -> Iterator[Record]:
    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
    except (pa.ArrowException, OSError) as err:
        raise RawSchemaError(f"{file} is not a readable Parquet file ({err}); rewrite it with pyarrow or "
                             "pandas.to_parquet, or pass the data as .jsonl") from None
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            raise RawSchemaError(f"{file} is damaged after row {row} ({err}); rewrite the file") from None
        if batch is None:
            return
        try:
            records = batch.to_pylist()
        except UnicodeDecodeError:  # a string column that Arrow holds unchecked
            raise RawSchemaError(_not_utf8(file, batch, row)) from None
        for data in records:
            yield Record(f"{file} row {row}", data)
            row += 1


def _not_utf8(file: Path, batch: pa.RecordBatch, first_row: int) -> str:
    """Where a Parquet batch that starts at ``first_row`` holds text that is not UTF-8."""
    for i in range(batch.num_rows):
        for name in batch.schema.names:
            try:
                batch.column(name)[i].as_py()
            except UnicodeDecodeError:
                return (f"{file} row {first_row + i} field {name!r} is not UTF-8 text; rewrite the file with its "
                        "strings in UTF-8")
    return f"{file} holds text that is not UTF-8 after row {first_row}; rewrite the file with its strings in UTF-8"


def _refuse_utf16(head: bytes, file: Path) -> None:
    """Raise for a file that starts with a UTF-16 (or UTF-32) byte-order mark (Windows PowerShell 5's
    ``>`` and ``Out-File`` write UTF-16): read as UTF-8 every line of it would be unreadable."""
    encoding = next((name for name, boms in (("utf-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
                                             ("utf-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)))
                     if head.startswith(boms)), None)
    if encoding is not None:
        convert = f"iconv -f {encoding} -t utf-8"
        command = (f"gunzip -c IN | {convert} | gzip > OUT" if file.name.endswith(".gz") else f"{convert} IN > OUT")
        raise RawSchemaError(f"{file} is {encoding.upper()} text (it starts with a {encoding.upper()} byte-order "
                             f"mark); re-encode it as UTF-8, e.g. `{command}`, or write it with `Out-File -Encoding "
                             "utf8`")


def _utf8(raw: bytes, where: str, *, whole_file: bool) -> str:
    """``raw`` (one line of a file, or a whole .json file) decoded, or an error saying where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(NEWLINE, 0, err.start) + 1
        at = f"byte {err.start - line_start + 1}"
        if whole_file:
            at = f"line {raw.count(NEWLINE, 0, err.start) + 1}, {at}"
        raise RawSchemaError(
            f"{where} is not UTF-8 text ({at} is {raw[err.start:err.end]!r}); re-encode the file as UTF-8, "
            "e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None


def _parse_json(text: str, where: str, *, whole_file: bool) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        if whole_file:
            at = f"line {err.lineno}, column {err.colno}"
        else:  # the line's own column; a record cut short fails past its last character
            at = "at the end of the line" if err.pos >= len(text.rstrip()) else f"column {err.pos + 1}"
        expected = "a JSON array of objects" if whole_file else "one JSON object per line"
        raise RawSchemaError(f"{where} is not valid JSON ({at}: {err.msg}); expected {expected}") from None
    except RecursionError:  # arrays or objects nested about a thousand deep: no dataset's record is
        raise RawSchemaError(f"{where} nests JSON arrays or objects too deeply to read (Python's recursion "
                             "limit); no dataset's record is nested like that") from None


def iter_hub_records(name: str, revision: str | None, dataset: str,
                     parts: Sequence[dict[str, str]] = ({},)) -> Iterator[Record]:
    """Every split of a hub dataset (train, validation, test, then others), row by row, of each part
    in turn: ``parts`` are `datasets.load_dataset` keyword arguments such as ``{"name": "survey"}``
    (a config) or ``{"data_dir": "preference"}``; ``{}`` is the default config."""
    import datasets  # imported here: slow to import and only needed with hub access

    for part in parts:
        shown = ", ".join(f"{key} {value!r}" for key, value in part.items())
        try:
            loaded = datasets.load_dataset(name, revision=revision, **part)
        except OSError as err:  # ConnectionError, offline mode, DatasetNotFoundError (gated/unknown)
            # DatasetNotFoundError (unknown or gated) is a FileNotFoundError; so is what datasets makes of a
            # hub that did not answer (a server error or timeout after huggingface_hub's own retries).
            permanent = _offline(datasets, err) or (isinstance(err, FileNotFoundError) and not _no_answer(err))
            raise (DatasetUnavailableError if permanent else HubUnreachableError)(
                f"could not load {name!r} ({f'{shown}, ' if shown else ''}revision {revision or 'latest'}) "
                f"from the Hugging Face hub: {err}\n"
                f"Without hub access, download it where the hub is reachable, e.g. `hf download "
                f"{name} --repo-type dataset{f' --revision {revision}' if revision else ''} --local-dir DIR`, copy "
                f"DIR here and pass it as the local path: `moplex ingest --dataset {dataset} --path DIR` "
                f"(`moplex run ... --set ingest.path=DIR` in a pipeline; IngestConfig(dataset={dataset!r}, "
                "path='DIR') in Python). A file or folder of .jsonl/.json/.parquet "
                "in the dataset's raw schema works. Gated datasets (PERSONA) also need their terms accepted "
                "and `hf auth login` (the `hf` command of huggingface_hub)."
            ) from err
        order = sorted(loaded, key=lambda s: (_HUB_SPLIT_ORDER.index(s) if s in _HUB_SPLIT_ORDER else 99, s))
        for split in order:
            for row, data in enumerate(loaded[split]):
                yield Record(f"{name} ({f'{shown}, ' if shown else ''}{split}) row {row}", data)


HTTP_CLIENTS = ("httpx", "httpx2")
"""The HTTP clients huggingface_hub has used (2.x: httpx2); their errors are the hub not answering."""


def hub_commit(name: str, dataset: str, revision: str | None = None) -> str:
    """The commit hub dataset ``name``'s ``revision`` (a branch or tag; None: its main branch) is at
    now. A source pinned to no commit is read, and versioned, at it: a dataset updated on the hub then
    makes a new version, not a reuse of the old rankings under the same one. Offline, unknown or gated:
    `DatasetUnavailableError`; no answer: `HubUnreachableError` (the pipeline retries it)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    advice = (f"pin a revision (`--set revision=COMMIT` on `moplex ingest`, `--set ingest.revision=COMMIT` on `moplex "
              f"run`), or download it where the hub is reachable "
              f"(`hf download {name} --repo-type dataset --local-dir DIR`) and pass DIR: `moplex ingest --dataset "
              f"{dataset} --path DIR` (`--set ingest.path=DIR` in a pipeline)")
    named = f"{name} at {revision!r}" if revision else f"{name} (no revision named)"
    try:
        return HfApi().dataset_info(name, revision=revision).sha
    except (OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise DatasetUnavailableError(f"{named}: the commit it is at could not be read from the Hugging Face hub "
                                      f"({type(err).__name__}: {err}); {advice}") from err
    except Exception as err:  # a server error, or the HTTP client's (httpx or httpx2, by huggingface_hub's version)
        if not isinstance(err, HfHubHTTPError | OSError) and type(err).__module__.split(".")[0] not in HTTP_CLIENTS:
            raise
        raise HubUnreachableError(f"{named}: the Hugging Face hub did not say which commit it is at "
                                  f"({type(err).__name__}: {err}); retry, or {advice}") from err


def _offline(datasets: Any, err: OSError) -> bool:
    """Whether the hub was not asked at all: offline mode (its setting, or the error it raises)."""
    setting = getattr(getattr(datasets, "config", None), "HF_HUB_OFFLINE", False)
    return bool(setting) or "OfflineModeIsEnabled" in f"{type(err).__name__} {err}"


def _no_answer(err: BaseException) -> bool:
    """Whether the hub did not answer: huggingface_hub's LocalEntryNotFoundError (raised when the hub
    cannot be reached and nothing is cached), which datasets passes on inside its own message."""
    while err is not None:
        if "LocalEntryNotFoundError" in f"{type(err).__name__} {err}":
            return True
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return False


def _as_object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RawSchemaError(f"{where} is a JSON {type(data).__name__}; records are JSON objects")
    return data


@dataclass
class AdapterOutput:
    """What every adapter returns: canonical `rankings` rows (``split`` None unless the source has
    one) and counts of what it read and skipped, for the manifest's summary."""

    rows: list[dict[str, Any]]
    stats: dict[str, int]
    where: list[str] | None = None
    """Per row, where its record was read (adapters that make one row per record), for error messages."""
    originals: list[dict[str, Any]] | None = None
    """Per row, its source record as read, where the row is that record with defaults filled in (the
    generic adapter): what drop mode's rejected.parquet gives back to fix and re-ingest, since a
    default derived from a bad value (ranked_prefix from a broken ranking) would outlive the fix."""


def most_frequent_profiles(rows: list[dict[str, Any]], top: int, stats: Counter[str]) -> list[dict[str, Any]]:
    """The rows of the ``top`` most frequent ``cluster`` labels (ties go to the first label); the
    others are counted as ``skipped_rare_profile``."""
    counts = Counter(row["cluster"] for row in rows)
    kept = {label for label, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]}
    stats["skipped_rare_profile"] = sum(1 for row in rows if row["cluster"] not in kept)
    return [row for row in rows if row["cluster"] in kept]
