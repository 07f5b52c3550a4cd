"""A tiny Qwen3-architecture chat model built offline, for tests, the demo and CPU studies (DESIGN 8).

No model hub is reachable here, so the LM path is exercised on a model made from scratch: a
byte-level BPE tokenizer trained on the given texts (as Qwen's is byte-level BPE, any text encodes
and nothing is unknown), Qwen's chat markup, a ``Qwen3ForCausalLM`` with a seeded initialisation and,
optionally, a few steps of next-token pre-training on the (prompt, response) pairs rendered through
the chat template, so that log-probs are those of a model that has seen the data rather than of
noise. The result is an ordinary Hugging Face directory: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it, ``generate`` runs on it.

`build_qwen3_0_6b_shape` makes a model of Qwen3-0.6B's size the same way (random weights), for
benchmarks of the cost of the LM path at the paper's scale.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from moplex_core.lm.tokenize import pad_batch, tokenize_responses

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn; the EOS that closes every scored response
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
PRETRAIN_BATCH_SIZE = 16  # pairs per AdamW step of the tiny model's pre-training
PRETRAIN_LR = 3e-3

# Qwen's ChatML markup without tools or thinking blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tiny_tokenizer(texts: Sequence[str], *, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``, with Qwen's special tokens and chat template.

    ``vocab_size`` counts the 256 byte symbols and the 4 special tokens; what is left becomes BPE
    merges (shorter sequences). Training is deterministic for given texts.
    """
    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pairs(n: int = 120, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, response) texts in the spirit of the synthetic data, lists of digits to be ranked: what
    the tests and benchmarks build and pre-train their tiny models on."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        digits = [str(rng.randrange(10)) for _ in range(rng.randrange(2, 6))]
        pairs.append((f"Rank by criterion {i % 3}: which list is best?", " ".join(digits)))
    return pairs


def build_tiny_model(
    out_dir: str | Path,
    pairs: Sequence[tuple[str, str]],
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 320,
    max_positions: int = 1024,
    seed: int = 0,
    pretrain_steps: int = 0,
) -> Path:
    """Build, optionally pre-train, and save a tiny Qwen3 chat model and its tokenizer to ``out_dir``.

    pairs:             (prompt, response) texts; the tokenizer is trained on all of them and the
                       pre-training reads each as a user turn answered by the assistant.
    hidden_size, layers, heads, kv_heads, max_positions:
                       the Qwen3Config (head_dim = hidden_size / heads; MLP width 3 * hidden_size;
                       tied input/output embeddings, as in Qwen3-0.6B).
    vocab_size:        see build_tiny_tokenizer.
    seed:              weight initialisation and the pre-training batch order; the same seed gives
                       the same weights (built on one CPU thread), without touching the caller's RNG
                       or thread count.
    pretrain_steps:    AdamW steps of next-token loss on every non-pad token, batches of
                       ``PRETRAIN_BATCH_SIZE`` pairs drawn without replacement epoch by epoch.

    Returns ``out_dir`` as a Path.
    """
    if not pairs:
        raise ValueError(
            "build_tiny_model needs at least one (prompt, response) pair to train the tokenizer on"
        )
    if hidden_size % heads != 0 or heads % kv_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of heads ({heads}) and heads a multiple "
            f"of kv_heads ({kv_heads})"
        )
    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer([text for pair in pairs for text in pair], vocab_size=vocab_size)
    tokenizer.model_max_length = max_positions
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # One thread: the matrices are too small to gain from more (on a busy 2-core machine two threads
    # ran 8x slower), and the float32 reductions, so the weights, then do not depend on the core count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
            if pretrain_steps > 0:
                _pretrain(
                    model,
                    tokenizer,
                    pairs,
                    steps=pretrain_steps,
                    batch_size=PRETRAIN_BATCH_SIZE,
                    lr=PRETRAIN_LR,
                    seed=seed,
                )
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return _save(model, tokenizer, out_dir)


def build_qwen3_0_6b_shape(
    out_dir: str | Path, texts: Sequence[str], dtype: torch.dtype = torch.bfloat16, *, seed: int = 0
) -> Path:
    """Save a model of Qwen3-0.6B's architecture (its config.json values: 28 layers, hidden 1024,
    16 query / 8 key-value heads of 128, vocabulary 151,936, tied embeddings) with seeded random
    weights in ``dtype``, and the tiny tokenizer trained on ``texts``, to ``out_dir``.

    No download. The tokenizer covers only the first few hundred of the 151,936 embedding rows,
    which is all that prompts need for cost measurements; token ids beyond it are valid model inputs.
    The caller's RNG is untouched. Returns ``out_dir`` as a Path.
    """
    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(texts)
    config = Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
        rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(dtype)
    return _save(model, tokenizer, out_dir)


def _save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
    """Save ``model`` (generation stopping at the tokenizer's EOS, padding with its PAD) and
    ``tokenizer`` into ``out_dir``; return it."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _pretrain(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    half = model.config.max_position_embeddings // 2
    sequences = [
        tokenize_responses(tokenizer, prompt, [response], max_prompt_tokens=half, max_response_tokens=half)[0]
        for prompt, response in pairs
    ]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch_size = min(batch_size, len(sequences))
    model.train()
    order = torch.randperm(len(sequences), generator=generator)
    cursor = 0
    for _ in range(steps):
        if cursor + batch_size > len(order):
            order = torch.randperm(len(sequences), generator=generator)
            cursor = 0
        rows = order[cursor : cursor + batch_size].tolist()
        batch = pad_batch([sequences[i] for i in rows], tokenizer.pad_token_id)
        cursor += batch_size
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)  # [B, L]; pads carry no loss
        loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
