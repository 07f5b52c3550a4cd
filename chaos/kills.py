"""The kill schedule: SIGKILL every stage at seeded points, rerun it, compare with an uninterrupted run.

`build_bench` makes the uninterrupted reference runs, in this process, under ``<workdir>/reference``:
a synthetic ingest with many small shards, and a smaller synthetic ingest with a tiny offline model,
augment, cache and train (anchored, a = 2, and exact, a = m') built on it. Every `KillPoint` then
gets a fresh artifact root and

1. runs its stage in a child process (``python -m chaos.stage``) with the reference's config and inputs;
2. waits for its progress point: shard j of the version folder appearing (ingest, augment, cache),
   the train stage's progress bar of EM iteration t's M-step or E-step appearing on stderr, or
   iteration t's checkpoint being saved;
3. waits a seeded delay and SIGKILLs the child: no handler and no clean-up run;
4. checks that the version is not marked complete and notes the work already finished (shards,
   EM iterations whose state.json exists);
5. reruns the stage in a new child, which must complete;
6. checks that the finished work was kept, not redone (same inode and mtime; the train rerun starts
   EM at the first unfinished iteration) and that the manifest says ``resumed``;
7. compares the artifact with the reference's: same version, rows, shards and file names, every file
   byte-identical or else equal in value (Parquet tables, JSON); the manifest's checksums verify and
   no hidden temporary is left behind.

`kill_schedule` draws the points (which shard or EM iteration, and the delay) from one seed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq

from chaos.stage import StageJob, run_stage
from moplex_core.artifacts import (
    ArtifactError,
    ArtifactStore,
    has_manifest,
    read_manifest,
    shard_name,
    shard_paths,
    verify,
)
from moplex_core.config import IngestConfig, SyntheticOptions, TinyModelConfig, TrainConfig
from moplex_core.tiny_model import run_tiny_model

REPO = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 600.0
POLL_S = 0.002

# Sizes: every stage runs for seconds, with enough shards or EM work between its progress points
# that a seeded delay after one lands before the stage ends.
INGEST = IngestConfig(dataset="synthetic", synthetic=SyntheticOptions(n=2000, k=2, m=3), shard_rows=5)  # 400 shards
SMALL_INGEST = IngestConfig(dataset="synthetic", synthetic=SyntheticOptions(n=48, k=2, m=3))
TINY_MODEL = TinyModelConfig(pretrain_steps=30)
AUGMENT = {"n_generated": 2, "max_new_tokens": 24, "shard_prompts": 2, "batch_size": 8}  # 24 shards; + model
CACHE = {"shard_rows": 2}  # 24 shards; + model
TRAIN_ANCHORED = TrainConfig(k=2, anchors=2, lora_r=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj"), lr=1e-2,
                             batch_size=4, em_iterations=3, tol=0.0, init="dirichlet", dtype="float32", device="cpu")
TRAIN_EXACT = TRAIN_ANCHORED.model_copy(update={"anchors": None})

Phase = Literal["shard", "M-step", "E-step", "saved"]
"""What a kill point waits for: shard j's file, EM iteration t's M-step or E-step progress bar on
stderr, or iteration t's checkpoint (its state.json, written last)."""


@dataclass(frozen=True)
class Target:
    """Where the schedule may kill one case: shard indices or EM iterations, and the longest delay."""

    case: str
    phase: Phase
    indices: range
    max_delay_s: float
    full: int  # points in the full schedule
    short: int  # of which the short schedule keeps the first


TARGETS = (
    Target("ingest", "shard", range(10, 200), 0.2, full=2, short=1),
    Target("augment", "shard", range(1, 8), 0.1, full=2, short=1),
    Target("cache", "shard", range(1, 8), 0.05, full=2, short=1),
    # An anchored M-step is a anchors per pair: about 0.3 s here, so a delay up to 0.5 s could land after it.
    Target("train-anchored", "M-step", range(TRAIN_ANCHORED.em_iterations), 0.25, full=2, short=1),
    Target("train-anchored", "E-step", range(TRAIN_ANCHORED.em_iterations), 0.1, full=2, short=1),
    Target("train-exact", "M-step", range(TRAIN_EXACT.em_iterations), 0.5, full=1, short=0),
    Target("train-exact", "E-step", range(TRAIN_EXACT.em_iterations), 0.05, full=1, short=0),
    # After the last iteration is saved: the final adapters, posteriors and manifest are being written.
    Target("train-anchored", "saved", range(TRAIN_ANCHORED.em_iterations - 1, TRAIN_ANCHORED.em_iterations), 0.02,
           full=1, short=0),
)


@dataclass(frozen=True)
class KillPoint:
    """Kill ``case`` ``delay_s`` seconds after shard ``index`` is finished, after EM iteration
    ``index``'s M-step or E-step starts, or after that iteration is saved."""

    case: str
    phase: Phase
    index: int
    delay_s: float

    def describe(self) -> str:
        aim = {"shard": f"shard {self.index} written", "saved": f"iteration {self.index} saved"}.get(
            self.phase, f"{self.phase} {self.index} started")
        return f"{aim} + {self.delay_s:.3f} s"

    def reached(self, version_dir: Path, child: Child) -> bool:
        if self.phase == "shard":
            return (version_dir / shard_name(self.index)).is_file()
        if self.phase == "saved":
            return (version_dir / f"em/restart-00/iter-{self.index:04d}/state.json").is_file()
        return f"{self.phase} {self.index}:" in child.stderr()


def kill_schedule(seed: int, short: bool = False) -> list[KillPoint]:
    """The kill points of ``seed``: per target, ``full`` points drawn from a generator seeded with
    ``seed``; the short schedule keeps the first ``short`` of each, so it is part of the full one."""
    rng = random.Random(seed)
    points = []
    for target in TARGETS:
        drawn = [KillPoint(target.case, target.phase, rng.choice(target.indices),
                           round(rng.uniform(0.0, target.max_delay_s), 3)) for _ in range(target.full)]
        points += drawn[: target.short] if short else drawn
    return points


@dataclass(frozen=True)
class Bench:
    """The uninterrupted reference runs: every case's job and its finished version folder."""

    root: Path
    jobs: dict[str, StageJob]
    references: dict[str, Path]


def build_bench(workdir: str | Path, cases: Iterable[str]) -> Bench:
    """Reference runs of ``cases`` (and the artifacts they read) under ``workdir/reference``."""
    root = Path(workdir) / "reference"
    small = run_stage(StageJob("ingest", SMALL_INGEST.model_dump(mode="json")), root, progress=False)
    model = str(run_tiny_model(TINY_MODEL, small, ArtifactStore(root)))
    jobs = {
        "ingest": StageJob("ingest", INGEST.model_dump(mode="json")),
        "augment": StageJob("augment", {**AUGMENT, "model": model}, str(small)),
    }
    augmented = run_stage(jobs["augment"], root, progress=False)
    jobs["cache"] = StageJob("cache", {**CACHE, "model": model}, str(augmented))
    cache = run_stage(jobs["cache"], root, progress=False)
    for name, config in (("train-anchored", TRAIN_ANCHORED), ("train-exact", TRAIN_EXACT)):
        jobs[name] = StageJob("train", config.model_dump(mode="json"), str(cache))
    references = {name: run_stage(jobs[name], root, progress=False) for name in sorted(set(cases))}
    return Bench(root, jobs, references)


@dataclass
class KillResult:
    """One kill point's outcome; ``name``, ``ok`` and ``detail`` as the bad-input catalogue's cases."""

    point: KillPoint
    landed: str = ""
    completed: bool = False
    reused: str = ""
    equal: str = ""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.point.case}: {self.point.describe()}"

    @property
    def ok(self) -> bool:
        return self.completed and not self.problems

    @property
    def detail(self) -> str:
        return "; ".join(self.problems) or "survived"


class Child:
    """A stage run in a child process; a thread collects its stderr (progress bars and errors)."""

    def __init__(self, job: StageJob, root: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "chaos.stage", str(root), job.to_json()], cwd=REPO,
                                        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for chunk in iter(lambda: self.process.stderr.read1(65536), b""):
            self._chunks.append(chunk)

    def stderr(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def tail(self, chars: int = 1500) -> str:
        return self.stderr().replace("\r", "\n")[-chars:]

    def wait(self) -> int:
        try:
            code = self.process.wait(CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._reader.join()
        self.process.stderr.close()  # drained to its end by the reader
        return code


def run_schedule(points: list[KillPoint], workdir: str | Path,
                 on_result: Callable[[KillResult], None] | None = None) -> list[KillResult]:
    """Build the bench, then kill, rerun and compare every point, each in its own artifact root."""
    workdir = Path(workdir)
    bench = build_bench(workdir, {p.case for p in points})
    results = []
    for number, point in enumerate(points):
        results.append(run_kill_point(point, bench, workdir / f"kill-{number:02d}-{point.case}"))
        if on_result is not None:
            on_result(results[-1])
    return results


def run_kill_point(point: KillPoint, bench: Bench, root: Path) -> KillResult:
    """Kill the point's stage, rerun it and compare, in the artifact root ``root`` (module docstring)."""
    started = time.perf_counter()
    job = bench.jobs[point.case]
    reference = bench.references[point.case]
    version_dir = root / reference.relative_to(bench.root)
    result = KillResult(point)
    try:
        _kill_rerun_compare(point, job, root, reference, version_dir, result)
    finally:
        result.seconds = time.perf_counter() - started
    return result


def _kill_rerun_compare(point: KillPoint, job: StageJob, root: Path, reference: Path, version_dir: Path,
                        result: KillResult) -> None:
    child = Child(job, root)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not point.reached(version_dir, child) and child.process.poll() is None:
        if time.monotonic() > deadline:
            child.process.kill()
            child.wait()
            result.problems.append(f"the run did not reach the kill point in {CHILD_TIMEOUT_S:.0f} s")
            return
        time.sleep(POLL_S)
    time.sleep(point.delay_s)
    child.process.send_signal(signal.SIGKILL)
    code = child.wait()
    if code != -signal.SIGKILL:
        result.problems.append(f"the kill missed: the first run exited with status {code} before it; its stderr "
                               f"ends:\n{child.tail()}")
        return
    result.landed = _landed(point, version_dir, child.stderr())
    if point.phase in ("M-step", "E-step") and not result.landed.startswith(f"{point.phase} {point.index},"):
        result.problems.append(f"aimed at {point.phase} {point.index} but landed in {result.landed}")
    if has_manifest(version_dir):
        result.problems.append("the version was complete when the kill landed: the stage finished first, or "
                               "marked itself complete before it had finished")
    finished = finished_work(version_dir, job.stage)
    iterations_done = _finished_iterations(version_dir)

    rerun = Child(job, root)
    code = rerun.wait()
    result.completed = code == 0 and has_manifest(version_dir)
    if not result.completed:
        result.problems.append(f"the rerun did not complete (exit status {code}); its stderr ends:\n{rerun.tail()}")
        return
    try:
        verify(version_dir)
    except ArtifactError as err:
        result.problems.append(str(err))
    leftovers = sorted(p.relative_to(version_dir).as_posix() for p in version_dir.rglob(".*"))
    if leftovers:
        result.problems.append(f"hidden files left in the finished version: {leftovers}")
    result.reused = _check_reuse(job, finished, iterations_done, version_dir, rerun.stderr(), result.problems)
    result.equal = compare_artifacts(reference, version_dir, result.problems)


def finished_work(version_dir: Path, stage: str) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every finished unit's files, by relative name: the visible shards, or for
    train every file of an EM iteration whose state.json (written last) exists, but its state.pt
    (deleted by design once a later iteration is whole: em.save_checkpoint)."""
    if stage != "train":
        files = shard_paths(version_dir)
    else:
        done = [p.parent for p in version_dir.glob("em/restart-*/iter-*/state.json")]
        files = [f for it_dir in done for f in it_dir.rglob("*") if f.is_file() and f.name != "state.pt"]
    return {f.relative_to(version_dir).as_posix(): _stamp(f) for f in files}


def compare_artifacts(reference: Path, candidate: Path, problems: list[str]) -> str:
    """How ``candidate`` matches the finished ``reference`` version: "bytes" when every file is
    byte-identical, "values" when some differ in bytes but their Parquet tables or JSON are equal.
    Differences are appended to ``problems`` (the answer is then "DIFFERS")."""
    expected, got = read_manifest(reference), read_manifest(candidate)
    before = len(problems)
    problems += [f"manifest {key} {got[key]!r} differs from the reference's {expected[key]!r}"
                 for key in ("stage", "version", "rows", "shards") if got[key] != expected[key]]
    names = set(expected["files"]) | set(got["files"])
    problems += [f"{name} is only in the {'rerun' if name in got['files'] else 'reference'}"
                 for name in sorted(set(expected["files"]) ^ set(got["files"]))]
    by_value = []
    for name in sorted(set(expected["files"]) & set(got["files"])):
        if expected["files"][name]["sha256"] == got["files"][name]["sha256"]:
            continue
        if _same_values(reference / name, candidate / name):
            by_value.append(name)
        else:
            problems.append(f"{name} differs from the reference's")
    if len(problems) > before:
        return "DIFFERS"
    if by_value:
        return f"values ({len(by_value)} of {len(names)} files differ in bytes only)"
    return f"bytes ({len(names)} files)"


def _same_values(a: Path, b: Path) -> bool:
    if a.suffix == ".parquet":
        return pq.read_table(a).equals(pq.read_table(b))
    if a.suffix == ".json":
        return json.loads(a.read_text()) == json.loads(b.read_text())
    return False


_BAR = re.compile(r"([EM]-step \d+): +\d+%\|[^|\r\n]*\| *(\d+)/(\d+)")


def _landed(point: KillPoint, version_dir: Path, stderr: str) -> str:
    """Where the kill landed: the shards finished, or the last EM progress bar shown and the
    iterations saved; and the partial files (hidden temporaries) it left behind."""
    partial = sum(".tmp-" in p.name for p in version_dir.rglob(".*"))
    left = f", {partial} partial file(s) left" if partial else ""
    if point.phase == "shard":
        return f"{len(shard_paths(version_dir))} shard(s) finished{left}"
    bars = _BAR.findall(stderr)
    where = f"{bars[-1][0]}, bar at {bars[-1][1]}/{bars[-1][2]}" if bars else "before the first M-step"
    return f"{where}; {_finished_iterations(version_dir)} iteration(s) saved{left}"


def _finished_iterations(version_dir: Path) -> int:
    return len(list(version_dir.glob("em/restart-*/iter-*/state.json")))


def _check_reuse(job: StageJob, finished: dict[str, tuple[int, int]], iterations_done: int, version_dir: Path,
                 rerun_stderr: str, problems: list[str]) -> str:
    """What the rerun kept of the killed run's finished work; what it redid goes to ``problems``."""
    if not finished:
        return "nothing was finished"
    rewritten = sorted(name for name, stamp in finished.items()
                       if not (version_dir / name).is_file() or _stamp(version_dir / name) != stamp)
    if rewritten:
        problems.append(f"the rerun rewrote finished files: {rewritten[:5]}{' ...' if len(rewritten) > 5 else ''}")
    if not read_manifest(version_dir)["resumed"]:
        problems.append("the manifest does not say resumed although finished work was there")
    if job.stage != "train":
        return f"{len(finished)} shard(s) kept"
    started = re.search(r"M-step (\d+):", rerun_stderr)
    first = int(started.group(1)) if started else None
    expected = iterations_done if iterations_done < job.config["em_iterations"] else None
    if first != expected:
        problems.append(f"the rerun started EM at iteration {first}; {iterations_done} iteration(s) were finished")
    return f"{iterations_done} iteration(s) kept" + (f", resumed at M-step {first}" if first is not None else "")


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns
