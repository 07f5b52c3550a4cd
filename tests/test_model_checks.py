"""What the pipeline checks of a model before its stages load it, and what the cache warns of
(moplex_core.lm.checks): models of other architectures and tokenizers of other layouts, built offline."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from transformers import AutoTokenizer, Gemma2Config, GPT2Config, GraniteConfig, LlamaConfig

from lm_fixtures import tiny_model_dir  # noqa: F401 - fixture
from moplex_core.config import pipeline_preset, with_overrides
from moplex_core.lm.checks import (beyond_the_context, check_model, context_length, end_of_turn_id,
                                   warn_of_turn_layout)
from moplex_core.lm.multi_lora import LoRASettings
from moplex_core.pipeline import _warn_of_another_generator

TARGETS = LoRASettings().target_modules


def test_a_gpt2_model_is_checked_before_any_stage_for_its_positions_and_its_layers(tmp_path):
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=128).save_pretrained(tmp_path)  # no weights
    with pytest.raises(ValueError, match=r"cache.max_prompt_tokens \+ cache.max_response_tokens = 512 \+ 512 exceeds "
                                         r"the 128 positions .* reads \(its context\)"):
        check_model(str(tmp_path), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
    with pytest.raises(ValueError, match=r"train.lora_targets.*its linear layers \(but the output layer\): \['c_attn', "
                                         r"'c_fc', 'c_proj'\]"):
        check_model(str(tmp_path), lora_targets=TARGETS, max_prompt_tokens=64, max_response_tokens=64,
                    use_chat_template=True)


def test_a_model_that_rescales_its_logits_after_lm_head_is_refused_before_any_stage(tmp_path):
    # Gemma 2's final_logit_softcapping is reproduced (logprobs.SoftCappedHead): its settings are checked
    Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, vocab_size=64, max_position_embeddings=128, final_logit_softcapping=30.0
                 ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"512 \+ 512 exceeds the 128 positions"):
        check_model(str(tmp_path), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
    check_model(str(tmp_path), lora_targets=TARGETS, max_prompt_tokens=64, max_response_tokens=64,
                use_chat_template=True)
    granite = tmp_path / "granite"  # Granite divides its logits by logits_scaling
    GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                  logits_scaling=8.0).save_pretrained(granite)
    with pytest.raises(ValueError, match=r"rescales its logits after lm_head \(logits_scaling\)"):
        check_model(str(granite), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)


def test_a_rotary_scaling_stretches_the_context_and_an_unknown_architecture_is_left_to_train(tmp_path, caplog):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert context_length(LlamaConfig(max_position_embeddings=256, rope_scaling=yarn)) == 1024  # as Qwen's long context
    assert context_length(LlamaConfig(max_position_embeddings=256)) == 256
    custom = tmp_path / "custom"  # a model whose code is its own (trust_remote_code): never run, nothing asked
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({"model_type": "acme", "auto_map": {"AutoConfig": "acme.Config"}}))
    with caplog.at_level(logging.INFO, logger="moplex_core.lm.checks"):
        check_model(str(custom), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
        check_model("someone/not-cached-here", lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
    assert "the config of" in caplog.text and "is read by the stages that load it" in caplog.text
    assert "someone/not-cached-here is not on this machine" in caplog.text


def test_the_tiny_model_passes_and_its_turns_end_with_its_eos(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        check_model(str(tiny_model_dir), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
    assert caplog.text == ""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id


def test_a_tokenizer_with_more_tokens_than_the_embedding_table_is_refused_before_any_stage(tiny_model_dir, tmp_path):
    small = tmp_path / "small-vocab"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert config["vocab_size"] >= tokens  # the tiny model's own: passes (above)
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": tokens - 1}))
    with pytest.raises(ValueError, match=rf"has {tokens} tokens, but the model's embedding table holds vocab_size = "
                                         rf"{tokens - 1}: token ids from {tokens - 1} on would index past it"):
        check_model(str(small), lora_targets=TARGETS, max_prompt_tokens=64, max_response_tokens=64,
                    use_chat_template=True)


def test_a_tokenizer_whose_eos_does_not_end_the_templates_turns_or_that_has_no_template_is_warned_of(
        tiny_model_dir, tmp_path, caplog):
    other = tmp_path / "other-eos"  # as older Llama 3 tokenizers: eos <|end_of_text|>, turns end with <|eot_id|>
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    tokenizer = AutoTokenizer.from_pretrained(other)
    stops = [tokenizer.eos_token_id, end_of_turn_id(tokenizer)]  # the model stops at both
    generation = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": stops}))
    with caplog.at_level(logging.WARNING):  # when the pipeline starts, before augment generates
        check_model(str(other), lora_targets=TARGETS, max_prompt_tokens=512, max_response_tokens=512,
                    use_chat_template=True)
    assert "closes an assistant's turn with '<|im_end|>'" in caplog.text
    assert "scored ending with the tokenizer's eos_token '<|endoftext|>'" in caplog.text
    assert "Set the tokenizer's eos_token to '<|im_end|>'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a base model with a ChatML template (Qwen2.5's)
        warn_of_turn_layout(tokenizer.eos_token_id, tokenizer, True, "cache")
    assert "does not stop generating at '<|im_end|>' either" in caplog.text and "use_chat_template=false" in caplog.text
    caplog.clear()
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING):
        warn_of_turn_layout(stops, tokenizer, True, "cache")
        warn_of_turn_layout(stops, tokenizer, False, "cache")  # plain text meant: nothing to say
    assert caplog.text.count("has no chat template") == 1
    assert "cache.use_chat_template=false (in a pipeline augment.use_chat_template=false too)" in caplog.text


def test_beyond_the_context_counts_the_sequences_longer_than_it():
    assert beyond_the_context([("a", 10), ("b", 13), ("c", 12), ("d", 14)], 12) == (2, "b", 13)
    assert beyond_the_context([("a", 12)], 12) is None and beyond_the_context([("a", 99)], None) is None


def test_a_model_set_for_one_stage_only_is_warned_of(caplog):
    demo = pipeline_preset("synthetic-demo")
    with caplog.at_level(logging.INFO, logger="moplex_core.pipeline"):
        _warn_of_another_generator(demo)
        assert caplog.text == ""
        _warn_of_another_generator(with_overrides(demo, ["cache.model=/models/mine"]))
        assert "augment.model = tiny generates the responses, cache.model = /models/mine (pi_ref) scores them; set " \
               "augment.model=/models/mine too" in caplog.text
        caplog.clear()
        _warn_of_another_generator(with_overrides(demo, ["augment.model=/models/mine"]))
        assert "set cache.model=/models/mine too, unless another reference is meant" in caplog.text
        caplog.clear()
        _warn_of_another_generator(with_overrides(demo, ["augment.use_chat_template=false"]))
        assert "augment.use_chat_template = False but cache.use_chat_template = True" in caplog.text


def test_yarn_stretches_the_original_length_and_a_plain_text_turn_end_is_no_token(tiny_model_dir):  # noqa: F811
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert context_length(LlamaConfig(max_position_embeddings=512, rope_scaling=yarn)) == 1024
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id  # the tiny template closes a turn with EOS
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(tokenizer) is None
