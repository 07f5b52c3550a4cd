"""The cache stage without an orchestrator: `rankings` or `augmented` in, `cache` out (DESIGN 3, 5.4).

For every example and every response (the m originals, then the m' - m generated ones, if any):
token ids of prompt + response (+ EOS), the response start, ref_logp = log pi_ref(y|x) (float64),
and the m' x m' reference contraction s_ref (float32, row-major), computed once so that the train
stage never runs pi_ref and can draw new anchors every EM iteration (null with cache.contractions =
false: forward passes only, for caches that are only scored exactly).

    plan_cache         the version (config, the input artifact, the model's content) and whether it exists
    run_cache          tokenise, run pi_ref shard by shard (a finished shard is never recomputed)
    load_policy_inputs a finished cache as moplex_core.scorers.lora_policy.PolicyInputs (one split)

Besides the cache columns each row carries the input's example_id, split, cluster, ranking,
ranked_prefix and n_original (m), so the train and evaluate stages read one artifact.
`tasks/cache.py` wraps these for Prefect.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moplex_core.artifacts import ArtifactRef, ArtifactStore, load_table, read_manifest, root_of, shard_name
from moplex_core.config import CacheConfig, local_model_absolute, refuse_the_pipelines_model
from moplex_core.estimate import reference_terms_batch
from moplex_core.hashing import files_changed, files_fingerprint, model_files, model_fingerprint
from moplex_core.lm.checkpointing import checkpoint_layers
from moplex_core.lm.checks import beyond_the_context, context_length, warn_of_turn_layout
from moplex_core.lm.device import passes_sized_by
from moplex_core.lm.loading import (dtype_name, identity_on_this_machine, load_config, load_model, load_tokenizer,
                                    resolve_device, resolve_dtype)
from moplex_core.lm.tokenize import TokenizedResponse, encode_response, tokenize_responses
from moplex_core.pl import encode_tiers_batch
from moplex_core.tiny_model import MODEL_DIR
from moplex_core.tiny_model import STAGE as TINY_MODEL_STAGE

log = logging.getLogger(__name__)

STAGE = "cache"
CODE_VERSION = "cache-6"  # bump when a change to this stage changes what it writes (6: s_ref with the target
# terms; 5: no appended EOS in a template-less prompt, special-token prompts counted; 4: special-token text in
# responses)

CACHE_SCHEMA = pa.schema([
    pa.field("example_id", pa.string()),
    pa.field("split", pa.string()),
    pa.field("cluster", pa.string()),
    pa.field("ranking", pa.list_(pa.list_(pa.int32()))),
    pa.field("ranked_prefix", pa.int32()),
    pa.field("n_original", pa.int32()),
    pa.field("input_ids", pa.list_(pa.list_(pa.int32()))),  # [m'][tokens]
    pa.field("response_start", pa.list_(pa.int32())),  # [m']
    pa.field("ref_logp", pa.list_(pa.float64())),  # [m']
    pa.field("ref_contraction", pa.list_(pa.float32())),  # [m' * m'] row-major: s_ref[i][j] at i * m' + j; or null
])


@dataclass(frozen=True)
class CachePlan:
    ref: ArtifactRef
    path: Path
    inputs: dict[str, str]  # {"rankings": "ingest/<v>" or "augment/<v>", "model": "<fingerprint>"}
    complete: bool


@dataclass(frozen=True)
class CacheResult:
    ref: ArtifactRef
    path: Path
    built: bool  # False: the version was already complete and nothing was done
    rows: int


RANKING_STAGES = ("ingest", "augment")
"""The stages whose artifacts hold rankings a cache scores."""


def plan_cache(config: CacheConfig, rankings_dir: str | Path, store: ArtifactStore) -> CachePlan:
    refuse_the_pipelines_model(config.model)
    manifest = read_manifest(rankings_dir, RANKING_STAGES)  # refuses an unfinished artifact or another stage's
    inputs = {"rankings": f"{manifest['stage']}/{manifest['version']}", "model": model_fingerprint(config.model)}
    version = store.version(STAGE, identity_on_this_machine(config.identity(), config.device), inputs, CODE_VERSION)
    return CachePlan(ArtifactRef(STAGE, version), store.path(STAGE, version), inputs, store.is_complete(STAGE, version))


def run_cache(config: CacheConfig, rankings_dir: str | Path, store: ArtifactStore, plan: CachePlan | None = None,
              *, progress: bool = True) -> CacheResult:
    """Write the cache of ``rankings_dir`` (a rankings or augmented artifact) unless it is complete."""
    plan = plan or plan_cache(config, rankings_dir, store)
    if plan.complete:
        return CacheResult(plan.ref, plan.path, False, store.manifest(STAGE, plan.ref.version)["rows"])
    table = load_table(rankings_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    shared = config.shares_prompts(device)
    recorded = {**config.model_dump(mode="json"), "resolved_dtype": dtype_name(dtype), "resolved_share_prompts": shared}
    with store.writer(STAGE, plan.ref.version, config=recorded, inputs=plan.inputs, code_version=CODE_VERSION) as writer:
        if writer.complete:
            return CacheResult(plan.ref, plan.path, False, store.manifest(STAGE, plan.ref.version)["rows"])
        starts = list(range(0, table.num_rows, config.shard_rows))
        todo = [s for s, _ in enumerate(starts) if not writer.has_shard(s)]
        tokenizer = load_tokenizer(config.model)
        if todo:
            _refuse_beyond_the_context([table.slice(starts[s], config.shard_rows) for s in todo], tokenizer, config)
            model = load_model(config.model, dtype=dtype, device=device, progress=progress)
            if config.gradient_checkpointing:
                checkpoint_layers(model)
            warn_of_turn_layout(model.generation_config.eos_token_id, tokenizer, config.use_chat_template, "cache")
            done = (len(starts) - len(todo)) * config.shard_rows
            bar = tqdm(total=table.num_rows, initial=min(done, table.num_rows), desc="cache: pi_ref terms",
                       unit="example", disable=not progress)
            with bar:
                for shard in todo:
                    part = table.slice(starts[shard], config.shard_rows)
                    writer.write_shard(shard, cache_rows(part, model, tokenizer, config, shared, bar.update))
        shards = [pq.read_table(writer.path / shard_name(s), columns=TRUNCATION_COLUMNS) for s in range(len(starts))]
        ended = _ended(table)
        truncated = 0
        for start, rows in zip(starts, shards, strict=True):
            slots = [(row, j) for row in range(start, start + rows.num_rows) for j in range(len(ended[row]))]
            truncated += truncated_responses(
                rows, config.max_response_tokens, tokenizer.eos_token_id, [ended[row][j] for row, j in slots],
                lambda i, slots=slots: len(encode_response(tokenizer, _response_text(table, *slots[i]), ended=False)))
        if truncated:
            log.warning("%d response(s) are longer than cache.max_response_tokens = %d and lost their end "
                        "(and EOS); their scores are of the kept start. Raise max_response_tokens to keep them whole.",
                        truncated, config.max_response_tokens)
        marked = _ending_with(table, tokenizer.eos_token)
        if marked:
            log.warning("%d response(s) end with the tokenizer's eos_token text %r: it is taken for the end of the turn "
                        "(scored as the one EOS), not as text the response holds", marked, tokenizer.eos_token)
        specials, found = _prompts_holding(table, tokenizer.all_special_tokens)
        if specials:
            log.warning("%d prompt(s) hold the text of special tokens (%s): it is encoded as those control tokens, as "
                        "the chat template's own text is (a user text that closes its turn or opens another)",
                        specials, ", ".join(map(repr, found)))
        long_prompts = sum(prompts_at_the_limit(rows, config.max_prompt_tokens) for rows in shards)
        if long_prompts:
            log.warning("%d prompt(s) reach cache.max_prompt_tokens = %d tokens: they were cut from the left (or are "
                        "exactly that long), and a cut prompt has lost its start, with any BOS and the chat template's "
                        "opening (a system prompt). Raise max_prompt_tokens to keep them whole.",
                        long_prompts, config.max_prompt_tokens)
        writer.summary.update({
            "examples": table.num_rows,
            "responses_per_example": _distribution(table),
            "truncated_responses": truncated,
            "max_response_tokens": config.max_response_tokens,
            "prompts_at_max_prompt_tokens": long_prompts,
            "responses_ending_with_eos_text": marked,
            "prompts_with_special_token_text": specials,
            "input": plan.inputs["rankings"],
            **_model_files_of(config.model, plan.inputs["model"]),
        })
    log.info("wrote the cache of %d examples to %s", table.num_rows, plan.path)
    return CacheResult(plan.ref, plan.path, True, table.num_rows)


def cache_rows(
    part: pa.Table,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: CacheConfig,
    share_prompts: bool,
    advance: Callable[[int], object] = lambda n: None,
) -> pa.Table:
    """CACHE_SCHEMA rows of a slice of a rankings/augmented table, each example's prompt run once per
    pass (``share_prompts``) or per response; ``advance(n)`` after n examples."""
    rows = part.to_pylist()
    examples = [_tokenize(row, ended, tokenizer, config) for row, ended in zip(rows, _ended(part), strict=True)]
    terms = []
    half = max(1, config.score_batch_size // 2)
    checkpointable = config.contractions and not config.gradient_checkpointing  # passes with gradients, not yet
    also = ", or set cache.gradient_checkpointing = true" if checkpointable else ""
    with passes_sized_by(f"a cache pass holds up to cache.score_batch_size = {config.score_batch_size} responses; "
                         f"lower it (--set cache.score_batch_size={half}), or cache.max_response_tokens{also}"):
        for batch in _whole_examples(examples, config.score_batch_size):
            terms += reference_terms_batch(model, batch, tokenizer.pad_token_id, rows_per_pass=config.score_batch_size,
                                           chunk_size=config.chunk_size, contractions=config.contractions,
                                           share_prompts=share_prompts)
            advance(len(batch))
    return pa.Table.from_pylist([
        {
            "example_id": row["example_id"],
            "split": row["split"],
            "cluster": row["cluster"],
            "ranking": row["ranking"],
            "ranked_prefix": row["ranked_prefix"],
            "n_original": len(row["responses"]),
            "input_ids": [seq.input_ids for seq in seqs],
            "response_start": [seq.response_start for seq in seqs],
            "ref_logp": ref_logp.tolist(),
            "ref_contraction": None if s_ref is None else s_ref.flatten().tolist(),
        }
        for row, seqs, (ref_logp, s_ref) in zip(rows, examples, terms, strict=True)
    ], schema=CACHE_SCHEMA)


def _whole_examples(examples: list[list[TokenizedResponse]], rows: int) -> Iterator[list[list[TokenizedResponse]]]:
    """Consecutive examples with at most ``rows`` responses in all, so that no example's responses
    straddle two passes; an example with more responses than that comes alone (and is split)."""
    batch: list[list[TokenizedResponse]] = []
    for sequences in examples:
        if batch and sum(map(len, batch)) + len(sequences) > rows:
            yield batch
            batch = []
        batch.append(sequences)
    if batch:
        yield batch


TRUNCATION_COLUMNS = ["input_ids", "response_start"]


def truncated_responses(rows: pa.Table, max_response_tokens: int | None, eos_token_id: int,
                        ended: list[bool] | None = None, text_tokens: Callable[[int], int] | None = None) -> int:
    """How many responses of cache ``rows`` were cut at ``max_response_tokens``: exactly that many
    response tokens and no EOS at the end (moplex_core.lm.tokenize appends EOS to every whole response
    that ended). ``ended``: per response, in order, whether it ended; default every one. A generation
    that max_new_tokens cut did not end, so it has no EOS whatever the limit, and its kept length
    alone cannot tell whether the cache cut it too: ``text_tokens(j)``, the token count of response
    j's whole text, decides for those at the limit (without it none of them counts)."""
    if max_response_tokens is None or rows.num_rows == 0:
        return 0
    sequences = pc.list_flatten(rows.column("input_ids")).combine_chunks()  # one list per response
    offsets = np.asarray(sequences.offsets)
    lengths = np.diff(offsets)
    starts = np.asarray(pc.list_flatten(rows.column("response_start")))
    last = np.asarray(sequences.values)[offsets[1:] - 1]
    did_end = np.ones(len(lengths), dtype=bool) if ended is None else np.asarray(ended, dtype=bool)
    at_limit = (lengths - starts == max_response_tokens) & (last != eos_token_id)
    unfinished = np.flatnonzero(at_limit & ~did_end)
    longer = 0 if text_tokens is None else sum(text_tokens(int(j)) > max_response_tokens for j in unfinished)
    return int((at_limit & did_end).sum()) + longer


def _model_files_of(model: str, fingerprint: str) -> dict[str, dict[str, str]]:
    """``{"model_files": ...}`` for the summary: a local model's files and digests, so that a refusal of a
    changed model can name the files; {} for a hub name, or a folder changed since the plan hashed it."""
    if not fingerprint.startswith("sha256:"):
        return {}
    files = model_files(model)
    return {"model_files": files} if files_fingerprint(files) == fingerprint else {}


def prompts_at_the_limit(rows: pa.Table, max_prompt_tokens: int | None) -> int:
    """How many examples of cache ``rows`` have a prompt of exactly ``max_prompt_tokens`` tokens: cut
    from the left, or exactly that long (the cache keeps no longer count to tell them apart)."""
    if max_prompt_tokens is None or rows.num_rows == 0:
        return 0
    first = pc.list_element(rows.column("response_start"), 0)  # every response of an example starts there
    return int(pc.sum(pc.equal(first, max_prompt_tokens)).as_py() or 0)


def cache_model(cache_dir: str | Path, model: str | None = None) -> str:
    """The base model the cache at ``cache_dir`` was built with, where it is now: ``model`` (the
    caller's: `cache.model` in a pipeline, `moplex assign --model`) when given; else the folder the
    cache recorded, or, where that is gone, the same version of the tiny model in the root that holds
    the cache (a moved artifact root). Refused unless its files hash as they did when the cache was
    built (adapters trained or scored on another model would sit on it, and every log pi_ref in the
    cache would be another model's)."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    recorded, built_with = manifest["config"]["model"], manifest["inputs"]["model"]
    local = built_with.startswith("sha256:")  # a folder's files, not a hub name
    given = model is not None
    if model is None:
        model = recorded
        root = ArtifactStore(root_of(cache_dir.resolve()))  # the root that holds the cache now
        moved = root.path(TINY_MODEL_STAGE, Path(recorded).parent.name) / MODEL_DIR
        if local and not Path(recorded).expanduser().is_dir() and moved.is_dir():
            model = str(moved)
    if local and not Path(model).expanduser().is_dir():
        raise ValueError(
            f"the base model given, {model}, is not a folder; give the folder that now holds the model the cache at "
            f"{cache_dir} was built with (at {recorded} then)" if given else
            f"the base model the cache at {cache_dir} was built with, the folder {model}, is not there now: put it "
            "back, or say where it is (`cache.model` in a pipeline run, the train and evaluate stages' `model`, "
            "`--model` of `moplex assign` or `moplex experiment approximation`); a folder with the same files will do")
    now = model_fingerprint(model)  # memoised per process: the plan of a cache has just computed it
    if built_with == f"hub:{model}" and now != built_with:
        log.warning("the cache at %s was planned before hub model %s was in the local Hugging Face cache, so "
                    "which commit it was built with is not recorded and cannot be checked against the one cached "
                    "now (%s); download a hub model before its first stage (`hf download %s`) to pin it",
                    cache_dir, model, now.partition("@")[2], model)
    elif now != built_with:
        built_files = manifest["summary"].get("model_files")  # caches built before 2026-11-25 lack them
        changed = files_changed(built_files, model_files(model)) if local and built_files else ""
        changes = f" ({changed})" if changed else ""
        if given and local:
            raise ValueError(f"the base model given, {model}, is not the one the cache at {cache_dir} was built with "
                             f"(at {recorded} then): its identity is {now}, not {built_with}{changes}; give the folder "
                             "that holds that model's files")
        raise ValueError(f"the base model at {model} is not the one the cache at {cache_dir} was built with: its "
                         f"identity is {now} now, not {built_with}{changes}; restore that model (a hub name loads the "
                         "commit that refs/main names in the local Hugging Face cache), or rebuild the cache and "
                         "retrain on the new one")
    return local_model_absolute(model)


def load_policy_inputs(cache_dir: str | Path, split: str | None = "train"):
    """The cache's rows of ``split`` (None: all) as PolicyInputs, and their cluster labels (list)."""
    table = load_table(cache_dir)
    if split is not None:
        table = table.filter(pc.equal(table.column("split"), split))
        if table.num_rows == 0:
            raise ValueError(f"the cache at {cache_dir} has no rows of split {split!r}; "
                             "ingest with a split that has some")
    return policy_inputs(table)


def contractions_out_of_date(cache_dir: str | Path) -> str | None:
    """Why the s_ref of the cache at ``cache_dir`` cannot serve estimates (it predates cache-6, whose
    s_ref has the target terms that the policy's first-order terms now have too), or None."""
    code = read_manifest(cache_dir).get("code_version", "")
    if not code.startswith("cache-") or int(code.removeprefix("cache-")) < 6:
        return (f"the cache at {cache_dir} was built by {code}, whose reference contractions s_ref leave out the "
                "target terms that estimates now add (moplex_core.estimate): rerun the cache stage (a new "
                "version), or set train.anchors to null to compute every response exactly")
    return None


def policy_inputs(table: pa.Table):
    """CACHE_SCHEMA rows as PolicyInputs, in the table's order, and their cluster labels (list).
    ref_contraction is None when the rows have none (cache.contractions = false)."""
    from moplex_core.scorers.lora_policy import PolicyInputs

    columns = table.to_pydict()
    sizes = [len(r) for r in columns["response_start"]]
    width = max(sizes)
    n = len(sizes)
    ref_logp = torch.zeros(n, width, dtype=torch.float64)
    missing = sum(s is None for s in columns["ref_contraction"])
    if 0 < missing < n:
        raise ValueError(f"{missing} of {n} cache rows have no ref_contraction: rows of caches built with and "
                         "without cache.contractions are mixed; rebuild the cache")
    ref_contraction = None if missing else torch.zeros(n, width, width, dtype=torch.float32)
    sequences = []
    for i, m in enumerate(sizes):
        ref_logp[i, :m] = torch.tensor(columns["ref_logp"][i], dtype=torch.float64)
        if ref_contraction is not None:
            ref_contraction[i, :m, :m] = torch.tensor(columns["ref_contraction"][i], dtype=torch.float32).reshape(m, m)
        sequences.append(tuple(TokenizedResponse(list(ids), start) for ids, start in
                               zip(columns["input_ids"][i], columns["response_start"][i], strict=True)))
    tiers = encode_tiers_batch(columns["ranking"], sizes, width)
    inputs = PolicyInputs(tuple(columns["example_id"]), tuple(sequences), ref_logp, ref_contraction, tiers,
                          torch.tensor(columns["ranked_prefix"], dtype=torch.int64))
    return inputs, columns["cluster"]


def _ended(table: pa.Table) -> list[list[bool]]:
    """Per row of a rankings/augmented table, per response (originals, then generated): whether it
    ended. A generated text that max_new_tokens cut short did not end there, so it gets no EOS
    (augment-2 and older record nothing: their texts count as ended). Reads no text."""
    originals = pc.list_value_length(table.column("responses")).to_pylist()
    names = table.column_names
    generated = (pc.list_value_length(table.column("generated")).fill_null(0).to_pylist() if "generated" in names
                 else [0] * table.num_rows)
    finished = (table.column("generated_finished").to_pylist() if "generated_finished" in names
                else [None] * table.num_rows)
    return [[True] * o + (list(f) if f is not None else [True] * g)
            for o, g, f in zip(originals, generated, finished, strict=True)]


def _prompts_holding(table: pa.Table, texts: list[str]) -> tuple[int, list[str]]:
    """How many rows' prompts (the messages' contents where the row has them, else the text) hold one
    of ``texts``, and which of them occur."""
    texts = sorted(set(filter(None, texts)))
    messages = table.column("prompt_messages").to_pylist() if "prompt_messages" in table.column_names else None
    holding, found = 0, set()
    for i, prompt in enumerate(table.column("prompt").to_pylist()):
        if messages is not None and messages[i]:
            prompt = "\n".join(str(message.get("content", "")) for message in json.loads(messages[i]))
        occurring = [text for text in texts if text in prompt]
        holding += bool(occurring)
        found.update(occurring)
    return holding, sorted(found)


def _response_text(table: pa.Table, row: int, j: int) -> str:
    """Response ``j`` of ``row`` in a rankings/augmented table (originals, then generated)."""
    originals = table.column("responses")[row].as_py()
    return originals[j] if j < len(originals) else table.column("generated")[row].as_py()[j - len(originals)]


def _ending_with(table: pa.Table, text: str | None) -> int:
    """How many responses (originals and generated) of ``table`` end with ``text``, trailing space aside."""
    if not text:
        return 0
    columns = [c for c in ("responses", "generated") if c in table.column_names]
    return sum(int(pc.sum(pc.ends_with(pc.utf8_rtrim_whitespace(pc.list_flatten(table.column(c))), text)).as_py() or 0)
               for c in columns)


def _refuse_beyond_the_context(parts: list[pa.Table], tokenizer: PreTrainedTokenizerBase, config: CacheConfig
                               ) -> None:
    """Every example of ``parts`` (the shards to do) tokenized before a model loads, to refuse (naming
    how many and the first) those whose prompt + response the model cannot read, before any shard is
    written: the fix (cache.max_prompt_tokens, max_response_tokens) is a new version, which would not
    reuse them. The shards tokenize again when they run (cheap next to their passes)."""
    context = context_length(load_config(config.model).get_text_config())
    longest = [(row["example_id"], max(len(seq.input_ids) for seq in _tokenize(row, ended, tokenizer, config)))
               for part in parts for row, ended in zip(part.to_pylist(), _ended(part), strict=True)]
    beyond = beyond_the_context(longest, context)
    if beyond is not None:
        count, example_id, tokens = beyond
        raise ValueError(f"{count} example(s) have a prompt + response longer than the {context} positions the model "
                         f"reads (its context; e.g. example_id {example_id!r}: {tokens} tokens); set "
                         "cache.max_prompt_tokens and cache.max_response_tokens so that their sum is at most "
                         f"{context}")


def _tokenize(row: dict, ended: list[bool], tokenizer: PreTrainedTokenizerBase, config: CacheConfig
              ) -> list[TokenizedResponse]:
    responses = list(row["responses"]) + list(row.get("generated") or [])
    prompt = json.loads(row["prompt_messages"]) if row.get("prompt_messages") else row["prompt"]
    try:
        return tokenize_responses(tokenizer, prompt, responses, use_chat_template=config.use_chat_template,
                                  max_prompt_tokens=config.max_prompt_tokens,
                                  max_response_tokens=config.max_response_tokens, ended=ended)
    except ValueError as err:
        raise ValueError(f"example_id {row['example_id']!r}: {err}") from err


def _distribution(table: pa.Table) -> dict[str, int]:
    sizes = np.asarray(pc.list_value_length(table.column("responses")).to_pylist())
    if "generated" in table.column_names:
        sizes = sizes + np.asarray(pc.list_value_length(table.column("generated")).fill_null(0).to_pylist())
    values, counts = np.unique(sizes, return_counts=True)
    return {str(v): int(c) for v, c in zip(values, counts, strict=True)}
