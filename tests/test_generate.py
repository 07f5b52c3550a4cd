"""Response generators: the hf backend on the tiny offline model, borrow, and the vLLM worker protocol."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lm_fixtures import HUB_NAME, as_cached_hub_model, tiny_model_dir, tiny_tokenizer  # noqa: F401 - fixtures
import pyarrow as pa

from moplex_core.augment import Group, fill_groups, groups_of
from moplex_core.generate import vllm_backend, vllm_worker
from moplex_core.generate.base import Sample, SampleRequest, normalise, request_seed, sample_seed
from moplex_core.generate.borrow import BorrowGenerator, borrow_pools
from moplex_core.generate.hf import HFGenerator, sampling_processors
from moplex_core.generate.vllm_backend import VLLMGenerator, VLLMWorkerError, request_rows
from moplex_core.lm.tokenize import encode_prompt

PROMPTS = [f"Rank by criterion {i % 3}: which list is best?" + " Think." * (i % 4) for i in range(5)]


def requests(n: int = 3, seed: int = 0) -> list[SampleRequest]:
    return [SampleRequest(f"p{i}", p, None, n, request_seed(seed, f"p{i}", 0)) for i, p in enumerate(PROMPTS)]


def texts(samples):
    return [[s.text for s in row] for row in samples]


def test_hf_text_depends_on_the_seed_only_not_on_batching_or_order(tiny_model_dir):
    first = HFGenerator(str(tiny_model_dir), max_new_tokens=20, batch_size=4).sample(requests())
    assert [len(row) for row in first] == [3] * len(PROMPTS)
    assert all(0 < s.tokens <= 20 for row in first for s in row)
    rerun = HFGenerator(str(tiny_model_dir), max_new_tokens=20, batch_size=4).sample(requests())
    assert rerun == first
    one_by_one = HFGenerator(str(tiny_model_dir), max_new_tokens=20, batch_size=1)
    assert one_by_one.sample(requests()[::-1])[::-1] == first
    assert HFGenerator(str(tiny_model_dir), max_new_tokens=20, batch_size=7).sample(requests()[2:3]) == first[2:3]
    assert texts(one_by_one.sample(requests(seed=1))) != texts(first)
    assert len({s.text for row in first for s in row}) > 10  # temperature 2 on a tiny model: varied text


def test_the_models_own_generation_settings_never_shape_the_draw(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "generation_config.json").read_text())
    settings.update(do_sample=True, top_k=1, temperature=0.05, min_new_tokens=40, repetition_penalty=3.0)
    (model / "generation_config.json").write_text(json.dumps(settings))  # sampling settings, and two that act greedily
    plain = HFGenerator(str(tiny_model_dir), max_new_tokens=40, temperature=0.3, batch_size=4).sample(requests())
    assert min(sample.tokens for row in plain for sample in row) < 40  # min_new_tokens = 40 would change these
    assert HFGenerator(str(model), max_new_tokens=40, temperature=0.3, batch_size=4).sample(requests()) == plain


def test_gumbel_max_draws_follow_the_temperature_and_top_p_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature, top_p = 2.0, 0.8
    probs = torch.softmax(logits[0] / temperature, dim=0)
    keep = (torch.cumsum(probs, 0) - probs) < top_p  # the nucleus: smallest prefix with mass >= top_p
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    draws = 4000
    counts = torch.zeros(5)
    for seed in range(draws):
        generator = torch.Generator().manual_seed(sample_seed(7, seed))
        scores = sampling_processors(temperature, top_p, [generator])(torch.zeros(1, 1, dtype=torch.long), logits)
        counts[scores.argmax()] += 1
    assert expected[-1] == 0 and counts[-1] == 0  # outside the nucleus: never drawn
    assert torch.allclose(counts / draws, expected, atol=0.025)


def test_a_tiny_top_p_is_greedy_decoding(tiny_model_dir, tiny_tokenizer):
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=12, top_p=1e-6, temperature=2.0, batch_size=8)
    sampled = generator.sample(requests(n=2))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ended = []
    for request, row in zip(requests(), sampled, strict=True):
        ids = torch.tensor([encode_prompt(tiny_tokenizer, request.prompt)])
        greedy = model.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:].tolist()
        end = greedy.index(tiny_tokenizer.eos_token_id) if tiny_tokenizer.eos_token_id in greedy else len(greedy)
        assert [s.text for s in row] == [tiny_tokenizer.decode(greedy[:end], skip_special_tokens=True)] * 2
        finished = end < len(greedy)  # EOS produced: counted among the tokens; else cut at max_new_tokens
        assert [(s.finished, s.tokens) for s in row] == [(finished, end + 1 if finished else 12)] * 2
        ended.append(finished)
    assert any(ended) and not all(ended)  # both kinds, so both are checked


def test_a_model_that_names_no_end_of_sequence_token_is_refused(tiny_model_dir, tmp_path):
    model = tmp_path / "no-eos"
    shutil.copytree(tiny_model_dir, model)
    for name, key in (("generation_config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token"),
                      ("config.json", "eos_token_id")):
        settings = json.loads((model / name).read_text())
        settings[key] = None
        (model / name).write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="names no end-of-sequence token"):
        HFGenerator(str(model), max_new_tokens=4)
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=4)
    generator.close()
    generator.close()  # closing twice is harmless


def test_normalised_duplicates_are_one_text():
    assert normalise("  Hello\n\tWORLD ") == normalise("hello world") == "hello world"
    assert normalise("hello world!") != normalise("hello world")
    assert normalise(" \n ") == ""


def test_duplicates_of_originals_and_of_each_other_are_resampled(tiny_model_dir):
    # At a low temperature and 3 tokens the tiny model repeats itself: first rounds hold duplicates.
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=3, temperature=0.5, batch_size=16)
    plain = generator.sample(requests(n=4))
    originals = {f"p{i}": frozenset({normalise(row[0].text)}) for i, row in enumerate(plain)}
    groups = [Group(f"p{i}", p, None, originals[f"p{i}"]) for i, p in enumerate(PROMPTS)]
    filled = fill_groups(groups, generator, n=4, seed=0, max_attempts=6)
    assert max(f.attempts for f in filled.values()) > 1
    for group in groups:
        keys = [normalise(t) for t in filled[group.key].texts]
        assert len(set(keys)) == len(keys) and not set(keys) & group.avoid and all(keys)
        assert len(keys) == 4 or filled[group.key].attempts == 6
    assert fill_groups(groups, generator, n=4, seed=0, max_attempts=6) == filled


class Recorded:
    """A generator that keeps the requests it is given; ``generator`` samples them."""

    def __init__(self, generator) -> None:
        self.generator, self.calls = generator, []

    def sample(self, requests):
        self.calls.append(list(requests))
        return self.generator.sample(requests)


def test_every_attempt_of_every_prompt_draws_from_its_own_seed(tiny_model_dir):
    # At 1 token and a low temperature the tiny model repeats itself, so later attempts are needed;
    # an attempt must not draw with an earlier one's seed (it would repeat its texts), nor a run's
    # seed be ignored (augment.seed would change the version, not the texts).
    generator = Recorded(HFGenerator(str(tiny_model_dir), max_new_tokens=1, temperature=0.3, batch_size=16))
    groups = [Group(f"p{i}", p, None, frozenset()) for i, p in enumerate(PROMPTS[:2])]
    filled = fill_groups(groups, generator, n=3, seed=5, max_attempts=3)
    assert len(generator.calls) > 1
    for attempt, call in enumerate(generator.calls):
        assert [(r.key, r.seed) for r in call] == [(r.key, request_seed(5, r.key, attempt)) for r in call]
    assert len({r.seed for call in generator.calls for r in call}) == sum(len(call) for call in generator.calls)
    assert fill_groups(groups, generator.generator, n=3, seed=6, max_attempts=3) != filled


def test_a_group_whose_pool_ran_out_is_not_asked_again_and_no_empty_text_is_kept():
    borrow = Recorded(BorrowGenerator({"a": ["one text"], "b": ["x", "y", "z"]}))
    groups = [Group("a", "p", None, frozenset()), Group("b", "p", None, frozenset())]
    filled = fill_groups(groups, borrow, n=3, seed=0, max_attempts=4)
    assert [[r.key for r in call] for call in borrow.calls] == [["a", "b"]]  # "a" got fewer than asked: used up
    assert filled["a"].texts == ["one text"] and filled["a"].attempts == 1 and len(filled["b"].texts) == 3

    class EndsAtOnce:
        """A model that ends its first two texts at once (EOS first), as hf and vLLM return them: ""."""

        def sample(self, requests):
            return [[Sample("", 1), Sample(" \n", 1), *(Sample(f"text {i}", 2) for i in range(r.n - 2))]
                    for r in requests]

    empty = fill_groups([Group("c", "p", None, frozenset())], EndsAtOnce(), n=3, seed=0, max_attempts=2)
    assert empty["c"].texts == ["text 0"] and empty["c"].attempts == 2


def test_a_prompts_generated_texts_avoid_the_originals_of_every_ranking_of_it():
    rankings = pa.table({"example_id": ["e0", "e1", "e2"], "prompt_id": ["p", "p", "q"], "prompt": ["hi", "hi", "yo"],
                         "prompt_messages": [None, None, None],
                         "responses": [["A one", "B two"], ["C three", "D four"], ["E", "F"]]})
    groups, keys = groups_of(rankings, "hf")
    assert keys == ["p", "p", "q"]
    assert {g.key: g.avoid for g in groups} == {"p": {"a one", "b two", "c three", "d four"}, "q": {"e", "f"}}
    groups, keys = groups_of(rankings, "borrow")  # borrow: each ranking its own group, its own originals
    assert keys == ["e0", "e1", "e2"] and groups[1].avoid == {"c three", "d four"}


def test_borrow_takes_other_rankings_responses_seeded_and_without_repeats():
    pools = borrow_pools(["a", "b", "c"], ["x", "x", "y"],
                         [["mine a", "shared"], ["mine b", "Shared ", "other b"], ["alone", "too"]])
    assert pools == {"a": ["mine b", "Shared ", "other b"], "b": ["mine a", "shared"], "c": []}
    borrow = BorrowGenerator(pools)
    avoid = frozenset({normalise("mine a"), normalise("shared")})
    [got] = borrow.sample([SampleRequest("a", "p", None, 5, 3, avoid)])
    assert sorted(s.text for s in got) == ["mine b", "other b"] and all(s.tokens == 0 for s in got)
    [two] = borrow.sample([SampleRequest("a", "p", None, 2, 3, avoid)])
    assert [s.text for s in two] == [s.text for s in got]
    assert borrow.sample([SampleRequest("c", "p", None, 2, 0)]) == [[]]


def test_vllm_request_shards_round_trip_and_build_vllm_arguments(tmp_path, tiny_tokenizer):
    reqs = requests(n=2)
    rows = request_rows(tiny_tokenizer, reqs)
    assert rows[0]["prompt_token_ids"] == encode_prompt(tiny_tokenizer, PROMPTS[0])
    vllm_worker.write_requests(tmp_path / "requests.parquet", rows)
    read = vllm_worker.read_requests(tmp_path / "requests.parquet")
    assert read == rows
    settings = {"model": "m", "dtype": "auto", "seed": 0, "gpu_memory_utilization": 0.5,
                "temperature": 2.0, "top_p": 0.9, "max_tokens": 64}
    assert vllm_worker.sampling_kwargs(read[1], settings) == {
        "n": 2, "temperature": 2.0, "top_p": 0.9, "max_tokens": 64, "seed": reqs[1].seed}
    assert vllm_worker.token_prompt(read[1]) == {"prompt_token_ids": rows[1]["prompt_token_ids"]}
    assert vllm_worker.llm_kwargs(settings) == {"model": "m", "dtype": "auto", "seed": 0, "gpu_memory_utilization": 0.5}
    assert vllm_worker.llm_kwargs({**settings, "max_model_len": 4096})["max_model_len"] == 4096
    responses = [{"key": "p0", "texts": ["a", "b"], "token_counts": [3, 1], "finish_reasons": ["stop", "length"]}]
    vllm_worker.write_responses(tmp_path / "responses.parquet", responses)
    assert vllm_worker.read_responses(tmp_path / "responses.parquet") == responses


def test_a_completion_ending_with_eos_at_the_length_cap_is_finished():
    # vLLM releases that checked the length cap before the stop tokens said "length" for an EOS drawn
    # as the last allowed token; the worker reads the tokens instead (EOS 2 here).
    completion = types.SimpleNamespace
    row = vllm_worker.response_row({"key": "p"}, [completion(text="a", token_ids=[7, 2], finish_reason="length"),
                                                  completion(text="b", token_ids=[7, 7], finish_reason="length"),
                                                  completion(text="c", token_ids=[2], finish_reason="stop"),
                                                  completion(text="", token_ids=[2], finish_reason="abort")], [2])
    assert row["finish_reasons"] == ["stop", "length", "stop", "abort"] and row["token_counts"] == [2, 2, 1, 1]


def test_the_worker_is_told_the_models_stop_tokens(tiny_model_dir, tmp_path):
    waiting = tmp_path / "waiting_worker.py"
    waiting.write_text("import sys\nsys.stdin.read()\n")
    generator = _vllm(tiny_model_dir, worker=waiting)
    try:
        settings = json.loads((generator.exchange / "settings.json").read_text())
        assert settings["stop_token_ids"] == [generator._tokenizer.eos_token_id]
    finally:
        generator.close(failed=True)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # written through a renamed temporary
    (tmp_path / "settings.json").write_text('{"model": "m"}')
    with pytest.raises(ValueError, match="lacks settings"):
        vllm_worker.read_settings(tmp_path / "settings.json")


def test_both_model_backends_stop_at_the_tokenizers_eos_and_the_generation_configs(tiny_model_dir, tmp_path):
    """A generation config naming another EOS than the tokenizer's: hf stopped at that one only, vLLM
    at both; the cache closes responses with the tokenizer's (review helper-89)."""
    model = tmp_path / "other-eos"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "generation_config.json").read_text())
    tokenizer_eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    settings["eos_token_id"] = [tokenizer_eos + 1]
    (model / "generation_config.json").write_text(json.dumps(settings))
    hf = HFGenerator(str(model), max_new_tokens=4)
    hf.close()
    waiting = tmp_path / "waiting_worker.py"
    waiting.write_text("import sys\nsys.stdin.read()\n")
    vllm = _vllm(model, worker=waiting)
    try:
        stops = json.loads((vllm.exchange / "settings.json").read_text())["stop_token_ids"]
    finally:
        vllm.close(failed=True)
    assert sorted(hf._eos_ids) == stops == sorted({vllm._tokenizer.eos_token_id, tokenizer_eos + 1})
    assert vllm._tokenizer.eos_token_id == tokenizer_eos
    (model / "generation_config.json").unlink()  # then config.json's EOS, for both (transformers builds hf's)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": tokenizer_eos + 2}))
    hf = HFGenerator(str(model), max_new_tokens=4)
    hf.close()
    assert sorted(hf._eos_ids) == vllm_backend._stop_token_ids(str(model), hf._tokenizer) == [
        tokenizer_eos, tokenizer_eos + 2]


def _vllm(tiny_model_dir: Path | str, python: str = sys.executable, **kwargs) -> VLLMGenerator:
    return VLLMGenerator(str(tiny_model_dir), python=python, max_new_tokens=8, **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_the_real_worker_without_vllm_fails_with_an_actionable_error(tiny_model_dir):
    generator = _vllm(tiny_model_dir)
    with pytest.raises(VLLMWorkerError, match="has no vllm: set vllm_python") as err:
        generator.sample(requests(n=1))
    assert "exited with status 1" in str(err.value) and "ModuleNotFoundError" in str(err.value)
    generator.close(failed=True)
    assert (generator.exchange / "worker.log").is_file()  # kept for reading


def test_a_failing_worker_is_reported_with_its_status_and_log(tmp_path, tiny_model_dir):
    failing = tmp_path / "failing_worker.py"
    failing.write_text("import sys\nprint('CUDA out of memory while loading', file=sys.stderr)\nsys.exit(3)\n")
    silent = tmp_path / "silent_worker.py"
    silent.write_text("import sys, json\nprint(json.dumps({'hello': 1}), flush=True)\nsys.stdin.read()\n")
    for worker, message in ((failing, r"status 3 before it sent 'ready'(.|\n)*CUDA out of memory"),
                            (silent, "unexpected line")):
        generator = _vllm(tiny_model_dir, worker=worker)
        with pytest.raises(VLLMWorkerError, match=message):
            generator.sample(requests(n=1))
        generator.close(failed=True)  # as the augment stage closes it
        assert _released(generator)
    with pytest.raises(VLLMWorkerError, match="could not start the vLLM worker"):
        _vllm(tiny_model_dir, python=str(tmp_path / "no-such-python"))


def test_a_worker_that_sends_nothing_within_the_timeout_is_ended_and_named(tmp_path, tiny_model_dir):
    """An engine stuck in its start-up (or in a call) would hold the GPU and the stage for ever; with
    augment.vllm_timeout_s the wait ends, the worker's group with it, and the error names the setting."""
    stuck = tmp_path / "stuck_worker.py"
    stuck.write_text("import sys, time\nprint('loading', file=sys.stderr, flush=True)\ntime.sleep(600)\n")
    generator = _vllm(tiny_model_dir, worker=stuck, timeout_s=1.5)
    with pytest.raises(VLLMWorkerError, match=r"status -15 after waiting augment.vllm_timeout_s = 1.5 s for it to "
                                              r"send 'ready'(.|\n)*loading"):
        generator.sample(requests(n=1))
    generator.close(failed=True)
    assert generator._process.returncode == -15 and _released(generator)


def test_a_prompt_beyond_the_models_context_is_refused_before_vllm_sees_it(tmp_path, tiny_model_dir):
    # vLLM refuses such a prompt and aborts the whole call: the worker would exit on every resume.
    waiting = tmp_path / "waiting_worker.py"
    waiting.write_text("import sys\nsys.stdin.read()\n")
    generator = _vllm(tiny_model_dir, worker=waiting)
    try:
        long = SampleRequest("long", "Which list is best? " * 2000, None, 1, 0)
        with pytest.raises(ValueError, match=rf"1 prompt\(s\) have at least the {generator.context} positions vLLM "
                                             r"serves the model with \(its context, or augment.vllm_max_model_len "
                                             r"where fewer\) \(e.g. 'long': \d+ tokens\).*augment.max_prompt_tokens"):
            generator.sample([*requests(n=1)[:1], long])
        assert generator._calls == 0 and not generator._ready  # nothing was sent
    finally:
        generator.close(failed=True)


def test_the_vllm_backend_reads_the_context_a_yarn_factor_stretches_it_to(tmp_path, tiny_model_dir):
    model = tmp_path / "yarn"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    positions = config["max_position_embeddings"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": positions,
            "rope_theta": config.get("rope_theta", 10000.0)}
    (model / "config.json").write_text(json.dumps({**config, "rope_parameters": yarn}))
    waiting = tmp_path / "waiting_worker.py"
    waiting.write_text("import sys\nsys.stdin.read()\n")
    generator = _vllm(model, worker=waiting)
    try:
        assert generator.context == 4 * positions  # as hf's and the cache's context_length: vLLM reads it so
    finally:
        generator.close(failed=True)
    served = _vllm(model, worker=waiting, max_model_len=positions + 1)  # augment.vllm_max_model_len: fewer served
    try:
        assert served.context == positions + 1 and served.settings["max_model_len"] == positions + 1
    finally:
        served.close(failed=True)


def test_the_hf_backend_refuses_prompts_that_would_run_past_the_models_context(tiny_model_dir):
    # a model with learned positions (GPT-2's) would fail on them deep in torch, with an index error
    context = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.max_position_embeddings
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=context - 4, batch_size=4)
    with pytest.raises(ValueError, match=rf"\d prompt\(s\) with max_new_tokens = {context - 4} would run past the "
                                         rf"{context} positions the model reads .*e.g. 'p0': \d+ prompt tokens\); set "
                                         r"augment.max_prompt_tokens \(e.g. 4\)"):
        generator.sample(requests(n=1))
    generator.max_new_tokens = context  # no prompt length fits: only a lower max_new_tokens helps
    with pytest.raises(ValueError, match=rf"augment.max_new_tokens = {context} leaves no position for a prompt in the "
                                         rf"{context} positions the model reads \(its context\): lower it"):
        generator.sample(requests(n=1))


# A stand-in for vllm_worker.py that speaks its protocol and, like vLLM, starts a process of its own
# (here `sleep`) that inherits the protocol pipe; it writes that process's pid to engine.pid.
ENGINE_WORKER = """
import json, subprocess, sys
from moplex_core.generate import vllm_worker
engine = subprocess.Popen(["sleep", "600"], stdout=sys.stdout)
open("engine.pid", "w").write(str(engine.pid))
MODE = {mode!r}
if MODE == "dies":
    sys.exit(4)
print(json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if MODE == "hangs":
        engine.wait()
    rows = [{{"key": r["key"], "texts": [f"{{r['key']}}-{{j}}" for j in range(r["n"])], "token_counts": [1] * r["n"],
             "finish_reasons": ["stop"] * r["n"]}} for r in vllm_worker.read_requests(command["requests"])]
    vllm_worker.write_responses(command["responses"], rows)
    print(json.dumps({{"responses": command["responses"]}}), flush=True)
"""


def _engine_worker(tmp_path: Path, tiny_model_dir: Path, mode: str) -> VLLMGenerator:
    worker = tmp_path / f"{mode}_worker.py"
    worker.write_text(ENGINE_WORKER.format(mode=mode))
    return _vllm(tiny_model_dir, worker=worker)


def _engine_pid(generator: VLLMGenerator) -> int:
    return int((generator.exchange / "engine.pid").read_text())


def _released(generator: VLLMGenerator) -> bool:
    """Whether the generator closed its worker's log and both pipes."""
    return generator._log.closed and generator._process.stdin.closed and generator._process.stdout.closed


def _gone(pid: int) -> bool:
    """Whether a process has ended (gone, or a zombie awaiting its new parent), within 5 s."""
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(100):
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_worker_loads_a_cached_hub_model_at_the_commit_its_fingerprint_names(tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "c" * 40, monkeypatch)
    generator = _vllm(HUB_NAME, worker=tmp_path / "no_worker.py")
    settings = json.loads((generator.exchange / "settings.json").read_text())
    generator.close(failed=True)
    generator.close()  # a second close does nothing
    assert vllm_worker.llm_kwargs(settings) == {"model": HUB_NAME, "revision": "c" * 40, "tokenizer_revision": "c" * 40,
                                                "dtype": "auto", "seed": 0, "gpu_memory_utilization": 0.9}


BUSY_WORKER = """
import json, time
print(json.dumps({"ready": True}), flush=True)
time.sleep(600)  # generating: it reads no request and writes no answer for a long while
"""

STARTS_A_WORKER = """
import sys, time
from moplex_core.generate.vllm_backend import VLLMGenerator
generator = VLLMGenerator(sys.argv[1], python=sys.executable, worker=sys.argv[2])
generator._expect("ready")
print(generator._process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_worker_ends_with_the_process_that_started_it_however_that_ends(tmp_path, tiny_model_dir):
    worker = tmp_path / "busy_worker.py"
    worker.write_text(BUSY_WORKER)
    parent = subprocess.Popen([sys.executable, "-c", STARTS_A_WORKER, str(tiny_model_dir), str(worker)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    with parent.stdout:
        worker_pid = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no finally, no close()
    parent.wait()
    assert _gone(worker_pid)  # Prefect's cancellation signals the flow run's group, which the worker is not in


@pytest.mark.timeout(60)
def test_a_worker_that_dies_is_noticed_though_its_engine_holds_the_pipe_and_the_engine_is_ended(
        tmp_path, tiny_model_dir):
    generator = _engine_worker(tmp_path, tiny_model_dir, "dies")
    with pytest.raises(VLLMWorkerError, match="status 4 before it sent 'ready'"):
        generator.sample(requests(n=1))
    assert _gone(_engine_pid(generator))
    generator.close()  # after a reported failure: nothing more to raise, and the log stays
    assert (generator.exchange / "worker.log").is_file()


@pytest.mark.timeout(60)
def test_a_clean_close_ends_the_workers_whole_process_group(tmp_path, tiny_model_dir):
    generator = _engine_worker(tmp_path, tiny_model_dir, "serves")
    samples = generator.sample(requests(n=2))
    assert texts(samples) == [[f"p{i}-0", f"p{i}-1"] for i in range(len(PROMPTS))]
    engine = _engine_pid(generator)
    generator.close()  # the stand-in exits at the end of its input and leaves its engine running
    assert generator._process.returncode == 0 and _gone(engine)
    assert not generator.exchange.exists()


@pytest.mark.timeout(60)
def test_a_close_interrupted_while_it_waits_still_ends_the_group_and_releases_its_files(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    generator = _engine_worker(tmp_path, tiny_model_dir, "serves")
    generator.sample(requests(n=1))
    engine = _engine_pid(generator)

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(generator, "_stop", interrupted)  # Ctrl-C while close() waits for the worker to exit
    with pytest.raises(KeyboardInterrupt):
        generator.close()
    assert generator._process.returncode is not None and _gone(engine)  # the group SIGKILLed, the worker reaped
    assert _released(generator)
    assert not generator.exchange.exists()  # no worker failure was reported: nothing to keep


@pytest.mark.timeout(60)
def test_a_stage_failing_elsewhere_ends_a_busy_worker_at_once_and_removes_its_folder(tmp_path, tiny_model_dir):
    generator = _engine_worker(tmp_path, tiny_model_dir, "hangs")
    generator._expect("ready")
    generator._send({"requests": "none.parquet", "responses": "none-out.parquet"})  # never answered
    engine = _engine_pid(generator)
    generator.close(failed=True)  # a clean close would wait for that answer (600 s)
    assert generator._process.returncode == -signal.SIGTERM and _gone(engine)
    assert not generator.exchange.exists()  # the worker did nothing wrong (an interrupt, a shortfall): no log to keep


# A stand-in worker that answers each request in one of the ways a broken worker could.
ANSWERING_WORKER = """
import json, sys
from moplex_core.generate import vllm_worker
MODE = {mode!r}
print(json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    rows = []
    for r in vllm_worker.read_requests(command["requests"]):
        n = r["n"] + 2 if MODE == "too_many" else r["n"]
        reasons = {{"length": ["length", "stop"], "abort": ["abort", "stop"]}}.get(MODE, ["stop", "stop"])
        rows.append({{"key": r["key"], "texts": [f"{{r['key']}}-{{j}}" for j in range(n)], "token_counts": [8] * n,
                      "finish_reasons": (reasons * n)[:n]}})
    vllm_worker.write_responses(command["responses"], rows)
    answer = {{"int": 123, "string": "responses", "wrong_path": {{"responses": "elsewhere.parquet"}}}}
    print(json.dumps(answer.get(MODE, {{"responses": command["responses"]}})), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_worker_answer_that_is_not_what_was_asked_is_a_worker_error(tmp_path, tiny_model_dir):
    def worker(mode: str) -> VLLMGenerator:
        path = tmp_path / f"{mode}_worker.py"
        path.write_text(ANSWERING_WORKER.format(mode=mode))
        return _vllm(tiny_model_dir, worker=path)

    cut = worker("length")  # max_tokens cut the first sample of each request: not finished
    assert [[(s.text, s.tokens, s.finished) for s in row] for row in cut.sample(requests(n=2))] == [
        [(f"p{i}-0", 8, False), (f"p{i}-1", 8, True)] for i in range(len(PROMPTS))]
    cut.close()
    for mode, error in [("too_many", "2 samples asked for, texts / token counts / finish reasons of lengths "
                                     "\\[4, 4, 4\\]"),
                        ("abort", "finish reasons \\['abort'\\]"),
                        ("int", "unexpected line '123'"), ("string", "unexpected line '\"responses\"'"),
                        ("wrong_path", "unexpected line .*elsewhere.parquet")]:
        generator = worker(mode)
        with pytest.raises(VLLMWorkerError, match=error):
            generator.sample(requests(n=2))
        generator.close()  # after the reported failure: nothing more to raise


# A stand-in `vllm` package for the real worker (moplex_core/generate/vllm_worker.py): LLM and
# SamplingParams as the worker calls them, and, like vLLM at times, an exit hook that hangs.
FAKE_VLLM = """
import atexit, os, time


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, text, token_ids, finish_reason):
        self.text, self.token_ids, self.finish_reason = text, token_ids, finish_reason


class _Output:
    def __init__(self, outputs):
        self.outputs = outputs


class LLM:
    def __init__(self, **kwargs):
        atexit.register(time.sleep, 600)

    def generate(self, prompts, params, use_tqdm=False):
        if os.environ.get("FAKE_VLLM_FAILS"):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return [_Output([_Completion(f"{len(prompt['prompt_token_ids'])}-{p.kwargs['seed']}-{j}", [5] * (j + 1),
                                     "length" if j else "stop") for j in range(p.kwargs["n"])])
                for prompt, p in zip(prompts, params)]
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fails", [False, True])
def test_the_real_worker_exits_at_once_after_its_last_answer_or_an_error(tmp_path, tiny_model_dir, monkeypatch, fails):
    """The worker script itself, over a stand-in vllm whose exit hook would hang for 10 minutes: a
    clean close and a failing generate both end in moments, with the status and log they should."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    if fails:
        monkeypatch.setenv("FAKE_VLLM_FAILS", "1")
    generator = _vllm(tiny_model_dir)
    if fails:
        with pytest.raises(VLLMWorkerError, match=r"exited with status 1 before it sent 'responses'(.|\n)*device-side"):
            generator.sample(requests(n=2))
        assert generator._process.returncode == 1
        generator.close(failed=True)
    else:
        samples = generator.sample(requests(n=2))
        assert [[(s.tokens, s.finished) for s in row] for row in samples] == [[(1, True), (2, False)]] * len(PROMPTS)
        assert len({s.text for row in samples for s in row}) == 2 * len(PROMPTS)  # per request seeds
        generator.close()
        assert generator._process.returncode == 0  # within the timeout: not after the exit hook's 600 s


def _vllm_python() -> str | None:
    python = os.environ.get("MOPLEX_VLLM_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import vllm, pyarrow"], capture_output=True)
    return python if probe.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="vllm is not importable (set MOPLEX_VLLM_PYTHON to a vLLM "
                                                   "environment's python to run this)")
def test_the_real_vllm_worker_samples_reproducibly(tiny_model_dir):
    python = _vllm_python()
    generator = _vllm(tiny_model_dir, python=python, gpu_memory_utilization=0.3)
    try:
        first = generator.sample(requests(n=3))
        again = generator.sample(requests(n=3))
    finally:
        generator.close()
    assert [len(row) for row in first] == [3] * len(PROMPTS)
    assert all(0 < s.tokens <= 8 for row in first for s in row)
    assert first == again
    assert np.mean([len({s.text for s in row}) for row in first]) > 1
