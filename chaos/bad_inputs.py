"""A catalogue of bad input, each fed to moplex's own entry points (issue 8, item 2).

Every case is a `moplex ingest ...` or `moplex run PRESET --set ...` command line with a fresh
artifact root, and passes (``ok``) when the input is *rejected cleanly*:

- the command exits non-zero;
- its stderr names what the user must fix (the file, line/row and field; the config key; the path);
- no artifact under its root has a complete manifest for the stage that failed (for a config error:
  for any stage).

One case is the other side of the coin: over-long responses are not an error but are truncated as
configured (``cache.max_response_tokens``) and reported; it passes when the run completes and the
cache's manifest counts exactly the responses that were cut.

How the commands run. Starting Prefect's temporary server costs 10-40 s per process, so the cases
run in one child process (``python -m chaos.bad_inputs --worker``, with a private PREFECT_HOME,
analytics off and the hubs offline) that calls ``moplex_core.cli.main(argv)`` (what the `moplex`
console script runs) for each, with its stdout/stderr captured, inside one Prefect test-harness
server; the ``moplex run`` cases that get past the config therefore run the real Prefect flow
(flows/pipeline.py). A few cases (``process=True``) run as their own `moplex` process instead, to
pin the exit status of the real command; the full catalogue adds one `moplex run` with its own
temporary server. The flow cases keep the default ``stage_retries``: a rejection of bad input is
not retried (flows.pipeline.NOT_RETRIED), so each fails on its first try. The three flow cases
that fail at the train stage share one artifact root so that their ingest, tiny model and cache
are built once; the check is then on the train stage.

    python -m chaos.bad_inputs [--short]        # prints the table; exit 1 if a case failed
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from chaos import format_table

REPO = Path(__file__).resolve().parents[1]
PRESET = "synthetic-demo"
DETAIL_CHARS = 160


@dataclass(frozen=True)
class CaseResult:
    """One case: ``ok`` when the input was handled as documented (see the module docstring)."""

    name: str
    ok: bool
    detail: str  # the first line of what the user was told (or, when not ok, what went wrong)
    entry: str = ""  # the command line, with the temporary folder written as $TMP
    seconds: float = 0.0


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # moplex arguments; {root} and {data} are filled in
    expect: tuple[str, ...]  # what stderr must contain (case-sensitive substrings)
    stage: str | None  # the stage that must not be complete; None: no stage at all
    short: bool = False  # in the short catalogue
    process: bool = False  # its own `moplex` process instead of the worker
    flow: bool = False  # reaches the Prefect flow
    root: str | None = None  # a shared root's name (default: the case's own)
    check: Callable[[Path, int, str], str | None] | None = None  # a custom verdict: None = ok, else why not


# ---------------------------------------------------------------------------------------------------
# bad files

GOOD = {"example_id": "good-0", "prompt": "What is 2 + 2?", "responses": ["4", "5", "22"], "ranking": [[0], [1], [2]]}


_DROP = object()  # a field the row leaves out


def _row(**changes: Any) -> dict[str, Any]:
    """A second row of a bad file: valid but for ``changes``."""
    row = {**GOOD, "example_id": "bad-1", "prompt": "Name a colour.", **changes}
    return {k: v for k, v in row.items() if v is not _DROP}

# name -> (the second line of a two-line JSONL file, extra `moplex ingest` arguments, the field named)
BAD_ROWS: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "empty prompt": (_row(prompt="  "), (), "prompt"),
    "prompt not text": (_row(prompt=42), (), "prompt"),
    "blank example_id": (_row(example_id=" "), (), "example_id"),
    "empty source": (_row(source=""), (), "source"),
    "duplicate example_id": (_row(example_id="good-0"), (), "example_id"),
    "prompt_messages not JSON": (_row(prompt_messages="[{oops"), (), "prompt_messages"),
    "prompt_messages not chat messages": (_row(prompt_messages='[{"role": "user"}]'), (), "prompt_messages"),
    "prompt_messages empty": (_row(prompt_messages="[]"), (), "prompt_messages"),
    "one response": (_row(responses=["only"], ranking=[[0]]), (), "responses"),
    "empty response": (_row(responses=["red", " ", "blue"]), (), "responses"),
    "responses not a list": (_row(responses="red, blue"), (), "responses"),
    "ranking missing": (_row(ranking=_DROP), (), "ranking"),
    "ranking without tiers": (_row(ranking=[]), (), "ranking"),
    "ranking with an empty tier": (_row(ranking=[[0], [], [1, 2]]), (), "ranking"),
    "ranking index out of range": (_row(ranking=[[0], [1], [7]]), (), "ranking"),
    "ranking index twice": (_row(ranking=[[0], [0, 1], [2]]), (), "ranking"),
    "ranking leaves a response out": (_row(ranking=[[0], [1]]), (), "ranking"),
    "ranking not integers": (_row(ranking=[["first"], [1], [2]]), (), "ranking"),
    "ranking index not a whole number": (_row(ranking=[[0], [1.5], [2]]), (), "ranking"),
    "ranked_prefix out of range": (_row(ranked_prefix=9), (), "ranked_prefix"),
    "ranked_prefix not a whole number": (_row(ranked_prefix=2.5), (), "ranked_prefix"),
    "cluster outside the labels": (_row(cluster="purple"), ("--set", 'labels=["red","blue"]'), "cluster"),
    "split not a split name": (_row(split="dev"), ("--set", "split.from_source=true"), "split"),
    "split missing": (_row(), ("--set", "split.from_source=true"), "split"),
    "prompt in two splits": (_row(prompt=GOOD["prompt"], split="test"), ("--set", "split.from_source=true"), "split"),
    "prompt text in two splits under two ids": (_row(prompt=GOOD["prompt"], prompt_id="its-own-id", split="test"),
                                                ("--set", "split.from_source=true"), "split"),
}
SHORT_BAD_ROWS = {"duplicate example_id", "responses not a list", "ranking index out of range",
                  "ranking leaves a response out", "cluster outside the labels", "prompt in two splits"}


def _first_line(name: str) -> dict[str, Any]:
    """A valid first row (with a split when the case keeps the source's splits)."""
    return {**GOOD, "split": "train"} if "split" in name else GOOD


def write_bad_files(data: Path) -> dict[str, Path]:
    """Every bad source of the catalogue under ``data``; returns name -> file."""
    data.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}

    def jsonl(name: str, lines: Sequence[dict[str, Any]]) -> None:
        files[name] = data / f"{_slug(name)}.jsonl"
        files[name].write_text("".join(json.dumps(line) + "\n" for line in lines))

    for name, (bad, _, _) in BAD_ROWS.items():
        jsonl(name, [_first_line(name), bad])
    def parquet(name: str, file: str, rows: Sequence[dict[str, Any]]) -> None:
        files[name] = data / file
        pq.write_table(pa.Table.from_pylist(rows), files[name])

    parquet("parquet: ranking index out of range", "index-out-of-range.parquet",
            [GOOD, _row(ranking=[[0], [1], [3]])])
    parquet("parquet: ranked_prefix of the wrong type", "prefix-as-text.parquet",
            [{**GOOD, "ranked_prefix": "3"}, _row(ranked_prefix="all")])

    files["malformed JSONL"] = data / "malformed.jsonl"
    files["malformed JSONL"].write_text(json.dumps(GOOD) + "\n" + json.dumps(_row())[:-12] + "\n")
    files["JSONL line not an object"] = data / "array-line.jsonl"
    files["JSONL line not an object"].write_text(json.dumps(GOOD) + "\n" + json.dumps(["a", "b"]) + "\n")
    files["non-UTF-8 JSONL"] = data / "latin1.jsonl"
    latin1 = json.dumps(_row(prompt="Un café ?"), ensure_ascii=False).encode("latin-1")
    files["non-UTF-8 JSONL"].write_bytes((json.dumps(GOOD) + "\n").encode() + latin1 + b"\n")
    files["non-UTF-8 JSON"] = data / "latin1.json"
    files["non-UTF-8 JSON"].write_bytes(("[" + json.dumps(GOOD) + ",\n").encode() + latin1 + b"]\n")
    files["malformed JSON"] = data / "malformed.json"
    files["malformed JSON"].write_text("[" + json.dumps(GOOD) + ',\n {"prompt" "no colon"}]\n')
    files["JSON not an array"] = data / "object.json"
    files["JSON not an array"].write_text(json.dumps(GOOD))
    files["not Parquet"] = data / "text.parquet"
    files["not Parquet"].write_text("example_id,prompt\n1,hi\n")
    whole = data / "whole.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 50), whole, row_group_size=10)
    files["truncated Parquet"] = data / "truncated.parquet"
    files["truncated Parquet"].write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    whole.unlink()
    files["corrupt gzip"] = data / "cut.jsonl.gz"
    import gzip

    files["corrupt gzip"].write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 20)[:40])
    files["no records"] = data / "blank.jsonl"
    files["no records"].write_text("\n\n")
    files["not a data file"] = data / "rankings.csv"
    files["not a data file"].write_text("example_id,prompt\n")
    survey, conversation = prism_records()
    (data / "prism-bad-score").mkdir(exist_ok=True)
    files["PRISM score out of range"] = data / "prism-bad-score"
    (data / "prism-bad-score" / "survey.jsonl").write_text(json.dumps(survey) + "\n")
    conversation["conversation_history"][2]["score"] = 101
    (data / "prism-bad-score" / "conversations.jsonl").write_text(json.dumps(conversation) + "\n")
    files["PRISM conversations without the survey"] = data / "prism-conversations.jsonl"
    files["PRISM conversations without the survey"].write_text(json.dumps(prism_records()[1]) + "\n")
    files["LM data"] = data / "lm.jsonl"
    files["LM data"].write_text("".join(json.dumps(row) + "\n" for row in lm_rows()))
    return files


def prism_records() -> tuple[dict[str, Any], dict[str, Any]]:
    """A PRISM survey record and one conversation of that participant (the fields the adapter reads)."""
    survey = {"user_id": "user0", "survey_only": False, "age": "25-34 years old", "gender": "Female",
              "location": {"reside_country": "United Kingdom", "special_region": "UK"}}
    history = [{"turn": 0, "role": "user", "content": "Name a colour.", "within_turn_id": None, "score": None}]
    history += [{"turn": 0, "role": "model", "content": colour, "within_turn_id": w, "model_name": "gpt-4",
                 "score": 90 - 20 * w, "if_chosen": w == 0}
                for w, colour in enumerate(["red", "blue", "green", "grey"])]
    conversation = {"conversation_id": "c0", "user_id": "user0", "conversation_type": "unguided",
                    "opening_prompt": "Name a colour.", "conversation_history": history}
    return survey, conversation


LONG_RESPONSE_TOKENS = 16  # cache.max_response_tokens of the flow cases
N_LONG = 3  # responses of lm_rows() far longer than that


def lm_rows() -> list[dict[str, Any]]:
    """24 small generic rankings (m = 3) for the flow cases that reach the model; N_LONG responses
    are hundreds of characters, far beyond LONG_RESPONSE_TOKENS tokens, the rest a word or two."""
    words = ["yes", "no", "maybe", "sure", "never", "often", "red", "blue"]
    rows = []
    for i in range(24):
        responses = [words[i % 8], words[(i + 3) % 8], words[(i + 5) % 8] + "!"]
        if i < N_LONG:
            responses[2] = " ".join(f"a long answer that goes on, part {j}" for j in range(12))
        rows.append({"example_id": f"lm-{i}", "prompt": f"Question {i}?", "responses": responses,
                     "ranking": [[0], [1], [2]] if i % 2 else [[2], [0], [1]], "cluster": f"c{i % 2}"})
    return rows


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


# ---------------------------------------------------------------------------------------------------
# the catalogue


def catalogue() -> list[Case]:
    cases = []
    for name, (_, extra, fld) in BAD_ROWS.items():
        cases.append(Case(
            f"row: {name}", ("ingest", "--dataset", "generic", "--path", f"{{data}}/{_slug(name)}.jsonl", *extra),
            (f"{_slug(name)}.jsonl line 2", f"field {fld!r}"), "ingest", short=name in SHORT_BAD_ROWS,
            process=name == "ranking index out of range",
        ))
    cases += [
        Case("row: parquet ranking index out of range",
             ("ingest", "--dataset", "generic", "--path", "{data}/index-out-of-range.parquet"),
             ("index-out-of-range.parquet row 1", "field 'ranking'", "index 3"), "ingest", short=True),
        Case("row: parquet ranked_prefix of the wrong type",
             ("ingest", "--dataset", "generic", "--path", "{data}/prefix-as-text.parquet"),
             ("prefix-as-text.parquet row 0", "field 'ranked_prefix'", "expected int32"), "ingest"),
    ]
    files = [
        ("malformed JSONL", "malformed.jsonl", ("malformed.jsonl line 2", "not valid JSON"), True),
        ("JSONL line not an object", "array-line.jsonl", ("array-line.jsonl line 2", "records are JSON objects"),
         False),
        ("non-UTF-8 JSONL", "latin1.jsonl", ("latin1.jsonl line 2", "not UTF-8", "byte"), True),
        ("non-UTF-8 JSON", "latin1.json", ("latin1.json", "not UTF-8", "line 2"), False),
        ("malformed JSON", "malformed.json", ("malformed.json", "not valid JSON", "line 2"), False),
        ("JSON not an array", "object.json", ("object.json", "JSON array"), False),
        ("not Parquet", "text.parquet", ("text.parquet", "not a readable Parquet file"), True),
        ("truncated Parquet", "truncated.parquet", ("truncated.parquet", "Parquet"), False),
        ("corrupt gzip", "cut.jsonl.gz", ("cut.jsonl.gz", "gzip"), False),
        ("no records", "blank.jsonl", ("blank.jsonl", "no rankings"), False),
        ("not a data file", "rankings.csv", ("rankings.csv", "not a data file", ".jsonl"), False),
        ("path does not exist", "nowhere/rankings.jsonl", ("nowhere/rankings.jsonl", "does not exist"), False),
    ]
    cases += [Case(f"file: {name}", ("ingest", "--dataset", "generic", "--path", f"{{data}}/{file}"), expect,
                   "ingest", short=short, process=name == "non-UTF-8 JSONL") for name, file, expect, short in files]
    cases += [
        Case("file: PRISM score out of range", ("ingest", "--dataset", "prism", "--path", "{data}/prism-bad-score"),
             ("conversations.jsonl line 1", "field 'conversation_history[2]'", "key 'score'", "1..100"), "ingest"),
        Case("file: PRISM conversations without the survey",
             ("ingest", "--dataset", "prism", "--path", "{data}/prism-conversations.jsonl"),
             ("prism-conversations.jsonl line 1", "no survey records", "survey.jsonl"), "ingest"),
    ]
    cases.append(Case("config: ingest split fractions do not sum to 1",
                      ("ingest", "--dataset", "generic", "--path", "{data}/lm.jsonl",
                       "--set", "split.fractions=[0.5,0.5,0.5]"),
                      ("fractions", "sum to 1"), None))

    def run(*sets: str) -> tuple[str, ...]:
        return ("run", PRESET, "--root", "{root}", "--threads", "1", *(a for s in sets for a in ("--set", s)))

    configs = [
        ("unknown key", ("train.clusters=3",), ("train.clusters", "unknown key"), True),
        ("unknown block", ("trainer.k=3",), ("'trainer' is not a block",), False),
        ("assignment without =", ("train.k",), ("expected key=value",), False),
        ("k < 1", ("train.k=0",), ("train.k", "greater than or equal to 1"), True),
        ("k not an integer", ("train.k=three",), ("train.k", "valid integer"), False),
        ("beta = 0", ("train.beta=0",), ("train.beta", "greater than 0"), False),
        ("beta < 0", ("train.beta=-0.5",), ("train.beta", "greater than 0"), True),
        ("temperature = 0", ("augment.temperature=0",), ("augment.temperature", "greater than 0"), True),
        ("temperature < 0", ("augment.temperature=-1",), ("augment.temperature", "greater than 0"), False),
        ("a > m' (known from the preset)", ("train.anchors=7",), ("train.anchors a = 7 > m' = 6",), True),
        ("m' < m (n_generated < 0)", ("augment.n_generated=-1",),
         ("augment.n_generated", "greater than or equal to 1"), True),
        ("unknown preset", (), ("unknown pipeline preset 'no-such-preset'",), False),
        ("synthetic with a path", ("ingest.path=/tmp/x.jsonl",), ("synthetic", "takes no path"), False),
        ("a start from the labels, restarted", ("train.init=labels", "train.restarts=2"),
         ("train.init = labels", "set train.restarts = 1"), False),
        ("backtracks < 0", ("train.backtracks=-1",), ("train.backtracks", "greater than or equal to 0"), False),
        ("estimation check < 0", ("train.estimation_check=-5",),
         ("train.estimation_check", "greater than or equal to 0"), False),
        ("anchors on a cache without contractions", ("cache.contractions=false", "train.anchors=2"),
         ("the cache of this pipeline has none (cache.contractions = false", "Set train.anchors to null"), False),
    ]
    for name, sets, expect, short in configs:
        argv = run(*sets) if name != "unknown preset" else ("run", "no-such-preset", "--root", "{root}")
        cases.append(Case(f"config: {name}", argv, expect, None, short=short, process=name == "k < 1"))

    lm = ("ingest.dataset=generic", "ingest.path={data}/lm.jsonl", "augment=null", "tiny_model.pretrain_steps=0",
          f"cache.max_response_tokens={LONG_RESPONSE_TOKENS}", "cache.score_batch_size=96", "train.em_iterations=1",
          "train.batch_size=64")
    bad_rows = f"{_slug('ranking index out of range')}.jsonl"
    cases += [
        Case("flow: bad rows", run("ingest.dataset=generic", f"ingest.path={{data}}/{bad_rows}"),
             (f"{bad_rows} line 2", "field 'ranking'", "index 7"), "ingest", short=True, flow=True),
        Case("flow: non-UTF-8 JSONL",
             run("ingest.dataset=generic", "ingest.path={data}/latin1.jsonl"),
             ("latin1.jsonl line 2", "not UTF-8"), "ingest", flow=True),
        Case("flow: hub dataset while offline", run("ingest.dataset=ultrafeedback"),
             ("openbmb/UltraFeedback", "--set ingest.path=DIR"), "ingest", short=True, flow=True),
        Case("flow: model path does not exist", run(*lm, "cache.model={root}/no-such-model"),
             ("no-such-model", "does not exist"), "cache", short=True, flow=True),
        Case("flow: model name not here, offline", run(*lm, "cache.model=acme/no-such-model"),
             ("acme/no-such-model", "Pass a local path"), "cache", flow=True),
        Case("flow: a > m' (known from the data)", run(*lm, "train.anchors=5"),
             ("train.anchors a = 5 > m' = 3",), "train", short=True, flow=True, root="lm"),
        Case("flow: a start from the labels, k unlike their number", run("train.init=labels", "train.k=2"),
             ("carry 3 label(s) (c0, c1, c2) and train.k = 2",), "train", flow=True),
        Case("flow: k > training rankings", run(*lm, "train.k=40"),
             ("train.k = 40 clusters", "training ranking(s)"), "train", flow=True, root="lm"),
        Case("flow: over-long responses truncated and reported", run(*lm, "train.k=2"), (), None,
             short=True, flow=True, root="lm", check=_truncated_and_reported),
    ]
    return cases


def _truncated_and_reported(root: Path, rc: int, stderr: str) -> str | None:
    """ok when the run completed and the cache manifest counts the N_LONG cut responses."""
    if rc != 0:
        return f"exit {rc}: {_head(stderr)}"
    manifests = sorted((root / "cache").glob("*/manifest.json"))
    if len(manifests) != 1:
        return f"expected one complete cache under {root}, found {len(manifests)}"
    summary = json.loads(manifests[0].read_text())["summary"]
    if summary.get("truncated_responses") != N_LONG:
        return f"cache summary says truncated_responses = {summary.get('truncated_responses')}, expected {N_LONG}"
    return None


# ---------------------------------------------------------------------------------------------------
# running it


def run_catalogue(short: bool = False, workdir: str | Path | None = None,
                  progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Run every case (``short``: the representative subset, ~1-2 minutes) and judge each.

    ``workdir`` keeps the roots, files and logs (default: a temporary folder, removed after).
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="moplex-bad-inputs-") as tmp:
            return run_catalogue(short, tmp, progress)
    workdir = Path(workdir)
    write_bad_files(workdir / "data")
    cases = [c for c in catalogue() if c.short or not short]
    env = _environment(workdir)
    outcomes: dict[str, dict[str, Any]] = {}
    for case in (c for c in cases if c.process):
        outcomes[case.name] = _run_process(case, workdir, env)
    in_worker = [c for c in cases if not c.process]
    if in_worker:
        outcomes.update(_run_worker(in_worker, workdir, env))
    if not short:
        real = next(c for c in cases if c.name == "flow: bad rows")
        name = "flow: bad rows, its own moplex run process"
        outcomes[name] = _run_process(real, workdir, env, root_name=_slug(name))
        cases.append(Case(name, real.argv, real.expect, real.stage, process=True, flow=True, root=_slug(name)))
    results = []
    for case in cases:
        result = judge(case, outcomes.get(case.name), workdir)
        if progress is not None:
            progress(result)
        results.append(result)
    return results


def judge(case: Case, outcome: dict[str, Any] | None, workdir: Path) -> CaseResult:
    entry = "moplex " + " ".join(_fill(case.argv, case, workdir)).replace(str(workdir), "$TMP")
    if outcome is None:
        return CaseResult(case.name, False, "did not run (the worker died; see worker.log)", entry)
    rc, stderr, seconds = outcome["rc"], _message(outcome["stderr"], case), outcome["seconds"]
    root = _root(case, workdir)
    if case.check is not None:
        problem = case.check(root, rc, stderr)
        detail = problem or _truncation_detail(root)
        return CaseResult(case.name, problem is None, detail, entry, seconds)
    problems = []
    if rc == 0:
        problems.append("exited 0")
    missing = [text for text in _filled(case.expect, case, workdir) if text not in stderr]
    if missing:
        problems.append(f"the message does not name {missing}")
    # Judged on the root as the case left it (the roots shared by several cases change after).
    complete = [ref for ref in outcome["complete"] if case.stage is None or ref.startswith(f"{case.stage}/")]
    if complete:
        problems.append(f"complete despite the error: {complete}")
    if "Traceback" in stderr:
        problems.append("a traceback reached the user")
    detail = "; ".join(problems) + (f" -- {_head(stderr)}" if problems else "") if problems else _head(stderr)
    return CaseResult(case.name, not problems, detail.replace(str(workdir), "$TMP"), entry, seconds)


def _truncation_detail(root: Path) -> str:
    manifests = sorted((root / "cache").glob("*/manifest.json"))
    if not manifests:
        return "no cache"
    summary = json.loads(manifests[0].read_text())["summary"]
    return (f"run completed; cache manifest: truncated_responses = {summary.get('truncated_responses')} at "
            f"max_response_tokens = {summary.get('max_response_tokens')} (and a warning in the log)")


def _message(stderr: str, case: Case) -> str:
    """What moplex said: from its last ``moplex <command>:`` line on (stderr also holds progress bars,
    and a process's stderr Prefect's log)."""
    start = stderr.rfind(f"moplex {case.argv[0]}: ")
    return stderr[start:] if start >= 0 else stderr


def complete_artifacts(root: Path) -> list[str]:
    """``stage/version`` of every artifact under ``root`` whose manifest is written."""
    return sorted(str(m.parent.relative_to(root)) for m in root.glob("*/*/manifest.json")) if root.is_dir() else []


def _head(stderr: str) -> str:
    """The message without the command's prefix, on one line, cut to DETAIL_CHARS."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    text = " / ".join(lines[:3]).removeprefix("moplex ingest: ").removeprefix("moplex run: ")
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _root(case: Case, workdir: Path) -> Path:
    return workdir / "roots" / (case.root or _slug(case.name))


def _filled(parts: Sequence[str], case: Case, workdir: Path) -> list[str]:
    return [p.replace("{root}", str(_root(case, workdir))).replace("{data}", str(workdir / "data")) for p in parts]


def _fill(argv: Sequence[str], case: Case, workdir: Path) -> list[str]:
    argv = _filled(argv, case, workdir)
    if argv[0] == "ingest":
        argv += ["--root", str(_root(case, workdir))]
    return argv


def _environment(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(workdir / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    return env


def _run_process(case: Case, workdir: Path, env: dict[str, str], root_name: str | None = None) -> dict[str, Any]:
    """The case as its own `moplex` process (the console script's module), exit status and stderr."""
    if root_name is not None:
        case = Case(case.name, case.argv, case.expect, case.stage, root=root_name)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moplex_core.cli", *_fill(case.argv, case, workdir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    (workdir / "logs").mkdir(exist_ok=True)
    (workdir / "logs" / f"{_slug(case.name)}.log").write_text(done.stdout + done.stderr)
    return {"rc": done.returncode, "stderr": done.stderr, "seconds": time.perf_counter() - started,
            "complete": complete_artifacts(_root(case, workdir))}


def _run_worker(cases: list[Case], workdir: Path, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    spec = workdir / "worker-spec.json"
    out = workdir / "worker-results.json"
    spec.write_text(json.dumps([{"name": c.name, "argv": _fill(c.argv, c, workdir), "flow": c.flow,
                                 "root": str(_root(c, workdir))} for c in cases]))
    with open(workdir / "worker.log", "w") as log:
        subprocess.run([sys.executable, "-m", "chaos.bad_inputs", "--worker", str(spec), str(out)], cwd=REPO, env=env,
                       stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    return json.loads(out.read_text()) if out.is_file() else {}


def worker(spec: Path, out: Path) -> None:
    """Run the cases of ``spec`` with ``moplex_core.cli.main`` in this process; the flow cases inside
    one Prefect test-harness server. Results are written to ``out`` after every case."""
    import torch

    torch.set_num_threads(1)
    from moplex_core.cli import main

    jobs = json.loads(spec.read_text())
    results: dict[str, dict[str, Any]] = {}
    if any(job["flow"] for job in jobs):
        import flows.pipeline  # noqa: F401 -- Prefect sets up its log handlers on the real stderr, not a capture

    def run(job: dict[str, Any]) -> None:
        stdout, stderr = io.StringIO(), io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = main(job["argv"])
            except SystemExit as exit_:  # argparse
                rc = exit_.code if isinstance(exit_.code, int) else 1
            except Exception as err:  # noqa: BLE001 -- an escaped exception is a finding, not a crash
                import traceback

                rc = 99
                print(f"Traceback (uncaught by moplex):\n{traceback.format_exc()}", file=sys.stderr)
                del err
        results[job["name"]] = {"rc": rc, "stderr": stderr.getvalue(), "seconds": time.perf_counter() - started,
                                "complete": complete_artifacts(Path(job["root"]))}
        print(f"[worker] {job['name']}: exit {rc} in {results[job['name']]['seconds']:.1f} s", file=sys.__stderr__,
              flush=True)
        out.write_text(json.dumps(results))

    for job in (j for j in jobs if not j["flow"]):
        run(job)
    flow_jobs = [j for j in jobs if j["flow"]]
    if flow_jobs:
        from prefect.testing.utilities import prefect_test_harness

        from flows.pipeline import without_heartbeats

        with without_heartbeats(), prefect_test_harness(server_startup_timeout=None):
            for job in flow_jobs:
                run(job)
    out.write_text(json.dumps(results))


def format_results(results: Sequence[CaseResult]) -> str:
    rows = [[r.name, "yes" if r.ok else "NO", f"{r.seconds:.1f}", r.detail] for r in results]
    ok = sum(r.ok for r in results)
    table = format_table(["case", "ok", "seconds", "what the user was told"], rows)
    return f"{table}\n\n{ok}/{len(results)} bad inputs handled cleanly"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.bad_inputs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the representative subset (~1-2 minutes)")
    parser.add_argument("--workdir", help="keep roots, bad files and logs here")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]))
        return 0
    results = run_catalogue(short=args.short, workdir=args.workdir,
                            progress=lambda r: print(f"  {'ok  ' if r.ok else 'FAIL'} {r.name}", flush=True))
    print(format_results(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
