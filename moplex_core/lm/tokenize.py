"""Token ids of prompt + response pairs, laid out for response-only log-probs (DESIGN 5.1, 5.4).

A sequence is ``prompt_ids + response_ids (+ EOS)``. The prompt is encoded once per prompt and the
response on its own, so every response of one prompt shares exactly the same prompt tokens and the
response starts at the same index ``response_start``: DESIGN 5.4 aligns the responses' input
embeddings position by position from that index.

Layout rules:
- With ``use_chat_template`` and a tokenizer that has a chat template, the prompt is rendered as a
  user turn followed by the assistant header (``add_generation_prompt=True``); the response is the
  assistant's content and EOS (for Qwen chat models ``<|im_end|>``) closes the turn. Without a
  template the prompt text is encoded as is, with the tokenizer's own special tokens (BOS, if any;
  not an EOS it would append, as Llama's ``add_eos_token`` does: the response follows).
- The response is encoded as the model generates it, after the prompt's last token: on its own,
  never merged with the prompt's last characters (a response that starts with a newline after a
  template that ends with one keeps its own newline token, where encoding the joined text would make
  one token across the boundary, and the prompt would no longer be the same for every response).
- Special-token text in a prompt (a question about ``<|im_end|>``) is encoded as the control token,
  as the chat template's rendered text is; the cache counts such prompts and warns.
- A long prompt loses its start (left truncation to ``max_prompt_tokens``): the end of the prompt
  sits next to the response and conditions it most.
- A response that ends with the EOS text (an export that kept ``<|im_end|>``) loses that text: the
  EOS appended below stands for it. Special-token text elsewhere in a response is encoded as plain
  characters, never as the control token.
- A generated response that ``max_new_tokens`` cut short (``ended`` false) gets no EOS either: it
  did not end there.
- A long response loses its end, never its start. ``max_response_tokens`` bounds the response
  tokens including EOS. EOS is appended only when the whole response fits: a response cut short did
  not end there, so its score is the log-prob of it *starting* with the kept tokens (as TRL's DPO
  truncation does), rather than teaching every policy to stop mid-sentence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

ChatMessages = Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class TokenizedResponse:
    """One prompt + response sequence, as the `cache` artifact stores it (DESIGN section 3)."""

    input_ids: list[int]
    """Prompt tokens, then response tokens, then EOS when the response was not truncated."""
    response_start: int
    """Index in ``input_ids`` of the first response token (= number of prompt tokens, >= 1)."""


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded tensors for a batch of B sequences of at most L tokens.

    Right padding keeps every sequence at positions 0..n-1, exactly as when it is alone, so causal
    attention never sees a pad before a real token and a sequence's log-prob does not depend on
    what else is in the batch, up to rounding: the kernels' reduction order changes with the
    padded shape (measured on the tiny model: 4e-6 nats in float32, 4e-3 in bfloat16).
    """

    input_ids: torch.Tensor  # int64 [B, L], pad_token_id after each sequence's end
    attention_mask: torch.Tensor  # int64 [B, L], 1 at real tokens
    response_mask: torch.Tensor  # bool [B, L], True at response tokens (EOS included)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | ChatMessages,
    *,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
) -> list[int]:
    """Token ids that precede every response of ``prompt``.

    ``prompt`` is the user's text, or a list of chat messages (``{"role", "content"}`` dicts, the
    `prompt_messages` column) that ends before the assistant's answer. A chat template with a
    thinking switch (Qwen3's ``enable_thinking``) renders in non-thinking mode: the responses of
    preference data are answers, scored and generated right after the prompt, not after a reasoning
    trace (Qwen3 then ends the prompt with an empty ``<think></think>`` block).
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    if use_chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
        except (TemplateError, ValueError, TypeError) as err:  # e.g. a system role it does not support
            raise ValueError(f"the tokenizer's chat template cannot render these prompt messages ({type(err).__name__}: "
                             f"{err}); change them, or set use_chat_template = false") from err
        # The rendered template already holds every special token the model expects. verbose=False here and
        # below: a text past the tokenizer's model_max_length is cut by max_prompt_tokens / max_response_tokens,
        # and the stages count and warn of that; transformers' own warning would call it an indexing error.
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    elif isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=True, verbose=False)["input_ids"])
        if ids and ids[-1] == tokenizer.eos_token_id and ids[-1:] != tokenizer(
                prompt, add_special_tokens=False, verbose=False)["input_ids"][-1:]:
            ids = ids[:-1]  # a tokenizer that closes every text with EOS (add_eos_token) would end the turn here
    else:
        raise ValueError(
            "the prompt is a list of chat messages (prompt_messages), which needs use_chat_template = true "
            "and a tokenizer with a chat template; set use_chat_template = true, give the model a chat "
            "template, or ingest the rankings without prompt_messages (for HelpSteer2's multi-turn prompts: "
            "ingest with helpsteer2.split_turns = false)"
        )
    if not ids:
        raise ValueError(
            f"prompt {prompt!r} encodes to no tokens, so the first response token would have no "
            "context to be predicted from; give a non-empty prompt or use a chat template"
        )
    if max_prompt_tokens is not None:
        ids = ids[-max_prompt_tokens:]
    return list(ids)


def encode_response(
    tokenizer: PreTrainedTokenizerBase,
    response: str,
    *,
    max_response_tokens: int | None = None,
    ended: bool = True,
) -> list[int]:
    """Response token ids, followed by EOS unless the response had to be cut (module docstring) or did
    not end (``ended`` false: a generation that max_new_tokens cut short)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no eos_token, so a response's end cannot be "
            "scored; set tokenizer.eos_token (for Qwen chat models '<|im_end|>')"
        )
    if max_response_tokens is not None and max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be at least 1, got {max_response_tokens}")
    end = tokenizer.eos_token
    if end and response.rstrip().endswith(end):  # an export that kept the turn's end: that end is the EOS below
        response = response.rstrip()[: -len(end)]
    ids = _text_ids(tokenizer, response) + [eos] * ended
    if max_response_tokens is not None and len(ids) > max_response_tokens:
        return ids[:max_response_tokens]
    return ids


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` with special-token text in it encoded as plain characters: text a response
    holds, not a control token (an "<|im_start|>" in an answer about chat formats). A tokenizer that
    cannot split them (mistral_common's) encodes the text as it does."""
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"])
    except (TypeError, ValueError) as err:
        if "split_special_tokens" not in str(err):
            raise
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def tokenize_responses(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | ChatMessages,
    responses: Sequence[str],
    *,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    max_response_tokens: int | None = None,
    ended: Sequence[bool] | None = None,
) -> list[TokenizedResponse]:
    """Sequences ``prompt + response_j`` for every response of one prompt, sharing the prompt ids;
    ``ended[j]`` false leaves response j without EOS (`encode_response`; default: every one ended)."""
    prompt_ids = encode_prompt(
        tokenizer, prompt, use_chat_template=use_chat_template, max_prompt_tokens=max_prompt_tokens
    )
    ended = [True] * len(responses) if ended is None else list(ended)
    if len(ended) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(ended)} ended flags")
    response_ids = [encode_response(tokenizer, r, max_response_tokens=max_response_tokens, ended=e)
                    for r, e in zip(responses, ended, strict=True)]
    return [TokenizedResponse(prompt_ids + ids, response_start=len(prompt_ids)) for ids in response_ids]


def pad_batch(sequences: Sequence[TokenizedResponse], pad_token_id: int) -> PaddedBatch:
    """Right-pad ``sequences`` into [B, L] tensors, L = the longest sequence."""
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    length = max(len(seq.input_ids) for seq in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)  # [B, L]
    response_mask = torch.zeros((len(sequences), length), dtype=torch.bool)  # [B, L]
    for row, seq in enumerate(sequences):
        n = len(seq.input_ids)
        if not 1 <= seq.response_start < n:
            raise ValueError(
                f"sequence {row} has response_start={seq.response_start} but {n} tokens; a response "
                "needs at least one prompt token before it and at least one token of its own"
            )
        input_ids[row, :n] = torch.tensor(seq.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        response_mask[row, seq.response_start : n] = True
    return PaddedBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask)
