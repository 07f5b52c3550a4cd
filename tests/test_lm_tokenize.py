"""Tokenisation of prompt + response: shared prompt prefix, EOS, truncation from the right places."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lm_fixtures import tiny_tokenizer  # noqa: F401 (session fixture)
from transformers import PreTrainedTokenizerBase

from moplex_core.lm.tokenize import TokenizedResponse, encode_prompt, encode_response, pad_batch, tokenize_responses


def test_every_response_follows_the_same_chat_prompt_and_ends_with_eos(tiny_tokenizer) -> None:
    prompt = "Rank by criterion 2: which list is best?"
    responses = ["3 1 4", "1 5 9 2 6", "5"]
    sequences = tokenize_responses(tiny_tokenizer, prompt, responses)

    start = sequences[0].response_start
    prompt_ids = sequences[0].input_ids[:start]
    chat_turn = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(prompt_ids) == chat_turn
    for seq, response in zip(sequences, responses, strict=True):
        assert seq.response_start == start
        assert seq.input_ids[:start] == prompt_ids
        assert seq.input_ids[-1] == tiny_tokenizer.eos_token_id
        assert tiny_tokenizer.decode(seq.input_ids[start:-1]) == response


def test_special_token_text_in_a_response_is_text_and_a_kept_end_marker_is_the_one_eos(tiny_tokenizer) -> None:
    plain, kept_end, inside = tokenize_responses(
        tiny_tokenizer, "Which?", ["3 1 4", "3 1 4<|im_end|>\n", "use <|im_start|>user to open a turn"])
    start = plain.response_start
    assert kept_end.input_ids == plain.input_ids  # one EOS, not two
    response = inside.input_ids[start:-1]
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") not in response
    assert tiny_tokenizer.decode(response) == "use <|im_start|>user to open a turn"  # spelled out, character by character


def test_a_tokenizer_that_cannot_split_special_tokens_encodes_the_text_as_it_does(tiny_tokenizer) -> None:
    class NoSplitting:  # as mistral_common's MistralCommonBackend refuses split_special_tokens
        eos_token, eos_token_id, name_or_path = tiny_tokenizer.eos_token, tiny_tokenizer.eos_token_id, "no-split"

        def __call__(self, text, add_special_tokens=True, split_special_tokens=False, verbose=True):
            if split_special_tokens:
                raise ValueError("`MistralCommonBackend` does not support `split_special_tokens`.")
            return tiny_tokenizer(text, add_special_tokens=add_special_tokens, verbose=verbose)

    assert encode_response(NoSplitting(), "3 1 4") == encode_response(tiny_tokenizer, "3 1 4")


def test_texts_past_model_max_length_raise_no_indexing_warning(tiny_tokenizer) -> None:  # noqa: F811
    """moplex cuts them itself (and the stages say so): transformers' warning that running them
    "will result in indexing errors" would be wrong. The tokenizer records that it warned."""
    short = copy.deepcopy(tiny_tokenizer)
    short.model_max_length = 4
    (seq,) = tokenize_responses(short, "3 1 4 1 5 9 2 6 5 3 5", ["8 9 7 9 3 2 3 8 4 6"], max_prompt_tokens=3,
                                max_response_tokens=3)
    assert len(seq.input_ids) == 6
    assert encode_prompt(short, "3 1 4 1 5 9 2 6 5 3 5", use_chat_template=False)
    assert not short.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")
    short("3 1 4 1 5 9 2 6 5 3 5")  # what the flag records when the warning is given
    assert short.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")


def test_chat_messages_render_like_the_same_prompt_as_text(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    as_text = encode_prompt(tiny_tokenizer, "hello")
    as_messages = encode_prompt(tiny_tokenizer, [{"role": "user", "content": "hello"}])
    assert as_text == as_messages


def test_without_chat_template_the_prompt_is_plain_text(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    (seq,) = tokenize_responses(tiny_tokenizer, "Question: 1 or 2?", [" 2"], use_chat_template=False)
    assert tiny_tokenizer.decode(seq.input_ids) == "Question: 1 or 2? 2<|im_end|>"
    assert tiny_tokenizer.decode(seq.input_ids[seq.response_start :]) == " 2<|im_end|>"
    with pytest.raises(ValueError, match="set use_chat_template = true, give the model a chat template, or ingest"):
        encode_prompt(tiny_tokenizer, [{"role": "user", "content": "hi"}], use_chat_template=False)


def test_without_chat_template_an_eos_the_tokenizer_appends_does_not_end_the_prompt(
        tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    from tokenizers.processors import TemplateProcessing

    closing = copy.deepcopy(tiny_tokenizer)  # a tokenizer set to close every text with EOS (add_eos_token)
    eos = (closing.eos_token, closing.eos_token_id)
    closing.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A {eos[0]}", special_tokens=[eos])
    assert closing("Question?")["input_ids"][-1] == closing.eos_token_id
    assert encode_prompt(closing, "Question?", use_chat_template=False) == \
        encode_prompt(tiny_tokenizer, "Question?", use_chat_template=False)
    written = encode_prompt(tiny_tokenizer, "Question?<|im_end|>", use_chat_template=False)  # in the text itself
    assert written[-1] == tiny_tokenizer.eos_token_id


def test_a_prompt_without_tokens_is_refused(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="encodes to no tokens"):
        encode_prompt(tiny_tokenizer, "", use_chat_template=False)


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.text(alphabet="abc 0123456789.?", min_size=1, max_size=40),
    response=st.text(alphabet="abc 0123456789.?\n", max_size=60),
    max_prompt_tokens=st.integers(1, 30),
    max_response_tokens=st.integers(1, 30),
)
def test_truncation_keeps_the_prompt_end_and_the_response_start(
    tiny_tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    response: str,
    max_prompt_tokens: int,
    max_response_tokens: int,
) -> None:
    full_prompt = encode_prompt(tiny_tokenizer, prompt)
    eos = tiny_tokenizer.eos_token_id
    full_response = tiny_tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
    (seq,) = tokenize_responses(
        tiny_tokenizer,
        prompt,
        [response],
        max_prompt_tokens=max_prompt_tokens,
        max_response_tokens=max_response_tokens,
    )
    prompt_ids, response_ids = seq.input_ids[: seq.response_start], seq.input_ids[seq.response_start :]
    assert prompt_ids == full_prompt[-max_prompt_tokens:]
    assert response_ids == full_response[:max_response_tokens]
    # EOS closes the response exactly when the response was not cut.
    assert (response_ids[-1] == eos) == (len(full_response) <= max_response_tokens)


def test_pad_batch_pads_on_the_right_and_masks_the_response_and_its_eos() -> None:
    sequences = [TokenizedResponse([7, 8, 9, 2], response_start=2), TokenizedResponse([7, 8, 5, 6, 9, 2], 3)]
    batch = pad_batch(sequences, pad_token_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 9, 2, 0, 0], [7, 8, 5, 6, 9, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert batch.response_mask.dtype == torch.bool and batch.input_ids.dtype == torch.long


def test_pad_batch_refuses_a_response_without_a_prompt_token_before_it() -> None:
    with pytest.raises(ValueError, match="sequence 1 has response_start=0"):
        pad_batch([TokenizedResponse([1, 2], 1), TokenizedResponse([3, 4], 0)], pad_token_id=0)


def test_a_prompt_the_chat_template_refuses_is_a_value_error_naming_its_row(tiny_tokenizer) -> None:  # noqa: F811
    import copy

    from moplex_core.generate.base import SampleRequest, request_prompt_ids

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
                               "{% endfor %}")  # as Gemma's template does
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which list?"}]
    with pytest.raises(ValueError, match="chat template cannot render these prompt messages.*System role not"):
        encode_prompt(tokenizer, system)
    request = SampleRequest("p7", "Which list?", '[{"role": "system", "content": "Be brief."}, '
                            '{"role": "user", "content": "Which list?"}]', 1, 0)
    with pytest.raises(ValueError, match="^prompt_id 'p7': the tokenizer's chat template"):
        request_prompt_ids(tokenizer, request, use_chat_template=True, max_prompt_tokens=None)
    with pytest.raises(ValueError, match="chat template cannot render"):
        encode_prompt(tiny_tokenizer, [])  # an empty conversation


def test_a_template_with_a_thinking_switch_renders_without_thinking(tiny_tokenizer) -> None:  # noqa: F811
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                               "A:{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
                               "{% endif %}{% endif %}")  # the shape of Qwen3's switch
    rendered = tokenizer.decode(encode_prompt(tokenizer, "Which list?"))
    assert rendered.replace(" ", "").endswith("A:<think></think>")
