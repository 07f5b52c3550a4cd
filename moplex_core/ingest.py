"""The ingest stage without an orchestrator: a dataset in, a validated, split `rankings` artifact out.

    plan_ingest    which version this config (and local source content) maps to, and whether it exists
    build_rankings read the source, convert with its adapter, validate, split       (no files written)
    run_ingest     both, then write the artifact through the store (skipped when already complete)

`tasks/ingest.py` wraps these for Prefect; `moplex ingest` calls `run_ingest` directly.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest
from moplex_core.config import HUB_SOURCES, IngestConfig
from moplex_core.data import generic, helpsteer2, persona, prism, ultrafeedback
from moplex_core.data.sources import (
    AdapterOutput,
    RawRejects,
    RawSchemaError,
    Record,
    hub_commit,
    iter_hub_records,
    iter_local_records,
    source_fingerprint,
)
from moplex_core.data.splits import assign_splits, split_groups
from moplex_core.data.synthetic import SyntheticConfig, generate_synthetic
from moplex_core.schema import (RANKINGS_SCHEMA, REJECTED_SCHEMA, SPLITS, check_rankings, issues_by_field,
                                split_rejected)

log = logging.getLogger(__name__)

STAGE = "ingest"
# Bump when a change to this stage changes what it writes. Kept at ingest-1 on 2026-11-24: a strict
# ingest writes what it wrote; a drop-mode artifact of before then lacks rejected.parquet's `where`
# column (nothing reads it) and the summary's unreadable_records (read as 0, which it was: a source with
# unreadable records made no artifact before, it stopped); one written before unlabelled_rows (2026-11-24) counts the
# unlabelled rankings under "None" in the summary's rows_per_cluster (check_rankings_fit leaves it out); one
# written before 2026-11-25 leaves rejected.parquet's `field` empty for a source record set aside.
CODE_VERSION = "ingest-1"


@dataclass(frozen=True)
class Adapter:
    """How one dataset becomes rankings: ``read(config, records, source, raw)``, where ``records()``
    yields the source's raw records (never called for a generated dataset), and the adapter's own
    code version (None: the stage's alone)."""

    read: Callable[[IngestConfig, Callable[[], Iterator[Record]], str, RawRejects], AdapterOutput]
    version: str | None = None


# An adapter's own changes, added to its dataset's versions only (the others keep theirs). generic-2:
# a split column that is not kept no longer rejects rows (validation=drop kept fewer before);
# generic-3: rows that share a prompt text share a split whatever their prompt_ids; generic-4: an
# index or ranked_prefix with a fraction is refused (Arrow truncated it), one prompt text in two of the
# source's own splits is refused, an empty cluster label is refused, and drop mode's rejected record is
# the source record; generic-5: a row that drop mode rejects no longer claims its example_id or its
# prompt's split, so a later valid row that shares them is kept (it was rejected). ultrafeedback-2:
# ratings outside 1..5 (NaN, infinity) and annotations that are not objects are refused (they were
# ranked). persona-2: a "key:" line with no value is a field, not part of the previous value. prism-2:
# the release's "EMPTY STRING" (its empty texts) is no prompt or response (it was ranked as one).
# helpsteer2-2: a multi-turn prompt's turns become prompt_messages (helpsteer2.split_turns). generic-6: a
# prompt_messages that is empty or ends on the assistant's turn is refused (it was kept, to fail in augment).
# generic-7: a row without an example_id that repeats an earlier one, or whose made id a given one holds, is
# a ranking of its own, its made id numbered (-2, -3, ...; it was refused as a duplicate id). generic-8: the
# cluster labels 'all' and 'adapter cN' are refused (the evaluation's rows use them). ultrafeedback-3: a
# completion repeating an earlier one's text is read once (both copies could be drawn and ranked apart).
ADAPTERS: dict[str, Adapter] = {  # one per IngestConfig.dataset
    "ultrafeedback": Adapter(lambda c, records, source, raw: ultrafeedback.to_rankings(
        records(), c.ultrafeedback, source=source, seed=c.seed, rejects=raw), "ultrafeedback-3"),
    "persona": Adapter(lambda c, records, source, raw: persona.to_rankings(
        records(), c.persona, source=source, seed=c.seed, rejects=raw), "persona-2"),
    "helpsteer2": Adapter(lambda c, records, source, raw: helpsteer2.to_rankings(
        records(), c.helpsteer2, source=source, rejects=raw), "helpsteer2-2"),
    "prism": Adapter(lambda c, records, source, raw: prism.to_rankings(
        records(), c.prism, source=source, rejects=raw), "prism-2"),
    "generic": Adapter(lambda c, records, source, raw: generic.to_rankings(
        records(), source=source, keep_split=c.split.from_source), "generic-8"),
    "synthetic": Adapter(lambda c, records, source, raw: _synthetic(c)),
}


def code_version(dataset: str) -> str:
    """The code version of an ingest of ``dataset``: the stage's, plus its adapter's when it has one."""
    return "+".join([CODE_VERSION, *filter(None, [ADAPTERS[dataset].version])])


@dataclass(frozen=True)
class IngestPlan:
    ref: ArtifactRef
    path: Path
    # {"source": "sha256:...", "reader": LOCAL_READER} for a local source, {"revision": COMMIT} for a hub
    # source pinned to no commit (`_inputs`), else empty
    inputs: dict[str, str]
    complete: bool


@dataclass(frozen=True)
class BuiltRankings:
    table: pa.Table  # canonical rankings, split assigned
    rejected: pa.Table | None  # REJECTED_SCHEMA rows in drop mode, else None
    # (a source record that could not be read, or a row that breaks the contract, one per reason)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IngestResult:
    ref: ArtifactRef
    path: Path
    built: bool  # False: the version was already complete and nothing was done
    rows: int
    rejected: int = 0  # rows and unreadable records left out in validation="drop" mode (in rejected.parquet)


def plan_ingest(config: IngestConfig, store: ArtifactStore) -> IngestPlan:
    inputs = _inputs(config)
    version = store.version(STAGE, config.identity(), inputs, code_version(config.dataset))
    return IngestPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), inputs,
                      store.is_complete(STAGE, version))


def check_rankings_fit(rankings_dir: str | Path, *, k: int, splits: Sequence[str], labelled: bool = False) -> None:
    """Raise ValueError when a rankings artifact cannot make a pipeline run: no ``train`` rankings or
    none of a split evaluate scores (``splits``; a small source, or one that brings a single split),
    fewer training rankings than k clusters, or (``labelled``: EM starts from the labels) training
    rankings without a label or with other than k labels. The pipeline checks this right after
    ingest, before any model work; the train and evaluate stages would meet it only after generation
    and caching. Rankings labelled with other than k clusters are a warning: the clustering metrics
    then compare k clusters with those labels (an ablation of k may mean it)."""
    summary = read_manifest(rankings_dir)["summary"]
    per_split = summary["rows_per_split"]
    missing = [split for split in ("train", *splits) if not per_split.get(split)]
    if missing:
        raise ValueError(
            f"the rankings at {rankings_dir} have none of split(s) {missing} ({per_split or 'no rows'}); train "
            f"needs 'train' and evaluate scores {list(splits)}: give more rankings or other ingest.split "
            "fractions or sizes, or set evaluate.splits (with evaluate.fit_split among them)")
    check_clusters_fit(k, per_split["train"], f"the rankings at {rankings_dir} have")
    labels = sorted(summary["rows_per_cluster"])
    if "unlabelled_rows" not in summary:  # written before 2026-11-24: unlabelled rankings counted under "None"
        labels = [label for label in labels if label != "None"]
    if k > 1 and labels and len(labels) != k and not labelled:  # k = 1: a single model, not a clustering
        log.warning("the rankings carry %d cluster label(s) (%s) and train.k = %d: evaluate matches adapters to "
                    "labels one to one, so rankings whose label or adapter is left unmatched count as misclustered "
                    "(with more clusters than labels, clustering_accuracy_many_to_one gives each adapter its "
                    "majority label). Set train.k=%d for one adapter per label", len(labels),
                    ", ".join(labels[:12]) + (", ..." if len(labels) > 12 else ""), k, len(labels))
    if labelled:
        rows = load_table(rankings_dir, columns=["example_id", "split", "cluster"])
        train = rows.filter(pc.equal(rows.column("split"), "train"))
        check_labels_fit(train.column("cluster").to_pylist(), train.column("example_id").to_pylist(), k,
                         f"the rankings artifact at {rankings_dir}")


def check_labels_fit(labels: Sequence[str | None], example_ids: Sequence[str], k: int, holder: str) -> list[str]:
    """The sorted labels of the training rankings ``holder`` names (e.g. "the cache at X"), for EM to
    start from (`train.init = labels`: label i on cluster c<i>); raise ValueError when a ranking has
    none or there are not exactly k of them."""
    missing = [example for example, label in zip(example_ids, labels, strict=True) if label is None]
    if missing:
        raise ValueError(f"train.init = labels needs a `cluster` label on every training ranking; {len(missing)} of "
                         f"the {len(labels)} in {holder} have none (example_id {missing[0]!r}, ...). Label them, or "
                         "choose another train.init (linearized, kmeans, dirichlet)")
    names = sorted(set(labels))
    if len(names) != k:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ValueError(f"train.init = labels puts each label on its own cluster, but the training rankings in "
                         f"{holder} carry {len(names)} label(s) ({shown}) and train.k = {k}: set "
                         f"train.k = {len(names)}, give the train split rankings of every label (ingest.split), "
                         "or choose another train.init")
    return names


def check_clusters_fit(k: int, n: int, holder: str) -> None:
    """Raise ValueError when k clusters exceed the n training rankings ``holder`` names (e.g. "the
    cache at X has"): the pipeline asks right after ingest, the train stage against its cache."""
    if k > n:
        raise ValueError(f"train.k = {k} clusters, but {holder} only {n} training ranking(s): EM cannot fill more "
                         f"clusters than rankings. Set train.k to at most {n}, or ingest more rankings.")


def _warn_of_empty_splits(fractions: tuple[float, float, float], splits: list[str | None], prompts: int) -> None:
    """Warn when a split with a share of ``fractions`` got no rankings (too few prompts to deal)."""
    empty = [name for name, share in zip(SPLITS, fractions, strict=True) if share and name not in splits]
    if empty:
        log.warning("split %s got no rankings: %d prompt(s) are too few for split.fractions %s (each prompt goes "
                    "to one split); a pipeline's evaluate stage reads evaluate.splits (validation and test)",
                    " and ".join(empty), prompts, list(fractions))


def _warn_of_equal_texts_apart(table: pa.Table) -> None:
    """Warn of rankings that order two equal response texts (kept: legal data, worth knowing)."""
    columns = (table.column(name).to_pylist() for name in ("responses", "ranking", "ranked_prefix"))
    repeated = [i for i, row in enumerate(zip(*columns, strict=True)) if _equal_texts_apart(*row)]
    if repeated:
        log.warning("%d ranking(s) put one response text in two tiers (the first: example_id %r): a policy gives equal "
                    "texts equal scores, so no model can prefer one copy to the other", len(repeated),
                    table.column("example_id")[repeated[0]].as_py())


def _equal_texts_apart(texts: list[str], tiers: list[list[int]], prefix: int) -> bool:
    """Whether a ranking orders two equal response texts: puts them in different observed tiers, or
    one in the first ``prefix`` tiers and one after them (which are unordered among themselves)."""
    tier_of = {j: min(t, prefix) for t, tier in enumerate(tiers) for j in tier}
    seen: dict[str, int] = {}
    for j, text in enumerate(texts):
        if seen.setdefault(text, tier_of[j]) != tier_of[j]:
            return True
    return False


def build_rankings(config: IngestConfig, inputs: dict[str, str] | None = None) -> BuiltRankings:
    """Canonical, validated, split rankings in memory. ``inputs`` as in `plan_ingest` (computed if None).

    Raises `moplex_core.schema.SchemaError` in strict mode if any row is bad, and ``ValueError`` if
    no ranking is left after the dataset's filters.
    """
    raw = RawRejects(drop=config.validation == "drop", within=config.path, read_on=True)
    try:
        adapted = _adapt(config, _inputs(config) if inputs is None else inputs, raw)
    except RawSchemaError as err:  # a whole file, or what follows from the records set aside (PRISM's survey)
        raw.raise_if_any(then=err)
        raise
    raw.raise_if_any()  # strict: every record that could not be read, in one error
    if not adapted.rows:
        raise ValueError(
            f"the {config.dataset} source{f' at {config.path}' if config.path else ''} gave no rankings "
            f"({adapted.stats}); check the source and the dataset options"
            + (f"; {len(raw.rows)} record(s) were set aside, the first: {raw.rows[0]['reason']}" if raw.rows else "")
        )
    if adapted.stats.get("ignored_column:split"):
        log.warning("%d ranking(s) of the source name a split, which ingest does not keep: it splits by prompt "
                    "(split.fractions, seed). To keep the source's splits, set split.from_source=true (every row "
                    "then needs one of %s)", adapted.stats["ignored_column:split"], ", ".join(SPLITS))
    if adapted.stats.get("repeated_rankings"):
        log.warning("%d ranking(s) of the source repeat an earlier row's prompt_id (or, without one, its prompt), "
                    "responses, ranking and cluster (or a given example_id holds its made one) without an example_id: "
                    "each is kept as a ranking of its own (example_id <the made one>-2, -3, ...), as two raters who "
                    "agree are. Where a repeat is a mistake (a file read twice), remove it or give the rows "
                    "example_ids",
                    adapted.stats["repeated_rankings"])
    labels = config.default_labels()
    if config.validation == "strict":
        table = check_rankings(adapted.rows, labels, config.split.from_source, adapted.where, made_ids=True)
        rejected = None
    else:
        where = None if adapted.where is None else [raw.relative(w) for w in adapted.where]
        table, rejected = split_rejected(adapted.rows, labels, config.split.from_source, where, adapted.originals,
                                         made_ids=True)
        unreadable = pa.Table.from_pylist([{"row": None, "example_id": None, **r} for r in raw.rows],
                                          schema=REJECTED_SCHEMA)
        rejected = pa.concat_tables([unreadable, rejected])
    outside = 0  # rows of prompts that fit no split's remaining room (split.sizes)
    if not config.split.from_source:
        groups = split_groups(table.column("prompt_id").to_pylist(), table.column("prompt").to_pylist())
        splits = assign_splits(groups, config.split, config.seed)
        table = table.set_column(table.schema.get_field_index("split"), "split", pa.array(splits, pa.string()))
        table = table.filter(pa.array([s is not None for s in splits], pa.bool_())).cast(RANKINGS_SCHEMA)
        outside = splits.count(None)
        if config.split.sizes is None and table.num_rows:  # with sizes, the warning below says what was reached
            _warn_of_empty_splits(config.split.fractions, splits, len(set(groups)))
        if outside:
            reached = Counter(s for s in splits if s is not None)
            log.warning("split.sizes %s reached %s: %d ranking(s) left out, their prompts' rankings fitting no "
                        "split's remaining room", list(config.split.sizes),
                        ", ".join(f"{name} {reached[name]}" for name in SPLITS), outside)
    if table.num_rows == 0:
        detail = ""
        if outside:
            detail = f"; split.sizes left out all {outside}"
        elif rejected is not None and rejected.num_rows:
            reasons = rejected.select(["row", "where", "field", "reason"]).to_pylist()
            numbers = [r["row"] for r in reasons]
            rows = len({n for n in numbers if n is not None}) + numbers.count(None)  # an unreadable record: one each
            by_field = [(r["field"], r["reason"] if r["row"] is None  # an unreadable record's reason names its line
                         else f"{r['where'] or 'row ' + str(r['row'])}: {r['reason']}") for r in reasons]
            detail = (f"; every row was rejected ({rows} row(s), {rejected.num_rows} reason(s)), by field: "
                      + issues_by_field(by_field))
        raise ValueError(f"no valid rankings left for dataset {config.dataset!r} ({adapted.stats}){detail}")
    _warn_of_equal_texts_apart(table)
    clusters = table.column("cluster").to_pylist()
    summary = {
        "adapter": adapted.stats,
        "rows_per_split": dict(sorted(Counter(table.column("split").to_pylist()).items())),
        "rows_per_cluster": dict(sorted(Counter(c for c in clusters if c is not None).items())),
        "unlabelled_rows": clusters.count(None),
        "labels": None if labels is None else list(labels),
        "rejected_rows": 0 if rejected is None else len(set(rejected.column("row").drop_null().to_pylist())),
        "left_out_by_split_sizes": outside,
        "unreadable_records": len(raw.rows),
    }
    return BuiltRankings(table, rejected, summary)


def run_ingest(config: IngestConfig, store: ArtifactStore, plan: IngestPlan | None = None) -> IngestResult:
    """Write the rankings artifact of ``config`` unless that version is already complete."""
    plan = plan or plan_ingest(config, store)
    if plan.complete:  # said by the caller (moplex ingest, the ingest flow)
        return _existing(store, plan)
    built = build_rankings(config, plan.inputs)
    recorded = {**config.identity(), "path": config.path}  # what made this version, and where it was read
    with store.writer(STAGE, plan.ref.version, config=recorded, inputs=plan.inputs,
                      code_version=code_version(config.dataset)) as writer:
        if writer.complete:  # another run finished it while this one waited (the writer says so)
            return _existing(store, plan)
        table = built.table
        for shard, start in enumerate(range(0, table.num_rows, config.shard_rows)):
            if not writer.has_shard(shard):
                writer.write_shard(shard, table.slice(start, config.shard_rows))
        if built.rejected is not None:
            writer.write_table("rejected.parquet", built.rejected)
        writer.summary.update(built.summary)
    log.info("wrote %d rankings to %s (%s)", table.num_rows, plan.path, built.summary["rows_per_split"])
    return IngestResult(plan.ref, plan.path, True, table.num_rows, _left_out(built.summary))


def _existing(store: ArtifactStore, plan: IngestPlan) -> IngestResult:
    manifest = store.manifest(STAGE, plan.ref.version)
    return IngestResult(plan.ref, plan.path, False, manifest["rows"], _left_out(manifest["summary"]))


def _left_out(summary: dict[str, Any]) -> int:
    return summary.get("rejected_rows", 0) + summary.get("unreadable_records", 0)


def rejected_note(rankings_dir: str | Path) -> str | None:
    """What a drop-mode ingest left out of the complete rankings artifact ``rankings_dir``, as a line
    for a pipeline run's log and summary, or None if it left out nothing."""
    left_out = _left_out(read_manifest(rankings_dir)["summary"])
    if not left_out:
        return None
    return (f"ingest.validation=drop left out {left_out} source row(s) or record(s); each, with its reason and "
            f"the record to fix, is in {Path(rankings_dir) / 'rejected.parquet'}")


COMMIT = re.compile(r"[0-9a-f]{40}")
"""A git commit as the hub names one: a revision that pins a hub source by itself."""

LOCAL_READER = "local-2"
"""Bumped when reading a local file yields other records from the same bytes, for every dataset read
from one (an input of their versions; hub sources and the synthetic data keep theirs). local-2: a
UTF-8 byte order mark at the start of a .json or .jsonl file is read (it made the first line
unreadable)."""


def _inputs(config: IngestConfig) -> dict[str, str]:
    """A local source's content is an input of the version, and so is the way it is read
    (LOCAL_READER); a hub source is pinned by its revision where that is a commit, and otherwise (none,
    a branch, a tag) read at the commit the hub names for it now (`hub_commit`), an input of the version."""
    if config.path is not None:
        return {"source": source_fingerprint(config.path), "reader": LOCAL_READER}
    if config.dataset in HUB_SOURCES or config.hub_name is not None:
        name, revision = config.hub_source()
        if revision is None or not COMMIT.fullmatch(revision):
            return {"revision": hub_commit(name, config.dataset, revision)}
    return {}


def _adapt(config: IngestConfig, inputs: dict[str, str], raw: RawRejects) -> AdapterOutput:
    records = lambda: raw.readable(_records(config, inputs))  # noqa: E731
    return ADAPTERS[config.dataset].read(config, records, _source_label(config, inputs), raw)


def _synthetic(config: IngestConfig) -> AdapterOutput:
    """Paper appendix B.1 rankings. The rankings artifact holds originals only, so no generated
    responses are drawn here (n_generated = 0); the augment stage adds them."""
    options = config.synthetic
    data = generate_synthetic(SyntheticConfig(
        n=options.n, k=options.k, m=options.m, n_values=options.n_values, noise=options.noise,
        alpha=options.alpha, seed=config.seed,
    ))
    rows = data.to_frame().drop(columns=["generated"]).to_dict("records")
    return AdapterOutput(rows, {"rankings": len(rows)})


def _records(config: IngestConfig, inputs: dict[str, str]) -> Iterator[Record]:
    if config.path is not None:
        return iter_local_records(config.path)
    name, revision = config.hub_source()
    return iter_hub_records(name, inputs.get("revision", revision), config.dataset, config.hub_parts())


def _source_label(config: IngestConfig, inputs: dict[str, str]) -> str:
    """The `source` column: dataset name + revision (the one read), or + a short hash of the local
    files' content."""
    if config.dataset == "synthetic":
        return "synthetic"
    name = config.hub_source()[0] if config.dataset in HUB_SOURCES or config.hub_name else config.dataset
    if config.path is not None:
        return f"{name}@local-{inputs['source'].removeprefix('sha256:')[:12]}"
    return f"{name}@{inputs.get('revision', config.hub_source()[1])}"
