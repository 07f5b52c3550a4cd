"""The cache stage: pi_ref terms of every response, from rankings or augmented artifacts, by shard."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lm_fixtures import (HUB_NAME, as_cached_hub_model, layer_runs, prompt_pass_counts,  # noqa: F401  (fixtures)
                         tiny_model_dir)
from stage_fixtures import write_synthetic

from moplex_core.artifacts import ArtifactCorruptError, ArtifactStore, load_table, read_manifest
from moplex_core.augment import plan_augment
from moplex_core.cache import cache_model, load_policy_inputs, plan_cache, policy_inputs, run_cache
from moplex_core.config import (AugmentConfig, CacheConfig, IngestConfig, TrainConfig, pipeline_preset,
                                with_overrides)
from moplex_core.estimate import reference_terms_batch
from moplex_core.ingest import run_ingest
from moplex_core.inspect import inspect_path
from moplex_core.lm.loading import identity_on_this_machine, load_model, load_tokenizer
from moplex_core.lm.tokenize import tokenize_responses
from moplex_core.pipeline import say_unread_contractions
from moplex_core.pl import UNRANKED
from moplex_core.train import load_trained, make_scorer, run_train


def test_augmented_input_caches_originals_then_generated_with_reference_terms(tiny_model_dir, tmp_path):  # noqa: F811
    store = ArtifactStore(tmp_path)
    augmented = write_synthetic(store, n=5, m=3, n_generated=2)
    config = CacheConfig(model=str(tiny_model_dir), score_batch_size=3)  # 5 responses per example: passes of 3 + 2
    result = run_cache(config, augmented, store, progress=False)
    cached = load_table(result.path).to_pylist()
    source = load_table(augmented).to_pylist()
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for row, src in zip(cached, source, strict=True):
        seqs = tokenize_responses(tokenizer, src["prompt"], src["responses"] + src["generated"])
        assert row["input_ids"] == [s.input_ids for s in seqs] and row["n_original"] == 3
        (ref_logp, s_ref), = reference_terms_batch(model, [seqs], tokenizer.pad_token_id)
        torch.testing.assert_close(torch.tensor(row["ref_logp"], dtype=torch.float64), ref_logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(row["ref_contraction"]).reshape(5, 5), s_ref, atol=1e-4, rtol=1e-4)
    inputs, clusters = load_policy_inputs(result.path, split=None)
    assert inputs.tiers.shape == (5, 5) and (inputs.tiers[:, 3:] == UNRANKED).all()
    assert clusters == [r["cluster"] for r in source]


def test_rankings_input_caches_the_originals_only(tiny_model_dir, tmp_path):  # noqa: F811
    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=4, m=3)
    result = run_cache(CacheConfig(model=str(tiny_model_dir)), rankings, store, progress=False)
    assert {len(r) for r in load_table(result.path).column("ref_logp").to_pylist()} == {3}
    assert run_cache(CacheConfig(model=str(tiny_model_dir)), rankings, store, progress=False).built is False


def test_moplex_cache_writes_the_stages_artifact_from_the_command_line(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    from moplex_core.cli import main

    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=4, m=3)
    argv = ["cache", "--rankings", f"ingest/{rankings.name}", "--model", str(tiny_model_dir), "--root", str(tmp_path),
            "--set", "contractions=false", "--quiet"]
    assert main(argv) == 0
    expected = run_cache(CacheConfig(model=str(tiny_model_dir), contractions=False), rankings, store, progress=False)
    assert expected.built is False  # the command wrote this very version
    assert f"{expected.ref}: wrote 4 cached examples" in capsys.readouterr().out
    assert main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    assert main([*argv[:-3], "--set", "score_batch_size=0"]) == 1
    assert "score_batch_size" in capsys.readouterr().err
    assert main(["cache", "--rankings", str(expected.path), "--model", str(tiny_model_dir), "--quiet"]) == 1
    assert "was written by the 'cache' stage; give ingest/<version> or augment/<version>" in capsys.readouterr().err
    assert main(["cache", "--rankings", str(rankings), "--model", "tiny", "--root", str(tmp_path)]) == 1
    assert "ROOT/model/VERSION/model" in capsys.readouterr().err
    assert main(["augment", "--rankings", str(rankings), "--set", "model=tiny", "--root", str(tmp_path)]) == 1
    assert "moplex augment: model 'tiny' is the pipeline's own model" in capsys.readouterr().err
    for plan, config in ((plan_cache, CacheConfig(model="tiny")), (plan_augment, AugmentConfig(model="tiny"))):
        with pytest.raises(ValueError, match="the pipeline's own model, which `moplex run` builds"):  # a stage flow's
            plan(config, rankings, ArtifactStore(tmp_path))  # first call: a stage deployment says so too


def test_a_cache_without_contractions_runs_forwards_only_with_the_same_log_probs(tiny_model_dir, tmp_path):  # noqa: F811
    store = ArtifactStore(tmp_path)
    augmented = write_synthetic(store, n=4, m=3, n_generated=2)
    config = CacheConfig(model=str(tiny_model_dir), score_batch_size=4)  # examples straddle passes
    forwards = config.model_copy(update={"contractions": False})
    assert forwards.identity() != config.identity() == CacheConfig(model=str(tiny_model_dir)).identity()
    assert "contractions" not in config.identity()  # the default keeps the versions built before the option
    full, lean = (run_cache(c, augmented, store, progress=False) for c in (config, forwards))
    assert lean.path != full.path
    lean_rows, full_rows = load_table(lean.path), load_table(full.path)
    assert lean_rows.column("ref_contraction").null_count == lean_rows.num_rows
    assert lean_rows.drop(["ref_contraction"]).equals(full_rows.drop(["ref_contraction"]))
    inputs, _ = load_policy_inputs(lean.path, split=None)
    assert inputs.ref_contraction is None and inputs.subset([1, 2]).ref_contraction is None
    with pytest.raises(ValueError, match="these inputs have none"):
        make_scorer(TrainConfig(k=2, anchors=2), str(tiny_model_dir)).score(inputs)
    with pytest.raises(ValueError, match="1 of 2 cache rows have no ref_contraction"):
        policy_inputs(pa.concat_tables([lean_rows.slice(0, 1), full_rows.slice(1, 1)]))


def test_a_pipeline_with_exact_training_says_how_to_leave_the_contractions_out(tiny_model_dir, tmp_path,  # noqa: F811
                                                                             caplog):
    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=6, m=3)
    cache = CacheConfig(model=str(tiny_model_dir))
    exact = pipeline_preset("synthetic-demo")  # train.anchors = null
    said = "so this run reads none of the reference contractions the cache computes"

    def says(config, cache_config) -> bool:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="moplex_core.pipeline"):
            say_unread_contractions(config, cache_config, str(rankings))
        return said in caplog.text

    assert says(exact, cache)
    assert not says(exact, cache.model_copy(update={"contractions": False}))  # left out already
    assert not says(with_overrides(exact, ["train.anchors=2"]), cache)  # read by the anchors
    built = run_cache(cache, rankings, store, progress=False).path
    assert not says(exact, cache)  # built: too late to matter
    (built / "part-00000.parquet").unlink()  # deleted by hand: the hint, before the stage, neither says nor raises
    assert not says(exact, cache)
    with pytest.raises(ArtifactCorruptError, match="part-00000.parquet missing"):  # the stage refuses it by name
        run_cache(cache, rankings, store, progress=False)


def test_train_refuses_a_base_model_changed_since_the_cache_was_built(tiny_model_dir, tmp_path):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    store = ArtifactStore(tmp_path / "artifacts")
    cache = run_cache(CacheConfig(model=str(model)), write_synthetic(store, n=6, m=3), store, progress=False).path
    cache_model(cache)
    files = read_manifest(cache)["summary"]["model_files"]  # name -> sha256, shown by name
    assert files["config.json"] == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    assert f"model_files: {len(files)} entries: {', '.join(sorted(files))} (values in manifest.json)" in inspect_path(cache)
    with open(model / "config.json", "a") as f:
        f.write("\n")  # retrained or replaced at the same path: other files
    (model / "README.md").write_text("# notes\n")  # any file counts; the refusal names the files
    with pytest.raises(ValueError, match=f"the base model at {model} is not the one the cache at .*"
                                         r"\(README.md added; config.json changed\)"):
        cache_model(cache)
    with pytest.raises(ValueError, match="restore that model"):
        run_train(TrainConfig(k=2, anchors=None), cache, store, progress=False)
    assert not (store.root / "train").exists()
    model.rename(tmp_path / "moved")  # the folder is gone, not a hub name
    with pytest.raises(ValueError, match=f"the folder {model}, is not there now: put it back, or say where it is"):
        cache_model(cache)
    (tmp_path / "moved" / "config.json").unlink()
    with pytest.raises(ValueError, match=r"is not the one the cache at .*\(README.md added; config.json removed\)"):
        cache_model(cache, str(tmp_path / "moved"))  # where it is now, still changed


def test_a_moved_model_or_artifact_root_is_found_by_its_files(tiny_model_dir, tmp_path):  # noqa: F811
    root = tmp_path / "root"
    model = root / "model" / "abc123" / "model"  # the tiny model stage's folder in the root
    shutil.copytree(tiny_model_dir, model)
    cache = run_cache(CacheConfig(model=str(model)), write_synthetic(ArtifactStore(root), n=6, m=3),
                      ArtifactStore(root), progress=False).path
    assert cache_model(cache) == str(model)
    root.rename(tmp_path / "moved")  # the whole root: its own tiny model is found
    moved = tmp_path / "moved" / "cache" / cache.name
    assert cache_model(moved) == str(tmp_path / "moved" / "model" / "abc123" / "model")
    result = run_train(TrainConfig(k=2, anchors=None, em_iterations=1, epochs=1), moved,
                       ArtifactStore(tmp_path / "moved"), progress=False)
    assert read_manifest(result.path)["config"]["model"] == str(tmp_path / "moved" / "model" / "abc123" / "model")
    (tmp_path / "moved").rename(tmp_path / "again")  # the train artifact too: by default on its cache's model
    scorer, _, _ = load_trained(tmp_path / "again" / "train" / result.path.name)  # where the root holds it now
    assert scorer.exact_scores(load_policy_inputs(tmp_path / "again" / "cache" / cache.name, "train")[0]).shape[1] == 2
    (tmp_path / "again").rename(tmp_path / "moved")

    elsewhere = tmp_path / "models" / "mine"  # a model kept outside the root, moved: say where it is
    (tmp_path / "moved" / "model").rename(tmp_path / "models")
    (tmp_path / "models" / "abc123" / "model").rename(elsewhere)
    with pytest.raises(ValueError, match="is not there now"):
        cache_model(moved)
    assert cache_model(moved, str(elsewhere)) == str(elsewhere)
    scorer, _, _ = load_trained(result.path, str(elsewhere))
    assert scorer.exact_scores(load_policy_inputs(moved, "train")[0]).shape[1] == 2


def test_a_hub_models_cache_records_its_commit_and_refuses_another(tiny_model_dir, tmp_path, monkeypatch,  # noqa: F811
                                                                    caplog):
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "a" * 40, monkeypatch)
    store = ArtifactStore(tmp_path / "artifacts")
    cache = run_cache(CacheConfig(model=HUB_NAME), write_synthetic(store, n=6, m=3), store, progress=False).path
    assert store.manifest("cache", cache.name)["inputs"]["model"] == f"hub:{HUB_NAME}@{'a' * 40}"
    cache_model(cache)
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "b" * 40, monkeypatch)  # the hub's main moved on
    with pytest.raises(ValueError, match=f"its identity is hub:{HUB_NAME}@b+ now, not hub:{HUB_NAME}@a+"):
        cache_model(cache)

    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["inputs"]["model"] = f"hub:{HUB_NAME}"  # what a cache planned before the model was downloaded records
    (cache / "manifest.json").write_text(json.dumps(manifest))
    cache_model(cache)
    assert f"which commit it was built with is not recorded and cannot be checked against the one cached now " \
           f"({'b' * 40})" in caplog.text


def test_a_model_that_ends_its_turns_with_another_token_than_the_tokenizers_eos_is_warned_about(
        tiny_model_dir, tmp_path, caplog):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "generation_config.json").read_text())
    settings["eos_token_id"] = [7]  # as a model whose generation stops at another end-of-turn token
    (model / "generation_config.json").write_text(json.dumps(settings))
    store = ArtifactStore(tmp_path / "artifacts")
    with caplog.at_level(logging.WARNING, logger="moplex_core.cache"):
        run_cache(CacheConfig(model=str(model)), write_synthetic(store, n=4, m=3), store, progress=False)
    assert "the cache closes every response with the tokenizer's eos_token '<|im_end|>'" in caplog.text
    assert "stops generating at token id(s) [7]" in caplog.text
    caplog.clear()
    other = ArtifactStore(tmp_path / "other")
    with caplog.at_level(logging.WARNING, logger="moplex_core.cache"):
        run_cache(CacheConfig(model=str(tiny_model_dir)), write_synthetic(other, n=4, m=3), other, progress=False)
    assert "closes every response" not in caplog.text


def test_a_killed_cache_resumes_by_shard(tiny_model_dir, tmp_path):  # noqa: F811
    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=6, m=3)
    config = CacheConfig(model=str(tiny_model_dir), shard_rows=2)
    first = run_cache(config, rankings, store, progress=False)
    whole = load_table(first.path)
    # What a kill during shard 1 leaves: shards 0 and 2 finished, no shard 1, no manifest.
    (first.path / "manifest.json").unlink()
    (first.path / "part-00001.parquet").unlink()
    kept = {name: os.stat(first.path / name).st_mtime_ns for name in ("part-00000.parquet", "part-00002.parquet")}
    again = run_cache(config, rankings, store, progress=False)
    assert again.built and again.path == first.path
    assert {name: os.stat(first.path / name).st_mtime_ns for name in kept} == kept
    assert load_table(again.path).equals(whole)
    assert pq.read_metadata(again.path / "part-00001.parquet").num_rows == 2


def test_auto_dtype_versions_as_the_dtype_it_means_on_this_machine(tiny_model_dir, tmp_path):  # noqa: F811
    # on the CPU "auto" is float32, the same artifact as an explicit float32 and another one than
    # bfloat16 (whose numbers differ), so no version mixes shards of both
    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=3, m=2, n_generated=0)
    version = {dtype: plan_cache(CacheConfig(model=str(tiny_model_dir), dtype=dtype, device="cpu"), rankings,
                                 store).ref.version
               for dtype in ("auto", "float32", "bfloat16")}
    assert version["auto"] == version["float32"] != version["bfloat16"]
    assert identity_on_this_machine({"dtype": "auto"}, "cpu") == {"dtype": "float32"}
    assert identity_on_this_machine({"dtype": "float64", "k": 3}, "cuda") == {"dtype": "float64", "k": 3}


def test_auto_shares_prompts_on_the_cpu_and_in_passes_with_contractions_on_a_gpu():
    # on the H200 the contractions' passes ran faster and in less memory with the prompt shared, the
    # forward-only ones as fast and in less memory with the prompt per row (docs/gpu-efficiency.md)
    for device in ("cpu", "cuda:0", "cuda:1", "mps"):
        for contractions in (True, False):
            auto = CacheConfig(model="a/model", contractions=contractions)
            assert auto.shares_prompts(device) is (device == "cpu" or contractions), (device, contractions)
            for setting in (True, False):
                assert auto.model_copy(update={"share_prompts": setting}).shares_prompts(device) is setting


def test_shared_prompts_say_how_the_passes_run_not_what_the_cache_holds(tiny_model_dir, tmp_path,  # noqa: F811
                                                                          prompt_pass_counts, caplog):  # noqa: F811
    # auto shares each example's prompt on the CPU; the prompt per response is the same version (pi_ref
    # has no dropout: the same terms up to rounding), and the manifest records which ran.
    rankings = write_synthetic(ArtifactStore(tmp_path / "shared"), n=3, m=3, n_generated=2)
    written = {}
    for setting in ("auto", False):
        store = ArtifactStore(tmp_path / str(setting))
        config = CacheConfig(model=str(tiny_model_dir), share_prompts=setting, device="cpu", shard_rows=2)
        written[setting] = run_cache(config, rankings, store, progress=False)
        assert read_manifest(written[setting].path)["config"]["resolved_share_prompts"] is (setting == "auto")
    assert prompt_pass_counts == [2, 1]  # each shard's examples' prompts in one pass, under auto only
    assert written["auto"].ref.version == written[False].ref.version
    shared, whole = (load_table(written[setting].path).to_pylist() for setting in ("auto", False))
    for a, b in zip(shared, whole, strict=True):
        assert a["input_ids"] == b["input_ids"]
        torch.testing.assert_close(torch.tensor(a["ref_logp"]), torch.tensor(b["ref_logp"]), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(a["ref_contraction"]), torch.tensor(b["ref_contraction"]),
                                   atol=1e-4, rtol=1e-4)
    # a resume under the other setting says so, as under another batch size (what a kill during shard 1
    # leaves: the run's start marker, shard 0, no manifest)
    runs = read_manifest(written[False].path)["runs"]
    (written[False].path / ".started").write_text("".join(json.dumps(run) + "\n" for run in runs))
    (written[False].path / "manifest.json").unlink()
    (written[False].path / "part-00001.parquet").unlink()
    with caplog.at_level(logging.WARNING, logger="moplex_core.artifacts.writer"):
        run_cache(CacheConfig(model=str(tiny_model_dir), device="cpu", shard_rows=2), rankings,
                  ArtifactStore(tmp_path / "False"), progress=False)
    assert ('resumes from files that earlier runs wrote with resolved_share_prompts false (last: true); '
            'share_prompts false (last: "auto")') in caplog.text


def test_checkpointed_layers_write_the_same_cache_under_the_same_version(tiny_model_dir, tmp_path,  # noqa: F811
                                                                          layer_runs):  # noqa: F811
    rankings = write_synthetic(ArtifactStore(tmp_path / "in"), n=3, m=3, n_generated=2)
    written, layers_run = [], []
    for checkpointed in (False, True):
        layer_runs[0] = 0
        written.append(run_cache(CacheConfig(model=str(tiny_model_dir), device="cpu",
                                             gradient_checkpointing=checkpointed),
                                 rankings, ArtifactStore(tmp_path / str(checkpointed)), progress=False))
        layers_run.append(layer_runs[0])
    assert layers_run[1] > layers_run[0] > 0  # the input-gradient passes' layers ran again
    assert written[0].ref.version == written[1].ref.version
    assert load_table(written[1].path).equals(load_table(written[0].path))


def test_a_cache_pass_out_of_device_memory_names_cache_score_batch_size(tiny_model_dir, tmp_path,  # noqa: F811
                                                                       monkeypatch):
    import moplex_core.estimate as estimate

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB.")

    monkeypatch.setattr(estimate, "anchor_pass", out_of_memory)
    store = ArtifactStore(tmp_path / "artifacts")
    rankings = write_synthetic(store, n=6, m=3)
    config = CacheConfig(model=str(tiny_model_dir), score_batch_size=8)
    with pytest.raises(torch.OutOfMemoryError, match=r"a cache pass holds up to cache.score_batch_size = 8 "
                       r"responses; lower it \(--set cache.score_batch_size=4\), or cache.max_response_tokens, or set "
                       r"cache.gradient_checkpointing = true \(.*Tried to allocate 9.00 GiB"):
        run_cache(config, rankings, store, progress=False)
    assert not plan_cache(config, rankings, store).complete


def test_a_prompt_and_response_longer_than_the_models_context_are_refused_naming_one(tiny_model_dir, tmp_path):  # noqa: F811
    """The cache stage reads the whole prompt + response: beyond max_position_embeddings a rotary model
    reads positions it never trained at (a learned one fails deep in torch), so it stops, naming an
    example and the settings that cut the sequences, before any shard: the fix is a new version."""
    short = tmp_path / "short-context"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8}))
    store = ArtifactStore(tmp_path / "root")
    rankings = write_synthetic(store, n=4, m=3)
    with pytest.raises(ValueError, match=r"4 example\(s\) have a prompt \+ response longer than the 8 positions the "
                                         r"model reads .*e\.g\. example_id '[^']+': \d+ tokens\); set "
                                         r"cache\.max_prompt_tokens and cache\.max_response_tokens so that their "
                                         r"sum is at most 8"):
        run_cache(CacheConfig(model=str(short)), rankings, store, progress=False)
    source = tmp_path / "long.jsonl"  # the last shard's prompt past the model's positions
    source.write_text("".join(json.dumps({"prompt": "Which list is best? " * (2000 if i == 3 else 1),
                                          "responses": [f"{i} 1", f"{i} 2"], "ranking": [[0], [1]]}) + "\n"
                              for i in range(4)))
    store_long = ArtifactStore(tmp_path / "long-root")
    with_long = run_ingest(IngestConfig(dataset="generic", path=str(source), split={"fractions": (1.0, 0.0, 0.0)}),
                           store_long).path
    one_per_shard = CacheConfig(model=str(tiny_model_dir), shard_rows=1, max_prompt_tokens=None)
    with pytest.raises(ValueError, match=r"1 example\(s\) have a prompt \+ response longer than the \d+ positions"):
        run_cache(one_per_shard, with_long, store_long, progress=False)
    assert not list(plan_cache(one_per_shard, with_long, store_long).path.glob("part-*"))  # refused before any shard
    with pytest.raises(ValueError, match="the cache at .* has no rows of split 'nope'; ingest with a split that has"):
        load_policy_inputs(run_cache(CacheConfig(model=str(tiny_model_dir)), rankings, store, progress=False).path,
                           "nope")
