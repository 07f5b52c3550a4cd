"""The tiny offline model factory writes an ordinary, loadable, deterministic Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from lm_fixtures import PRETRAIN_STEPS, tiny_model_dir, tiny_pairs  # noqa: F401 (session fixture)
from safetensors.torch import load_file
from stage_fixtures import write_synthetic
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from moplex_core.artifacts import ArtifactStore, load_table
from moplex_core.config import TinyModelConfig
from moplex_core.lm.logprobs import sequence_logprobs
from moplex_core.lm.tiny import IM_END, PAD_TOKEN, build_tiny_model
from moplex_core.lm.tokenize import pad_batch, tokenize_responses
from moplex_core.tiny_model import STAGE, run_tiny_model


def test_directory_loads_with_auto_classes_and_generates_a_chat_turn(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert isinstance(model, Qwen3ForCausalLM)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert len(tokenizer) == model.config.vocab_size

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Rank by criterion 1: which list is best?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    new_tokens = out[0, prompt["input_ids"].shape[1] :]
    assert 0 < len(new_tokens) <= 16
    # A pre-trained model answers in the data's alphabet: digits and spaces, then the end of turn.
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert text.strip() and set(text) <= set("0123456789 ")


def test_same_seed_gives_identical_files_and_a_new_seed_new_weights(tmp_path: Path) -> None:
    pairs = tiny_pairs(n=20)
    a = build_tiny_model(tmp_path / "a", pairs, seed=3, pretrain_steps=2)
    b = build_tiny_model(tmp_path / "b", pairs, seed=3, pretrain_steps=2)
    c = build_tiny_model(tmp_path / "c", pairs, seed=4, pretrain_steps=2)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    weights_a, weights_b, weights_c = (load_file(d / "model.safetensors") for d in (a, b, c))
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    assert not torch.equal(weights_a["model.embed_tokens.weight"], weights_c["model.embed_tokens.weight"])


def test_building_leaves_the_callers_random_state_and_threads_alone(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", tiny_pairs(n=10), pretrain_steps=1)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


def test_pretraining_raises_the_likelihood_of_the_responses(tiny_model_dir: Path, tmp_path: Path) -> None:
    untrained_dir = build_tiny_model(tmp_path / "untrained", tiny_pairs(), pretrain_steps=0, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    held_out = tiny_pairs(n=16, seed=1)
    batch = pad_batch(
        [tokenize_responses(tokenizer, prompt, [response])[0] for prompt, response in held_out],
        tokenizer.pad_token_id,
    )
    mean_logp = {}
    for name, directory in (("untrained", untrained_dir), ("pretrained", tiny_model_dir)):
        model = AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
        mean_logp[name] = logp.mean().item()
    # A random init is close to uniform over ~290 tokens (-5.7 nats a token); 40 steps learn digits.
    assert mean_logp["pretrained"] > mean_logp["untrained"] + 2.0 * PRETRAIN_STEPS / 40


def test_the_tiny_model_stage_builds_once_and_refuses_rankings_without_a_train_split(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    rankings = write_synthetic(store, n=6, m=3)
    config = TinyModelConfig(pretrain_steps=2, hidden_size=32)
    model = run_tiny_model(config, rankings, store)
    built = (model / "model.safetensors").stat().st_mtime_ns
    assert run_tiny_model(config, rankings, store) == model  # the finished version, not built again
    assert (model / "model.safetensors").stat().st_mtime_ns == built
    table = load_table(rankings)
    no_train = table.set_column(table.schema.get_field_index("split"), "split", pa.array(["test"] * table.num_rows))
    version = store.version("ingest", {"no_train": True})
    with store.writer("ingest", version, config={}) as writer:
        writer.write_shard(0, no_train)
    with pytest.raises(ValueError, match="has no 'train' rankings to build the tiny model's tokenizer and "
                                         "pre-training from; ingest with a non-empty train split"):
        run_tiny_model(config, store.path("ingest", version), store)
    assert [info.path for info in store.list(STAGE)] == [model.parent]  # nothing started for the refused one
