"""The augment stage end to end: core, shortfalls, borrow, resume after SIGKILL, CLI, Prefect flow."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from chaos.kills import finished_work
from lm_fixtures import tiny_model_dir  # noqa: F401 - fixture
from moplex_core.artifacts import ArtifactStore, load_table, read_manifest, shard_paths
from moplex_core.augment import AUGMENTED_SCHEMA, SHORTFALL_FILE, STAGE, ShortfallError, plan_augment, run_augment
from moplex_core.cache import run_cache
from moplex_core.cli import main
from moplex_core.config import AugmentConfig, CacheConfig, IngestConfig
from moplex_core.generate.base import normalise
from moplex_core.generate.vllm_backend import VLLMWorkerError
from moplex_core.hashing import model_fingerprint
from moplex_core.ingest import run_ingest
from moplex_core.inspect import inspect_path
from moplex_core.lm.loading import load_tokenizer
from moplex_core.lm.tokenize import encode_prompt
from moplex_core.schema import RANKINGS_SCHEMA

ROWS = [  # two rankings share each of the first two prompts (as PERSONA's profiles share an instruction)
    ("Rank by criterion 0: which list is best?", ["3 1", "4 4 2"], "a"),
    ("Rank by criterion 0: which list is best?", ["3 1", "7 0"], "b"),
    ("Rank by criterion 1: which list is best?", ["5", "6 6"], "a"),
    ("Rank by criterion 1: which list is best?", ["2 2", "6 6"], "b"),
    ("Rank by criterion 2: which list is best?", ["1 2 3", "9"], "b"),
    ("Which list is best of all?", ["0", "1 1"], "a"),
]


def rankings_dir(tmp_path: Path, root: Path, rows=ROWS) -> Path:
    source = tmp_path / "rankings.jsonl"
    source.write_text("".join(
        json.dumps({"prompt": p, "responses": r, "ranking": [[0], [1]], "cluster": c}) + "\n" for p, r, c in rows
    ))
    config = IngestConfig(dataset="generic", path=str(source), split={"fractions": (1.0, 0.0, 0.0)})
    return run_ingest(config, ArtifactStore(root)).path


def hf_config(model: Path, **overrides) -> AugmentConfig:
    settings = {"model": str(model), "max_new_tokens": 16, "shard_prompts": 2, "batch_size": 8}
    return AugmentConfig(**{**settings, **overrides})


def test_a_generation_cut_at_max_new_tokens_is_recorded_and_cached_without_eos(tmp_path, tiny_model_dir):
    store = ArtifactStore(tmp_path / "artifacts")
    result = run_augment(hf_config(tiny_model_dir, max_new_tokens=8), rankings_dir(tmp_path, store.root), store,
                         progress=False)
    rows = load_table(store.path(STAGE, result.ref.version)).to_pylist()
    ended = [flag for row in rows for flag in row["generated_finished"]]
    assert all(len(row["generated_finished"]) == len(row["generated"]) for row in rows)
    assert any(ended) and not all(ended)  # at 8 tokens some texts end and some are cut: both kinds are checked
    assert "cut at max_new_tokens:" in inspect_path(result.path)
    cache = run_cache(CacheConfig(model=str(tiny_model_dir)), result.path, store, progress=False)
    eos = load_tokenizer(tiny_model_dir).eos_token_id
    by_id = {row["example_id"]: row for row in load_table(store.path("cache", cache.ref.version)).to_pylist()}
    for row in rows:
        cached = by_id[row["example_id"]]["input_ids"]
        assert all(ids[-1] == eos for ids in cached[:len(row["responses"])])  # originals end
        assert [ids[-1] == eos for ids in cached[len(row["responses"]):]] == row["generated_finished"]


def test_a_prompt_no_shard_could_render_stops_the_stage_before_any_model_loads(tmp_path, tiny_model_dir):
    """Chat messages without a chat template: refused before the first shard (each shard one prompt),
    naming the prompt, where it used to fail when its shard came up, after the shards before it."""
    store = ArtifactStore(tmp_path / "artifacts")
    source = tmp_path / "rankings.jsonl"
    turns = json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Which list is best?"}])
    source.write_text("".join(json.dumps({"prompt": p, "responses": r, "ranking": [[0], [1]], "cluster": c,
                                          **({"prompt_messages": turns} if i == 4 else {})}) + "\n"
                              for i, (p, r, c) in enumerate(ROWS)))
    rankings = run_ingest(IngestConfig(dataset="generic", path=str(source), split={"fractions": (1.0, 0.0, 0.0)}),
                          store).path
    config = hf_config(tiny_model_dir, shard_prompts=1, use_chat_template=False)
    with pytest.raises(ValueError, match=r"1 prompt\(s\) cannot be rendered for generation \([0-9a-f]+\).*"
                                         "needs use_chat_template = true"):
        run_augment(config, rankings, store, progress=False)
    assert not list(shard_paths(plan_augment(config, rankings, store).path))  # nothing generated, nothing wasted
    assert run_augment(hf_config(tiny_model_dir, shard_prompts=1), rankings, store, progress=False).built


@pytest.mark.parametrize("backend, served, refusal", [
    ("hf", None, r"1 prompt\(s\) with max_new_tokens = 16 would run past the \d+ positions the model reads .*e.g. "
                 r"'[0-9a-f]+'"),
    ("vllm", None, r"1 prompt\(s\) have at least the \d+ positions vLLM serves the model with .*\(e.g. '[0-9a-f]+'"),
    ("vllm", 8, r"4 prompt\(s\) have at least the 8 positions vLLM serves the model with")])  # vllm_max_model_len
def test_a_prompt_beyond_the_models_context_stops_the_stage_before_any_shard(tmp_path, tiny_model_dir, backend,
                                                                              served, refusal):
    """As a prompt no shard could render: the last shard's prompt too long for the model's context, with
    no augment.max_prompt_tokens to cut it, used to stop the stage when its shard came up, after the
    shards before it, which the fix (max_prompt_tokens, a new version) does not reuse."""
    store = ArtifactStore(tmp_path / "artifacts")
    source = tmp_path / "rankings.jsonl"
    long = "Which list is best? " * 2000 if served is None else ROWS[5][0]  # past the tiny model's positions
    source.write_text("".join(json.dumps({"prompt": long if i == 5 else p, "responses": r, "ranking": [[0], [1]],
                                          "cluster": c}) + "\n" for i, (p, r, c) in enumerate(ROWS)))
    rankings = run_ingest(IngestConfig(dataset="generic", path=str(source), split={"fractions": (1.0, 0.0, 0.0)}),
                          store).path
    config = hf_config(tiny_model_dir, shard_prompts=1, max_prompt_tokens=None, backend=backend,
                       vllm_python=sys.executable, vllm_max_model_len=served)
    with pytest.raises(ValueError, match=refusal):
        run_augment(config, rankings, store, progress=False)
    assert not list(shard_paths(plan_augment(config, rankings, store).path))  # nothing generated, nothing wasted


def test_prompts_longer_than_max_prompt_tokens_are_warned_of_and_counted(tmp_path, tiny_model_dir, caplog):
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = rankings_dir(tmp_path, store.root)
    tokenizer = load_tokenizer(tiny_model_dir)
    lengths = {p: len(encode_prompt(tokenizer, p)) for p, _, _ in ROWS}  # 4 distinct prompts
    limit = sorted(set(lengths.values()))[0]  # the shortest stay whole, the others are cut
    longer = sum(n > limit for n in lengths.values())
    assert 0 < longer < len(lengths)
    with caplog.at_level(logging.WARNING, logger="moplex_core.augment"):
        result = run_augment(hf_config(tiny_model_dir, max_prompt_tokens=limit), rankings, store, progress=False)
    assert f"{longer} prompt(s) are longer than augment.max_prompt_tokens = {limit} tokens" in caplog.text
    assert read_manifest(result.path)["summary"]["prompts_cut_this_run"] == longer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moplex_core.augment"):
        whole = run_augment(hf_config(tiny_model_dir), rankings, store, progress=False)
    assert "max_prompt_tokens" not in caplog.text and read_manifest(whole.path)["summary"]["prompts_cut_this_run"] == 0


def test_generated_once_per_prompt_shared_by_its_rankings_and_never_an_original(tmp_path, tiny_model_dir):
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = rankings_dir(tmp_path, store.root)
    result = run_augment(hf_config(tiny_model_dir), rankings, store, progress=False)
    assert result.built and result.rows == len(ROWS) and result.shortfall.num_rows == 0
    assert [p.name for p in shard_paths(result.path)] == ["part-00000.parquet", "part-00001.parquet"]  # 4 prompts
    table = load_table(store.path(STAGE, result.ref.version))
    assert table.schema == AUGMENTED_SCHEMA
    assert table.select(RANKINGS_SCHEMA.names).to_pylist() == load_table(store.path("ingest", rankings.name)).to_pylist()
    rows = table.to_pylist()
    by_prompt: dict[str, list[str]] = {}
    for row in rows:
        assert len(row["generated"]) == 3 and by_prompt.setdefault(row["prompt_id"], row["generated"]) == row["generated"]
        assert row["generation"] == {"backend": "hf", "model": model_fingerprint(str(tiny_model_dir)), "temperature": 2.0,
                                     "top_p": 1.0, "max_new_tokens": 16, "seed": 0, "attempts": 1}
    for pid, generated in by_prompt.items():
        originals = {normalise(t) for row in rows if row["prompt_id"] == pid for t in row["responses"]}
        keys = [normalise(t) for t in generated]
        assert len(set(keys)) == 3 and not set(keys) & originals
    manifest = store.manifest(STAGE, result.ref.version)
    assert manifest["inputs"]["rankings"] == f"ingest/{rankings.name}" and manifest["inputs"]["model"].startswith("sha256:")
    assert manifest["summary"]["generated_per_ranking"] == {"3": 6} and manifest["summary"]["shortfall_rankings"] == 0
    assert pq.read_table(result.path / SHORTFALL_FILE).num_rows == 0

    again = run_augment(hf_config(tiny_model_dir, batch_size=1, device="cpu"), rankings, store, progress=False)
    assert not again.built and again.ref == result.ref  # batch size and device are not part of the version

    # a run killed after its first shard and resumed with the model moved elsewhere writes what one run wrote
    moved = tmp_path / "moved-model"
    shutil.copytree(tiny_model_dir, moved)
    (result.path / "manifest.json").unlink()
    (result.path / "part-00001.parquet").unlink()
    resumed = run_augment(hf_config(moved), rankings, store, progress=False)
    assert resumed.built and resumed.ref == result.ref
    assert load_table(store.path(STAGE, result.ref.version)).equals(table)
    assert run_augment(hf_config(tiny_model_dir, seed=1), rankings, store, progress=False).ref != result.ref


def test_shortfall_fails_or_keeps_fewer_and_is_never_silent(tmp_path, tiny_model_dir, caplog):
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = rankings_dir(tmp_path, store.root)
    greedy = hf_config(tiny_model_dir, top_p=1e-6, max_attempts=2)  # every sample is the same text
    with pytest.raises(ShortfallError, match=r"2 prompt\(s\) \(4 ranking\(s\)\) got fewer") as err:
        run_augment(greedy, rankings, store, progress=False)
    [info] = store.list(STAGE)
    version_dir = info.path
    assert not (version_dir / "manifest.json").exists() and (version_dir / SHORTFALL_FILE).is_file()
    assert [p.name for p in shard_paths(version_dir)] == ["part-00000.parquet"]  # stopped after the first shard
    assert set(err.value.shortfall.column("got").to_pylist()) <= {0, 1}
    assert "on_shortfall=keep_fewer" in str(err.value) and "Raise max_attempts or temperature" in str(err.value)

    kept = greedy.model_copy(update={"on_shortfall": "keep_fewer"})
    with caplog.at_level(logging.WARNING, logger="moplex_core.augment"):
        result = run_augment(kept, rankings, store, progress=False)
    assert result.path == version_dir and "kept with fewer" in caplog.text
    shortfall = pq.read_table(version_dir / SHORTFALL_FILE).to_pylist()
    assert sum(row["rankings"] for row in shortfall) == len(ROWS)
    assert all(row["wanted"] == 3 and row["got"] <= 1 and row["attempts"] == 2 for row in shortfall)
    assert store.manifest(STAGE, result.ref.version)["resumed"]
    with pytest.raises(ShortfallError):  # a complete version with a shortfall still fails in fail mode
        run_augment(greedy, rankings, store, progress=False)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_a_failing_vllm_worker_reaches_the_user_with_its_own_error(tmp_path, tiny_model_dir, monkeypatch):
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = rankings_dir(tmp_path, store.root)
    monkeypatch.chdir(Path(sys.executable).parents[2])  # a relative interpreter path, as a user types it
    python = os.path.relpath(sys.executable)
    config = AugmentConfig(model=str(tiny_model_dir), backend="vllm", vllm_python=python, max_new_tokens=4)
    with pytest.raises(VLLMWorkerError, match="has no vllm: set vllm_python"):  # not the shutdown's own error
        run_augment(config, rankings, store, progress=False)
    assert not store.is_complete(STAGE, plan_augment(config, rankings, store).ref.version)


def test_borrow_fills_each_ranking_from_the_other_rankings_of_its_prompt(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = rankings_dir(tmp_path, store.root)
    config = AugmentConfig(backend="borrow", n_generated=1, on_shortfall="keep_fewer")
    result = run_augment(config, rankings, store, progress=False)
    rows = {tuple(r["responses"]): r for r in load_table(store.path(STAGE, result.ref.version)).to_pylist()}
    assert rows[("3 1", "4 4 2")]["generated"] == ["7 0"] and rows[("3 1", "7 0")]["generated"] == ["4 4 2"]
    assert rows[("5", "6 6")]["generated"] == ["2 2"] and rows[("2 2", "6 6")]["generated"] == ["5"]
    assert rows[("0", "1 1")]["generated"] == [] and rows[("0", "1 1")]["generation"]["temperature"] is None
    assert sorted(result.shortfall.column("got").to_pylist()) == [0, 0]  # the two prompts with one ranking


def test_cli_augment_goes_beside_its_input_and_takes_rankings_only(tmp_path, monkeypatch, capsys):
    root = tmp_path / "artifacts"
    rankings = rankings_dir(tmp_path, root)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no --root: the input's own root, not ./data/artifacts
    argv = ["--backend", "borrow", "--set", "on_shortfall=keep_fewer", "--quiet"]
    assert main(["augment", "--rankings", f"{root}/ingest/{rankings.name[:4]}", *argv]) == 0
    [augmented] = [p for p in (root / STAGE).iterdir() if p.is_dir()]
    assert not (tmp_path / "elsewhere" / "data").exists() and str(augmented) in capsys.readouterr().out
    assert main(["augment", "--rankings", str(augmented), *argv]) == 1
    assert "was written by the 'augment' stage; give ingest/<version>" in capsys.readouterr().err
    assert main(["augment", "--rankings", str(root), *argv]) == 1
    assert f"{root} is an artifact root, not a version folder" in capsys.readouterr().err


def _augment_argv(rankings: Path, root: Path, model: Path) -> list[str]:
    return ["augment", "--rankings", str(rankings), "--model", str(model), "--root", str(root), "--quiet",
            "--set", "shard_prompts=1", "--set", "max_new_tokens=48", "--set", "batch_size=4"]


def test_a_run_killed_mid_way_resumes_from_its_finished_shards(tmp_path, tiny_model_dir):
    # 16 one-prompt shards: the kill, at the second, leaves 14 shards' time for this process to be scheduled
    rows = [(f"Rank by criterion {i}: which list is best?", ["1 2", "3"], "a") for i in range(16)]
    killed_root, clean_root = tmp_path / "killed", tmp_path / "clean"
    rankings = rankings_dir(tmp_path, killed_root, rows)
    process = subprocess.Popen(
        [sys.executable, "-m", "moplex_core.cli", *_augment_argv(rankings, killed_root, tiny_model_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(killed_root.glob(f"{STAGE}/*/part-00001.parquet")):
        assert process.poll() is None and time.monotonic() < deadline, "the augment run ended before it was killed"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    [version_dir] = [p for p in (killed_root / STAGE).iterdir() if p.is_dir()]
    assert not (version_dir / "manifest.json").exists()
    finished = finished_work(version_dir, STAGE)  # (inode, mtime) of each finished shard
    assert 2 <= len(finished) < 16

    assert main(_augment_argv(rankings, killed_root, tiny_model_dir)) == 0
    assert {name: stamp for name, stamp in finished_work(version_dir, STAGE).items() if name in finished} == finished
    assert json.loads((version_dir / "manifest.json").read_text())["resumed"]

    clean_rankings = rankings_dir(tmp_path, clean_root, rows)
    assert main(_augment_argv(clean_rankings, clean_root, tiny_model_dir)) == 0
    clean_dir = clean_root / STAGE / version_dir.name  # same rankings version and config: same version
    names = sorted(p.name for p in shard_paths(clean_dir))
    assert names == sorted(p.name for p in shard_paths(version_dir)) and len(names) == 16
    for name in names:
        assert (clean_dir / name).read_bytes() == (version_dir / name).read_bytes(), name


def test_cli_augment_and_inspect(tmp_path, tiny_model_dir, capsys):
    root = tmp_path / "artifacts"
    rankings = rankings_dir(tmp_path, root)
    argv = ["augment", "--rankings", f"ingest/{rankings.name[:6]}", "--model", str(tiny_model_dir), "--root", str(root),
            "--quiet", "--set", "max_new_tokens=8", "--set", "n_generated=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("augment/") and "wrote 6 augmented rankings" in out
    assert main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    [version_dir] = [p for p in (root / STAGE).iterdir() if p.is_dir()]
    assert main(["inspect", str(version_dir), "--rows", "1"]) == 0
    report = capsys.readouterr().out
    assert "-- augmented --" in report and "generated per ranking:     2: 6" in report and "shortfall.parquet" in report
    assert main(["augment", "--rankings", str(rankings), "--root", str(root), "--backend", "vllm",
                 "--model", str(tiny_model_dir)]) == 1
    assert "set vllm_python" in capsys.readouterr().err
    # vLLM refuses a temperature above 2, but only once its model has loaded: refused here first
    assert main(["augment", "--rankings", str(rankings), "--root", str(root), "--backend", "vllm",
                 "--model", str(tiny_model_dir), "--set", "vllm_python=/opt/vllm/bin/python", "--set", "temperature=4"]) == 1
    assert "vLLM's SamplingParams refuse a temperature above 2" in capsys.readouterr().err
    assert main(["augment", "--rankings", str(rankings), "--root", str(root)]) == 1  # hf needs a model
    err = capsys.readouterr().err
    assert err.startswith("moplex augment: invalid AugmentConfig settings:\n  backend 'hf' samples from a model")
    assert "pydantic" not in err


@pytest.mark.slow  # starts Prefect's ephemeral server: ~25 s on 2 cores
def test_augment_flow_on_the_local_prefect_server(prefect_env, tmp_path, caplog):
    from flows.augment import augment_flow

    root = tmp_path / "artifacts"
    rankings = rankings_dir(tmp_path, root)
    config = AugmentConfig(backend="borrow", n_generated=1, on_shortfall="keep_fewer")
    loggers = [logging.getLogger("prefect"), logging.getLogger("moplex_core")]  # as in test_ingest_flow
    for logger in loggers:
        logger.addHandler(caplog.handler)
    try:
        first = augment_flow(config, str(rankings), root=str(root))
        assert "wrote 6 augmented rankings" in caplog.text and "kept with fewer" in caplog.text
        caplog.clear()
        second = augment_flow(config, str(rankings), root=str(root))
        assert "already complete" in caplog.text
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    assert second == first
    with pytest.raises(ShortfallError, match="use a generating backend") as err:  # borrow: no temperature advice
        augment_flow(config.model_copy(update={"on_shortfall": "fail"}), str(rankings), root=str(root))
    assert "temperature" not in str(err.value)
