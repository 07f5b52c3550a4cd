"""What a model and its tokenizer must offer the pipeline, checked before work is spent on them.

`check_model` runs when a pipeline starts, before any stage loads a model: on the model's config
only (the model is built on the meta device, no weights read), and only where it is on this machine
without a download (a local folder, a cached hub snapshot; a deployment's flow may run where the GPU
workers' models are not). The stages check what concerns them as they run: `beyond_the_context`
(cache, assign, the hf backend), `warn_of_turn_layout` (cache), the LoRA targets (train).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from moplex_core.lm.loading import hub_snapshot, load_config, load_tokenizer
from moplex_core.lm.logprobs import refuse_rescaled_logits
from moplex_core.lm.multi_lora import target_layers

log = logging.getLogger(__name__)

_MARK = "MOPLEX-RESPONSE-MARK"


def context_length(config: PretrainedConfig) -> int | None:
    """The positions the model reads at most: ``max_position_embeddings`` (GPT-2's ``n_positions``),
    or what a rotary scaling stretches it to (a YaRN ``factor`` times its
    ``original_max_position_embeddings``, as Qwen's model cards set for long contexts)."""
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, int | float) and factor > 1:
        return max(length, int(factor * (rope.get("original_max_position_embeddings") or length)))
    return length


def beyond_the_context(lengths: Sequence[tuple[str, int]], context: int | None) -> tuple[int, str, int] | None:
    """(how many, the first's key, its length) of the (key, sequence length) pairs longer than the
    model's ``context`` positions; None when all fit (or the context is unknown). A model with learned
    positions (GPT-2's) fails on them with an index error deep in torch; a rotary one reads positions
    it was never trained at."""
    if context is None:
        return None
    long = [(key, n) for key, n in lengths if n > context]
    return (len(long), *long[0]) if long else None


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token the chat template closes an assistant's turn with (Qwen's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>): the first token after the content of a rendered assistant
    message, when that is a special token; None without a template or when it renders none."""
    if tokenizer.chat_template is None:
        return None
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    except (TemplateError, ValueError, TypeError):
        return None
    if not isinstance(text, str) or _MARK not in text:
        return None
    after = tokenizer(text.split(_MARK, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return after[0] if after and after[0] in special else None


def warn_of_turn_layout(stops: int | Sequence[int] | None, tokenizer: PreTrainedTokenizerBase,
                        use_chat_template: bool, setting: str) -> None:
    """Warn where prompts and responses would not be laid out as the model's turns are: the EOS every
    response is scored ending with is not a token the model stops generating at (its generation_config's
    eos_token_id) or not the one its chat template closes an assistant's turn with (scores would
    include an end its turns do not have), or there is no chat template to render a prompt with (the
    response then follows the prompt's text directly). ``stops``: the generation config's eos_token_id;
    ``setting``: the stage's settings block (``cache``), named in the advice."""
    stops = set() if stops is None else {stops} if isinstance(stops, int) else set(stops)
    if stops and tokenizer.eos_token_id not in stops:
        log.warning("the cache closes every response with the tokenizer's eos_token %r (id %d), but the model stops "
                    "generating at token id(s) %s (generation_config.json): every score includes an end token its "
                    "turns do not end with. Set the tokenizer's eos_token (tokenizer_config.json) to the end-of-turn "
                    "token.", tokenizer.eos_token, tokenizer.eos_token_id, sorted(stops))
    if use_chat_template and tokenizer.chat_template is None:
        log.warning("the tokenizer of %s has no chat template: prompts are encoded as plain text and each response "
                    "follows the prompt's last token directly. For a base model that is what it reads; otherwise "
                    "give the tokenizer its chat template (tokenizer_config.json). Set %s.use_chat_template=false (in "
                    "a pipeline augment.use_chat_template=false too) to say plain text is meant.",
                    tokenizer.name_or_path, setting)
    turn_end = end_of_turn_id(tokenizer) if use_chat_template else None
    if turn_end is not None and turn_end != tokenizer.eos_token_id:
        token = tokenizer.convert_ids_to_tokens(turn_end)
        advice = f"Set the tokenizer's eos_token to {token!r} (tokenizer_config.json)."
        if stops and turn_end not in stops:
            advice = (f"The model does not stop generating at {token!r} either (generation_config.json): a base model "
                      f"with a template it was not trained on reads plain text (set {setting}.use_chat_template=false "
                      "and augment's); otherwise set both the tokenizer's eos_token and generation_config's "
                      "eos_token_id to it.")
        log.warning("the chat template of %s closes an assistant's turn with %r (id %d), but every response is scored "
                    "ending with the tokenizer's eos_token %r (id %d), a token the model's turns do not end with. %s",
                    tokenizer.name_or_path, token, turn_end, tokenizer.eos_token, tokenizer.eos_token_id, advice)


def local_model_folder(name_or_path: str) -> Path | None:
    """The folder of a model's config.json here, without a download: a local directory, or a hub
    name's cached snapshot; None otherwise."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    return None if path.exists() else hub_snapshot(name_or_path)


def check_model(model: str, *, lora_targets: Sequence[str], max_prompt_tokens: int | None,
                max_response_tokens: int | None, use_chat_template: bool) -> None:
    """Refuse settings ``model`` cannot run before any stage loads it: logits it transforms after lm_head
    (`refuse_rescaled_logits`), LoRA targets (train.lora_targets) that match none of its linear layers,
    a cache whose longest sequence (cache.max_prompt_tokens + cache.max_response_tokens) exceeds
    its positions, and a tokenizer with more tokens than its embedding table; and warn of its turn
    layout (`warn_of_turn_layout`, which the cache repeats), before augment generates. Nothing is checked for a model that is not on this machine (the stages check it
    where it is)."""
    folder = local_model_folder(model)
    if folder is None:
        log.info("%s is not on this machine as a model folder (or a hub name in its cache): its settings are "
                 "checked by the stages that load it", model)
        return
    try:  # as the stages load it: no model code run, no question on a terminal
        config = load_config(folder)
    except (ValueError, OSError) as err:
        log.info("the config of %s is read by the stages that load it (%s: %s)", model, type(err).__name__, err)
        return
    refuse_rescaled_logits(config.get_text_config(decoder=True), model)
    context = context_length(config)
    if max_prompt_tokens is not None and max_response_tokens is not None and context is not None \
            and max_prompt_tokens + max_response_tokens > context:
        raise ValueError(f"cache.max_prompt_tokens + cache.max_response_tokens = {max_prompt_tokens} + "
                         f"{max_response_tokens} exceeds the {context} positions {model} reads "
                         f"(its context): lower them so that their sum is at most {context}")
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - an architecture transformers cannot build here: train checks it
        log.info("the LoRA targets of %s are checked by the train stage (%s: %s)", model, type(err).__name__, err)
    else:
        target_layers(skeleton, lora_targets)
    try:
        tokenizer = load_tokenizer(folder)
    except (ValueError, OSError) as err:
        log.info("the tokenizer of %s is read by the stages that load it (%s: %s)", model, type(err).__name__, err)
        return
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer of {model} has {len(tokenizer)} tokens, but the model's embedding table holds "
                         f"vocab_size = {vocab}: token ids from {vocab} on would index past it (an IndexError in "
                         "augment or cache). Put the model's own tokenizer beside its config.json, or resize its "
                         "embeddings to the tokenizer (model.resize_token_embeddings) and save it again")
    try:
        stops = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    except OSError:  # no generation_config.json: the model's config says where it stops
        stops = GenerationConfig.from_model_config(config).eos_token_id
    warn_of_turn_layout(stops, tokenizer, use_chat_template, "cache")
