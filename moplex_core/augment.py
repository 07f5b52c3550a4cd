"""The augment stage without an orchestrator: `rankings` in, `augmented` out (paper section 4.1).

Every ranking gets m' - m extra responses that the likelihood places below all its originals,
unordered among themselves (paper eq. 5; DESIGN.md 3, 5.2). A model backend generates once per
prompt, and every ranking of that prompt shares the texts; ``borrow`` fills each ranking from the
other rankings of its prompt. A prompt is a ``prompt_id`` (ingest: a hash of the prompt text), so
rankings whose chat messages differ around one text (another system prompt) share texts generated
from the first such ranking's messages; each is still scored under its own messages by the cache.

    plan_augment    the version (config, the rankings' version, the model's content) and whether it exists
    make_generator  the configured backend (moplex_core.generate)
    fill_groups     sampling with deduplication and bounded resampling, for a list of prompts
    run_augment     shard by prompt, generate what no finished shard holds, write, report shortfalls

Deduplication: a sample is dropped when its normalised text (moplex_core.generate.base.normalise)
is empty, equals an original response of its prompt, or equals a sample already kept; the missing
ones are asked for again with the next attempt's seed, ``max_attempts`` rounds in all. The number
of rounds a prompt used is stored in ``generation.attempts``. Prompts still short are never
dropped silently: they are logged, written to ``shortfall.parquet`` (SHORTFALL_SCHEMA; always
present, empty when none), and either stop the stage (``on_shortfall="fail"``, after the shard that
revealed them is written) or are kept with fewer generated responses (``"keep_fewer"``).

Shards hold ``shard_prompts`` prompts each (in order of first appearance), with the rankings of
those prompts in input order; a finished shard is never regenerated (moplex_core.artifacts).
`tasks/augment.py` wraps these for Prefect; `moplex augment` calls `run_augment` directly.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest, shard_name
from moplex_core.config import AugmentConfig, refuse_the_pipelines_model
from moplex_core.generate.base import Generator, SampleRequest, normalise, request_seed
from moplex_core.hashing import model_fingerprint
from moplex_core.schema import RANKINGS_SCHEMA, check_rankings

log = logging.getLogger(__name__)

STAGE = "augment"
CODE_VERSION = "augment-6"  # bump when a change to this stage changes what it writes (6: the hf backend stops at
# the tokenizer's EOS and the generation config's, as vLLM does; 5: no appended EOS in a
# template-less prompt; 4: generation.model is
# the model's fingerprint, not its path; 3: generated_finished; 2: non-thinking prompts; the model's
# generation_config no longer shapes the hf draw)
SHORTFALL_FILE = "shortfall.parquet"

GENERATION_TYPE = pa.struct([
    pa.field("backend", pa.string()),
    # the model's fingerprint, as in the version's inputs (sha256:<its files> or hub:<name>@<commit>), so a
    # moved model writes the same bytes (its path is in the manifest's config); null for borrow
    pa.field("model", pa.string()),
    pa.field("temperature", pa.float64()),  # null for borrow, as are top_p and max_new_tokens
    pa.field("top_p", pa.float64()),
    pa.field("max_new_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("attempts", pa.int32()),  # sampling rounds this prompt (borrow: ranking) used
])
AUGMENTED_SCHEMA = RANKINGS_SCHEMA.append(pa.field("generated", pa.list_(pa.string()), nullable=False)).append(
    pa.field("generation", GENERATION_TYPE, nullable=False)
).append(pa.field("generated_finished", pa.list_(pa.bool_()), nullable=False))  # per text: False if max_new_tokens cut it
SHORTFALL_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string()),
    pa.field("rankings", pa.int64()),  # rankings of this prompt with this many generated responses
    pa.field("wanted", pa.int32()),
    pa.field("got", pa.int32()),
    pa.field("attempts", pa.int32()),
])
_SHOWN = 20


class ShortfallError(RuntimeError):
    """Some prompts got fewer distinct generated responses than asked and ``on_shortfall`` is "fail"."""

    def __init__(self, shortfall: pa.Table, config: AugmentConfig, where: Path):
        self.shortfall = shortfall
        remedy = ("The borrow backend lends only responses that other rankings of the same prompt have, and "
                  "it has no more for these: use a generating backend (hf, vllm), lower n_generated, or"
                  if config.backend == "borrow" else "Raise max_attempts or temperature, or")
        super().__init__(
            f"{_describe(shortfall)} (n_generated = {config.n_generated}; attempts per prompt, at most "
            f"{config.max_attempts}, in the table):\n{_show(shortfall)}\nThe table is in {where / SHORTFALL_FILE}. "
            f"{remedy} rerun with on_shortfall=keep_fewer to keep these rankings with fewer generated responses "
            "(the finished shards are reused)."
        )


@dataclass(frozen=True)
class AugmentPlan:
    ref: ArtifactRef
    path: Path
    rankings: Path  # the input rankings version folder
    inputs: dict[str, str]  # {"rankings": "ingest/<version>", "model": "sha256:..." | "hub:<name>@<commit>"}
    complete: bool


@dataclass(frozen=True)
class AugmentResult:
    ref: ArtifactRef
    path: Path
    built: bool  # False: the version was already complete and nothing was done
    rows: int
    shortfall: pa.Table  # SHORTFALL_SCHEMA


@dataclass(frozen=True)
class Group:
    """Rankings that share their generated responses: one prompt's (one ranking's for borrow)."""

    key: str
    prompt: str
    prompt_messages: str | None
    avoid: frozenset[str]  # normalised original responses


@dataclass
class Filled:
    texts: list[str]
    tokens: int
    attempts: int
    finished: list[bool] = field(default_factory=list)  # per text: ended by the model, not cut at max_new_tokens


def plan_augment(config: AugmentConfig, rankings: str | Path, store: ArtifactStore) -> AugmentPlan:
    """The version ``config`` maps to for the finished rankings artifact at ``rankings``."""
    refuse_the_pipelines_model(config.model)
    rankings = Path(rankings)
    manifest = read_manifest(rankings, ("ingest",))  # an augmented artifact's rows carry generations already
    inputs = {"rankings": f"{manifest['stage']}/{manifest['version']}"}
    if config.model is not None:
        inputs["model"] = model_fingerprint(config.model)
    identity = config.identity()
    if config.backend == "hf":  # vLLM resolves its own "auto" (the model's dtype)
        from moplex_core.lm.loading import identity_on_this_machine

        identity = identity_on_this_machine(identity, config.device)
    version = store.version(STAGE, identity, inputs, CODE_VERSION)
    return AugmentPlan(ArtifactRef(STAGE, version), store.path(STAGE, version), rankings, inputs,
                       store.is_complete(STAGE, version))


def make_generator(config: AugmentConfig, rankings: pa.Table, progress: bool = True) -> Generator:
    """The configured backend. ``rankings`` (canonical) gives borrow its pools; ``progress=False``
    silences the hf backend's model loading bar."""
    if config.backend == "hf":
        from moplex_core.generate.hf import HFGenerator

        return HFGenerator(config.model, temperature=config.temperature, top_p=config.top_p,
                           max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
                           dtype=config.dtype, device=config.device, use_chat_template=config.use_chat_template,
                           max_prompt_tokens=config.max_prompt_tokens, progress=progress)
    if config.backend == "vllm":
        from moplex_core.generate.vllm_backend import VLLMGenerator

        return VLLMGenerator(config.model, python=config.vllm_python, temperature=config.temperature,
                             top_p=config.top_p, max_new_tokens=config.max_new_tokens, dtype=config.dtype,
                             seed=config.seed, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                             max_model_len=config.vllm_max_model_len,
                             use_chat_template=config.use_chat_template, max_prompt_tokens=config.max_prompt_tokens,
                             timeout_s=config.vllm_timeout_s)
    from moplex_core.generate.borrow import BorrowGenerator, borrow_pools

    columns = rankings.select(["example_id", "prompt_id", "responses"]).to_pydict()
    return BorrowGenerator(borrow_pools(columns["example_id"], columns["prompt_id"], columns["responses"]))


def check_prompts(config: AugmentConfig, rankings: pa.Table) -> int:
    """Every distinct prompt of ``rankings`` rendered once with the model's tokenizer before a model
    loads (hf, vllm), so that a prompt no shard could render (chat messages without a chat template,
    say) or that the backend would refuse as too long for the model's context stops the stage at once,
    naming the prompt_ids, and not when its shard comes up after earlier shards were generated, whose
    work the fix (a new version) would not reuse. Returns how many of them are longer than
    ``augment.max_prompt_tokens`` (generated from their last tokens), and warns of them, naming the
    first."""
    if config.backend == "borrow":
        return 0
    from moplex_core.generate import hf, vllm_backend  # transformers: only the model backends need it
    from moplex_core.generate.base import request_prompt_ids
    from moplex_core.lm.checks import context_length
    from moplex_core.lm.loading import load_config, load_tokenizer

    tokenizer = load_tokenizer(config.model)
    rows = rankings.select(["prompt_id", "prompt", "prompt_messages"]).to_pylist()
    failed: dict[str, str] = {}  # prompt_id -> the reason
    cut: dict[str, int] = {}  # prompt_id -> its tokens, uncut
    generated: list[tuple[str, int]] = []  # (prompt_id, its tokens as generated: cut to max_prompt_tokens)
    for row in {(r["prompt_id"], r["prompt"], r["prompt_messages"]): r for r in rows}.values():
        try:
            ids = request_prompt_ids(tokenizer, SampleRequest(row["prompt_id"], row["prompt"], row["prompt_messages"],
                                                              1, 0),
                                     use_chat_template=config.use_chat_template, max_prompt_tokens=None)
        except ValueError as err:
            failed.setdefault(row["prompt_id"], str(err))
            continue
        if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
            cut[row["prompt_id"]] = len(ids)
        generated.append((row["prompt_id"], min(len(ids), config.max_prompt_tokens or len(ids))))
    if failed:
        named = sorted(failed)
        raise ValueError(f"{len(failed)} prompt(s) cannot be rendered for generation ({', '.join(named[:10])}"
                         f"{', ...' if len(failed) > 10 else ''}); the first: {failed[named[0]]}")
    if config.backend == "vllm":
        vllm_backend.refuse_prompts_beyond_the_context(
            sorted(generated), vllm_backend.served_context(config.model, config.vllm_max_model_len), config.max_new_tokens)
    else:
        hf.refuse_prompts_beyond_the_context(sorted(generated), context_length(load_config(config.model).get_text_config()),
                                             config.max_new_tokens)
    if cut:
        first = min(cut)
        log.warning("%d prompt(s) are longer than augment.max_prompt_tokens = %d tokens (e.g. %s: %d tokens): they "
                    "are generated from their last tokens, losing their start (any BOS and the chat template's "
                    "opening). Raise augment.max_prompt_tokens to keep them whole.",
                    len(cut), config.max_prompt_tokens, first, cut[first])
    return len(cut)


def groups_of(rankings: pa.Table, backend: str) -> tuple[list[Group], list[str]]:
    """(the groups, the group key of every row). Model backends group by prompt_id; borrow by row."""
    rows = rankings.select(["example_id", "prompt_id", "prompt", "prompt_messages", "responses"]).to_pylist()
    by_prompt = backend != "borrow"
    keys = [row["prompt_id"] if by_prompt else row["example_id"] for row in rows]
    originals: dict[str, set[str]] = defaultdict(set)
    first: dict[str, dict] = {}
    for key, row in zip(keys, rows, strict=True):
        originals[key].update(normalise(text) for text in row["responses"])
        first.setdefault(key, row)
    groups = [Group(key, row["prompt"], row["prompt_messages"], frozenset(originals[key])) for key, row in first.items()]
    return groups, keys


def fill_groups(
    groups: Sequence[Group],
    generator: Generator,
    n: int,
    seed: int,
    max_attempts: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Filled]:
    """Up to ``n`` distinct new texts per group (module docstring), asking ``generator`` once per
    attempt for all groups still short. ``on_progress(groups_done, tokens)`` follows each attempt."""
    filled = {g.key: Filled([], 0, 0) for g in groups}
    seen = {g.key: set(g.avoid) for g in groups}
    exhausted: set[str] = set()
    for attempt in range(max_attempts):
        todo = [g for g in groups if len(filled[g.key].texts) < n and g.key not in exhausted]
        if not todo:
            break
        requests = [
            SampleRequest(g.key, g.prompt, g.prompt_messages, n - len(filled[g.key].texts),
                          request_seed(seed, g.key, attempt), frozenset(seen[g.key]))
            for g in todo
        ]
        tokens = 0
        for group, request, samples in zip(todo, requests, generator.sample(requests), strict=True):
            state = filled[group.key]
            state.attempts = attempt + 1
            if len(samples) < request.n:
                exhausted.add(group.key)
            for sample in samples:
                state.tokens += sample.tokens
                tokens += sample.tokens
                text_key = normalise(sample.text)
                if text_key and text_key not in seen[group.key]:
                    seen[group.key].add(text_key)
                    state.texts.append(sample.text)
                    state.finished.append(sample.finished)
        if on_progress is not None:
            last = attempt + 1 == max_attempts
            done = sum(1 for g in todo if last or g.key in exhausted or len(filled[g.key].texts) >= n)
            on_progress(done, tokens)
    return filled


def augment_rows(rankings: pa.Table, config: AugmentConfig, generator: Generator, model: str | None,
                 on_progress: Callable[[int, int], None] | None = None) -> pa.Table:
    """``rankings`` (canonical) with ``generated`` and ``generation`` added (AUGMENTED_SCHEMA);
    ``model`` is the generator's fingerprint (`plan_augment`'s inputs), None for borrow."""
    groups, keys = groups_of(rankings, config.backend)
    filled = fill_groups(groups, generator, config.n_generated, config.seed, config.max_attempts, on_progress)
    sampled = config.backend != "borrow"
    generation = [
        {
            "backend": config.backend,
            "model": model,
            "temperature": config.temperature if sampled else None,
            "top_p": config.top_p if sampled else None,
            "max_new_tokens": config.max_new_tokens if sampled else None,
            "seed": config.seed,
            "attempts": filled[key].attempts,
        }
        for key in keys
    ]
    table = rankings.append_column("generated", pa.array([filled[k].texts for k in keys], pa.list_(pa.string())))
    table = table.append_column("generation", pa.array(generation, GENERATION_TYPE))
    finished = pa.array([filled[k].finished for k in keys], pa.list_(pa.bool_()))
    return table.append_column("generated_finished", finished).cast(AUGMENTED_SCHEMA)


def shortfall_of(augmented: pa.Table, n_generated: int) -> pa.Table:
    """SHORTFALL_SCHEMA rows for the rankings of ``augmented`` with fewer than ``n_generated``
    generated responses, one per (prompt_id, got, attempts)."""
    got = pc.list_value_length(augmented.column("generated")).to_pylist()
    prompt_ids = augmented.column("prompt_id").to_pylist()
    attempts = pc.struct_field(augmented.column("generation"), "attempts").to_pylist()
    counts = Counter((p, g, a) for p, g, a in zip(prompt_ids, got, attempts, strict=True) if g < n_generated)
    rows = [{"prompt_id": p, "rankings": c, "wanted": n_generated, "got": g, "attempts": a}
            for (p, g, a), c in counts.items()]
    return pa.Table.from_pylist(rows, schema=SHORTFALL_SCHEMA)


def run_augment(
    config: AugmentConfig,
    rankings: str | Path,
    store: ArtifactStore,
    plan: AugmentPlan | None = None,
    progress: bool = True,
) -> AugmentResult:
    """Write the augmented artifact of ``config`` for the rankings at ``rankings`` unless that version
    is complete; resumes an interrupted run from its finished shards. Raises `ShortfallError` when
    ``on_shortfall`` is "fail" and a prompt fell short (also when the version was completed earlier
    with "keep_fewer")."""
    plan = plan or plan_augment(config, rankings, store)
    if plan.complete:  # said by the caller (moplex augment, the augment flow)
        return _finished(plan, config)
    table = check_rankings(load_table(plan.rankings))
    if table.num_rows == 0:
        raise ValueError(f"{plan.rankings} holds no rankings; there is nothing to augment")
    shards = _shard_rows(table.column("prompt_id").to_pylist(), config.shard_prompts)
    recorded = config.model_dump(mode="json")  # the full config, model path included, for provenance
    with store.writer(STAGE, plan.ref.version, config=recorded, inputs=plan.inputs,
                      code_version=CODE_VERSION) as writer:
        if writer.complete:  # another run finished it while this one waited (the writer says so)
            return _finished(plan, config)
        todo = [s for s in range(len(shards)) if not writer.has_shard(s)]
        if len(todo) < len(shards):
            log.info("%s: reusing %d finished shard(s), generating %d", plan.ref, len(shards) - len(todo), len(todo))
        prompts_cut = check_prompts(config, table.take([r for s in todo for r in shards[s]])) if todo else 0
        generator = make_generator(config, table, progress) if todo else None
        bar = _progress_bar(config, sum(_n_groups(table.take(shards[s]), config.backend) for s in todo),
                            progress and bool(todo))
        shortfalls = []
        failed = True
        try:
            for s, rows in enumerate(shards):
                if s in todo:
                    writer.write_shard(s, augment_rows(table.take(rows), config, generator, plan.inputs.get("model"),
                                                       bar.advance))
                shard = pq.read_table(writer.path / shard_name(s), columns=["prompt_id", "generated", "generation"])
                shortfalls.append(shortfall_of(shard, config.n_generated))
                if config.on_shortfall == "fail" and shortfalls[-1].num_rows:
                    shortfall = pa.concat_tables(shortfalls)
                    writer.write_table(SHORTFALL_FILE, shortfall)
                    raise ShortfallError(shortfall, config, plan.path)
            failed = False
        finally:
            bar.close()
            if generator is not None:
                try:
                    generator.close(failed=failed)
                except Exception:
                    if not failed:
                        raise
                    log.exception("closing the %s generator failed too; the error before it is raised next",
                                  config.backend)  # the error on its way out is the one to report
        shortfall = pa.concat_tables(shortfalls)
        writer.write_table(SHORTFALL_FILE, shortfall)
        writer.summary.update(_summary(writer.path, len(shards), shortfall, config, bar),
                              prompts_cut_this_run=prompts_cut)
    if shortfall.num_rows:
        log.warning("%s (kept with fewer, on_shortfall=keep_fewer):\n%s", _describe(shortfall), _show(shortfall))
    log.info("wrote %d augmented rankings to %s", table.num_rows, plan.path)
    return AugmentResult(plan.ref, plan.path, True, table.num_rows, shortfall)


class _Progress:
    """tqdm over prompts (rankings for borrow) with generated tokens per second alongside."""

    def __init__(self, bar: tqdm):
        self.bar = bar
        self.tokens = 0
        self.started = time.perf_counter()

    def advance(self, groups: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(groups)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(config: AugmentConfig, total: int, enabled: bool) -> _Progress:
    unit = "ranking" if config.backend == "borrow" else "prompt"
    return _Progress(tqdm(total=total, unit=unit, desc=f"augment ({config.backend})", disable=not enabled))


def _shard_rows(prompt_ids: list[str], shard_prompts: int) -> list[list[int]]:
    """Row indices of each shard: ``shard_prompts`` prompts per shard in order of first appearance."""
    rows_of: dict[str, list[int]] = defaultdict(list)
    for row, pid in enumerate(prompt_ids):
        rows_of[pid].append(row)
    order = list(rows_of)
    return [sorted(row for pid in order[i : i + shard_prompts] for row in rows_of[pid])
            for i in range(0, len(order), shard_prompts)]


def _n_groups(rankings: pa.Table, backend: str) -> int:
    return rankings.num_rows if backend == "borrow" else len(set(rankings.column("prompt_id").to_pylist()))


def _summary(path: Path, n_shards: int, shortfall: pa.Table, config: AugmentConfig, bar: _Progress) -> dict:
    columns = pa.concat_tables(
        pq.read_table(path / shard_name(s), columns=["prompt_id", "generated", "generation"]) for s in range(n_shards)
    )
    got = pc.list_value_length(columns.column("generated"))
    attempts = pc.struct_field(columns.column("generation"), "attempts").to_pylist()
    return {
        "prompts": len(set(columns.column("prompt_id").to_pylist())),
        "generated_responses": pc.sum(got).as_py() or 0,
        "generated_per_ranking": {str(k): v for k, v in sorted(Counter(got.to_pylist()).items())},
        "attempts_per_ranking": {str(k): v for k, v in sorted(Counter(attempts).items())},
        "shortfall_prompts": len(set(shortfall.column("prompt_id").to_pylist())),
        "shortfall_rankings": pc.sum(shortfall.column("rankings")).as_py() or 0,
        "tokens_generated_this_run": bar.tokens,
    }


def _finished(plan: AugmentPlan, config: AugmentConfig) -> AugmentResult:
    manifest = read_manifest(plan.path)
    shortfall = pq.read_table(plan.path / SHORTFALL_FILE).cast(SHORTFALL_SCHEMA)
    if config.on_shortfall == "fail" and shortfall.num_rows:
        raise ShortfallError(shortfall, config, plan.path)
    return AugmentResult(plan.ref, plan.path, False, manifest["rows"], shortfall)


def _describe(shortfall: pa.Table) -> str:
    prompts = len(set(shortfall.column("prompt_id").to_pylist()))
    rankings = pc.sum(shortfall.column("rankings")).as_py() or 0
    return f"{prompts} prompt(s) ({rankings} ranking(s)) got fewer distinct generated responses than asked"


def _show(shortfall: pa.Table) -> str:
    frame = shortfall.to_pandas().sort_values(["got", "prompt_id"])
    more = len(frame) - _SHOWN
    return frame.head(_SHOWN).to_string(index=False) + (f"\n... and {more} more rows" if more > 0 else "")
