"""Sequence log-probabilities log pi(y|x) at response positions only, in chunks (DESIGN 5.1, 5.5).

    log pi(y|x) = sum_{t in response} log p(token_t | tokens_<t)

summed over the response tokens and its EOS; prompt and padding positions are masked. The decoder
runs over the whole sequence (or, with a prefix, over its continuation), but the vocabulary projection (``lm_head``) and the softmax only
touch the hidden states that predict a response token, ``chunk_size`` of them at a time. A naive
full-vocabulary log_softmax would hold a [B, L, V] float32 tensor (Qwen3: V = 151,936, so 5 GB for
8 x 1024 tokens); here at most [chunk_size, V] logits exist at once, and under autograd each chunk is
recomputed in the backward pass instead of being kept.

Shared prompts (`prompt_prefix`): the responses of one prompt under one adapter all start with the
same prompt tokens, so their keys and values there are equal. `prompt_prefix` runs the prompt but
its last token once per group of rows and hands each row that group's keys and values (a
``DynamicCache``); `sequence_logprobs(..., prefix=...)` then runs each row's last prompt token and
response on top of it. Same log-probs, and the same gradients w.r.t. the response's input embeddings
and the LoRA weights (autograd sums each group's rows into its prompt pass), for fewer tokens: one
prompt per group instead of one per row. Only for models whose layers all use full attention
(`prefix_is_exact`).

`output_score_features` runs the same decoder pass and gives, per sequence, the gradient of
log pi(y|x) w.r.t. the ``lm_head`` weight, projected (the features of EM's `linearized` start).

Works for a Hugging Face causal LM, with or without moplex's `MultiLoRA` adapters (routed per row,
moplex_core.lm.multi_lora), and for a PEFT ``PeftModel`` wrapping one: PEFT injects its LoRA layers
into the wrapped model's modules, so calling its decoder and ``lm_head`` directly applies the active
adapter (the tests and benchmarks compare against it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import PeftModel
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from moplex_core.lm.device import to_device


def _cache_name(decoder: nn.Module) -> str:
    """What the decoder calls its key/value cache, in and out: ``past_key_values`` in transformers up
    to 5.17 (the GPU machine's), ``cache`` since (the old name is deprecated there, and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def refuse_rescaled_logits(config: PretrainedConfig, name: str) -> None:
    """Raise for a model whose ForCausalLM forward transforms the logits after lm_head in a way
    `causal_lm_parts` does not reproduce (Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's
    lm_head_multiplier): response-only chunked log-probs skip that forward, so they would be wrong
    without any error. Gemma 2's (and Gemma 3's, where set) final_logit_softcapping is reproduced
    (`SoftCappedHead`)."""
    for transform in ("logit_scale", "logits_scaling", "lm_head_multiplier"):
        if getattr(config, transform, None) not in (None, 1.0):
            raise ValueError(
                f"{name} rescales its logits after lm_head ({transform}), which response-only chunked "
                "log-probs do not reproduce; use a model without it (Qwen, Llama, Mistral, Gemma)"
            )


class SoftCappedHead(nn.Module):
    """``lm_head`` followed by final logit soft-capping, as Gemma 2's forward applies it after the
    head: cap * tanh(logits / cap), computed in float32 at least (the head's bf16 logits are cast
    first). Its parameters are the head's."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, float(cap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)  # [n, V]
        return self.cap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.cap)

    def slope(self, capped: torch.Tensor) -> torch.Tensor:
        """d capped / d logits at the capped logits ``capped``: 1 - tanh^2 = 1 - (capped / cap)^2."""
        return 1 - (capped / self.cap) ** 2


def causal_lm_parts(model: PreTrainedModel | PeftModel) -> tuple[nn.Module, nn.Module]:
    """The decoder (token embeddings -> last hidden states) and ``lm_head`` of a causal LM, the head
    wrapped in `SoftCappedHead` where the model soft-caps its logits."""
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    text_config = causal_lm.config.get_text_config(decoder=True)
    refuse_rescaled_logits(text_config, type(causal_lm).__name__)
    lm_head = causal_lm.get_output_embeddings()
    if lm_head is None:
        raise ValueError(
            f"{type(causal_lm).__name__} has no output embeddings (lm_head); load the model with "
            "AutoModelForCausalLM, not AutoModel"
        )
    cap = getattr(text_config, "final_logit_softcapping", None)
    return causal_lm.get_decoder(), lm_head if cap is None else SoftCappedHead(lm_head, cap)


def embed(model: PreTrainedModel | PeftModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Input embeddings h(x, y) of ``input_ids`` [B, L] -> [B, L, d], to pass as ``inputs_embeds``.

    Take gradients w.r.t. the returned tensor (detach it and set requires_grad) for DESIGN 5.4.
    """
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    return causal_lm.get_input_embeddings()(input_ids)


def prefix_is_exact(model: PreTrainedModel | PeftModel) -> bool:
    """Whether `prompt_prefix` gives whole rows' results on this model: every layer attends to all
    earlier tokens by position. Sliding-window layers mask by index and keep the last keys of the
    right-padded prefix (pads, for a shorter prompt), and linear or recurrent layers fold the pads
    into their state; there the rows must run whole."""
    config = (model.get_base_model() if isinstance(model, PeftModel) else model).config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


@dataclass
class PromptPrefix:
    """Keys and values of the prompt tokens before each row's last prompt token, one row per row of
    the batch that continues it (rows of one group share their group's tensors)."""

    cache: DynamicCache  # per layer [B, heads, P, head_dim]; single use: a forward appends to it, then drops it
    attention_mask: torch.Tensor  # int64 [B, P], 1 at real prompt tokens (right padding)
    lengths: torch.Tensor  # int64 [B] real prompt tokens: the continuation's first position
    padded: bool  # whether a prefix is shorter than P (read on the host, so that nothing waits for the device)


def prompt_prefix(
    model: PreTrainedModel | PeftModel, prefixes: Sequence[Sequence[int]], rows: torch.Tensor, pad_token_id: int
) -> PromptPrefix:
    """One forward over the G distinct ``prefixes`` (each a prompt but its last token, at least one
    token; right-padded to P), expanded to the batch: row b continues ``prefixes[rows[b]]``.

    rows: int64 [B] with values in 0..G-1. Differentiable w.r.t. the model's (LoRA) parameters when
    grad is enabled; under a MultiLoRA route, the route must have G rows (one per prefix).
    """
    if not prefixes or min(len(p) for p in prefixes) < 1:
        raise ValueError("prompt_prefix needs at least one prefix, each of at least one token")
    device = next(model.parameters()).device
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), pad_token_id, dtype=torch.long)  # [G, P]
    mask = torch.zeros((len(prefixes), width), dtype=torch.long)  # [G, P]
    for g, prefix in enumerate(prefixes):
        ids[g, : len(prefix)] = torch.tensor(list(prefix), dtype=torch.long)
        mask[g, : len(prefix)] = 1
    decoder, _ = causal_lm_parts(model)
    # Right padding: a pad's query sees real keys before it (no fully masked row, so no NaN that a
    # masked key could carry into the continuation), and the continuation masks the pads' keys.
    on_device = to_device(mask, device)
    out = decoder(input_ids=to_device(ids, device), attention_mask=_whole_rows_mask(model, mask, on_device),
                  use_cache=True)
    cache = getattr(out, _cache_name(decoder))
    _rows_of_groups(cache, rows)
    mask, rows = on_device, to_device(rows, device)
    return PromptPrefix(cache, mask[rows], mask.sum(1)[rows], min(len(p) for p in prefixes) < width)


def _rows_of_groups(cache: DynamicCache, rows: torch.Tensor) -> None:
    """The prefix keys and values of each of the G groups handed to their rows, in place: [G, ...] ->
    [B, ...] in every layer, row b taking group rows[b] (int64 [B] on the host; a group no row takes
    is dropped).

    Where the rows of each group are one run and the groups come in order (moplex's passes: a
    pair's rows are consecutive), each group's tensors are broadcast to its run (``expand``, joined
    by the cache's own ``cat`` with the continuation when G = 1), so the backward sums each run with
    a reduction. Otherwise differentiable indexing, whose backward accumulates duplicate indices with
    ``index_put_``, which on a GPU is slow for repeated indices of large slices (pytorch issue 41162)."""
    groups, counts = torch.unique_consecutive(rows, return_counts=True)
    if not torch.equal(groups, torch.arange(len(groups))):
        cache.batch_select_indices(rows)
        return
    counts = counts.tolist()
    for layer in cache.layers:
        layer.keys, layer.values = (
            t[:1].expand(counts[0], *t.shape[1:]) if len(counts) == 1
            else torch.cat([t[g : g + 1].expand(count, *t.shape[1:]) for g, count in enumerate(counts)])
            for t in (layer.keys, layer.values))


def sequence_logprobs(
    model: PreTrainedModel | PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    inputs_embeds: torch.Tensor | None = None,
    prefix: PromptPrefix | None = None,
    chunk_size: int = 1024,
    alternatives: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(y|x) of each sequence: float32 [B] (float64 [B] for a float64 model); with
    ``alternatives``, also what other tokens would score in the same contexts.

    input_ids:      int64 [B, L] on the model's device; the targets whose log-probs are summed
                    (always needed, also when the forward pass reads ``inputs_embeds``).
    attention_mask: [B, L], 1 at real tokens (right padding, see moplex_core.lm.tokenize).
    response_mask:  [B, L], nonzero at response tokens (EOS included); position 0 must be prompt.
                    Both masks are read on the host: give them on the CPU (as `pad_batch` makes them),
                    since a mask on the GPU is copied back first, and that copy waits for the GPU.
    inputs_embeds:  [B, L, d] or None; when given the decoder runs on it instead of embedding
                    ``input_ids`` (gradients w.r.t. it, DESIGN 5.4).
    prefix:         the rows' earlier prompt tokens (`prompt_prefix`), or None: the rows are whole
                    sequences. With a prefix, row b's tokens sit at positions prefix.lengths[b] + t.
    chunk_size:     response positions projected to the vocabulary at a time.
    alternatives:   int64 [N, K] on the CPU or None: for each of the N response tokens, row after row
                    and in order within a row, K other tokens (-1: none). Then the result is (log
                    pi(y|x) [B], target terms [B, K]), where target term [b, k] = the sum over row b's
                    response tokens t that have an alternative k of log p(alternative | its context) -
                    log p(token t | its context), without a graph.

    Differentiable w.r.t. ``inputs_embeds`` and the model's (LoRA) parameters (the log-probs).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    selected, targets, at, lm_head = _response_hidden(model, input_ids, attention_mask, response_mask, inputs_embeds,
                                                      prefix)
    acc_dtype = torch.float64 if selected.dtype == torch.float64 else torch.float32

    # Under autograd keep only each chunk's [n, d] input; its [n, V] logits are recomputed in backward.
    recompute = torch.is_grad_enabled() and (
        selected.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    if alternatives is not None and alternatives.shape[0] != targets.shape[0]:
        raise ValueError(f"alternatives has {alternatives.shape[0]} rows for {targets.shape[0]} response tokens")
    others = None if alternatives is None else to_device(alternatives, selected.device)  # [N, K]
    chunks, other_chunks = [], []
    for start in range(0, targets.shape[0], chunk_size):
        end = start + chunk_size
        args = (lm_head, selected[start:end], targets[start:end], acc_dtype,
                None if others is None else others[start:end])
        scored = checkpoint(_target_logprobs, *args, use_reentrant=False) if recompute else _target_logprobs(*args)
        chunks.append(scored[0])
        other_chunks.append(scored[1])
    token_logprobs = torch.cat(chunks) if chunks else selected.new_zeros(0, dtype=acc_dtype)  # [N]

    # Scatter back to [B, L-1] and sum per row: deterministic, unlike index_add on CUDA.
    batch, width = input_ids.shape[0], input_ids.shape[1] - 1
    per_position = torch.zeros(batch * width, dtype=acc_dtype, device=selected.device)
    logp = per_position.index_put((at.predicting,), token_logprobs).view(batch, width).sum(dim=1)  # [B]
    if others is None:
        return logp
    terms = torch.cat(other_chunks) if other_chunks else selected.new_zeros(0, others.shape[1], dtype=acc_dtype)
    per_position = torch.zeros(batch * width, others.shape[1], dtype=acc_dtype, device=selected.device)
    return logp, per_position.index_put((at.predicting,), terms).view(batch, width, -1).sum(dim=1)  # [B, K]


def output_score_features(
    model: PreTrainedModel | PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    *,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """The gradient of log pi(y|x) w.r.t. the ``lm_head`` weight W [V, d], projected: float64
    [B, p * q], row b = (left^T G_b right) flattened, with

        G_b = d log pi(y_b|x_b) / dW = sum_t (e_{y_t} - softmax(W h_t)) h_t^T        [V, d]

    over b's response tokens (h_t the final hidden state that predicts y_t; for a soft-capped head,
    softmax(c(W h_t)) with c = cap tanh(. / cap), and each vocabulary entry of e - p times c' there).
    <Theta, left^T G right> is then the first-order change of log pi(y|x) when W moves by
    left Theta right^T, a rank-limited change of the output layer: features in which the mixture's
    scores are linear at the reference model (`LoRAPolicyScorer.response_features`).

    input_ids, attention_mask, response_mask: [B, L] as in `sequence_logprobs`.
    left: [V, p], right: [d, q] projections (float64, any device). No gradient.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    with torch.no_grad():
        selected, targets, at, lm_head = _response_hidden(model, input_ids, attention_mask, response_mask, None, None)
        left, right = left.to(selected.device, torch.float64), right.to(selected.device, torch.float64)
        row_of = at.rows  # [N] the row of each response token
        features = torch.zeros(input_ids.shape[0], left.shape[1] * right.shape[1], dtype=torch.float64,
                               device=selected.device)  # [B, p*q]
        for start in range(0, targets.shape[0], chunk_size):
            hidden = selected[start : start + chunk_size]  # [n, d]
            logits = lm_head(hidden).double()  # [n, V]
            probs = torch.softmax(logits, dim=-1)  # [n, V]
            target = targets[start : start + chunk_size]  # [n]
            if isinstance(lm_head, SoftCappedHead):  # d/dW through the cap: ((e_y - p) * slope)^T left
                slope = lm_head.slope(logits)  # [n, V]
                a = slope.gather(1, target[:, None]) * left[target] - (probs * slope) @ left  # [n, p]
            else:
                a = left[target] - probs @ left  # [n, p]: (e_y - p)^T left
            b = hidden.double() @ right  # [n, q]: h^T right
            owner = torch.nn.functional.one_hot(row_of[start : start + chunk_size], input_ids.shape[0])
            features += owner.double().T @ (a[:, :, None] * b[:, None, :]).flatten(1)  # [B, p*q], no atomics
        return features.cpu()


@dataclass(frozen=True)
class _ResponsePositions:
    """The hidden states that predict a response token, row by row, as int64 [N] indices on the
    model's device, found on the host from the CPU mask (a boolean index on the GPU would make the host
    wait for the decoder before it could launch the rest of the pass)."""

    rows: torch.Tensor  # [N] b: each one's row
    hidden: torch.Tensor  # [N] b * L + t into the [B * L] positions: the state at t predicts token t + 1
    predicting: torch.Tensor  # [N] b * (L - 1) + t into the [B * (L - 1)] positions that predict a token


def _response_positions(response_mask: torch.Tensor, device: torch.device) -> _ResponsePositions:
    """Where the response tokens of ``response_mask`` ([B, L], nonzero at response tokens) are
    predicted from; position 0 must be prompt."""
    mask = response_mask.to("cpu", torch.bool)
    if mask[:, 0].any():
        rows = torch.nonzero(mask[:, 0]).flatten().tolist()
        raise ValueError(
            f"response_mask marks position 0 as a response token in rows {rows}; the first response "
            "token must follow at least one prompt token that predicts it (see tokenize.encode_prompt)"
        )
    length = mask.shape[1]
    rows, positions = mask[:, 1:].nonzero(as_tuple=True)  # [N], [N]: token t + 1 of row b is a response token
    at = to_device(torch.stack([rows, rows * length + positions, rows * (length - 1) + positions]), device)  # [3, N]
    return _ResponsePositions(*at.unbind(0))


UNMASKED_MODELS = ("qwen2", "qwen3")
"""Model types whose decoder runs right-padded whole rows without a mask (`_whole_rows_mask`; checked
against transformers' own results with the 2D mask in tests/test_lm_logprobs.py); other models get the
2D mask and transformers builds theirs, reading it back from the device first."""


def _refuse_pads_before_real_tokens(mask: torch.Tensor) -> None:
    """Refuse a [B, L] CPU mask (1 at real tokens) with a pad before a real token in some row."""
    pad_before_real = (mask[:, 1:] > mask[:, :-1]).any(1)  # [B]
    if bool(pad_before_real.any()):
        rows = torch.nonzero(pad_before_real).flatten().tolist()
        raise ValueError(f"the attention mask has a pad before a real token in rows {rows[:10]}; moplex's passes "
                         "take right-padded rows (moplex_core.lm.tokenize.pad_batch)")


def _whole_rows_mask(model: PreTrainedModel | PeftModel, mask: torch.Tensor, on_device: torch.device | torch.Tensor
                     ) -> torch.Tensor | dict[str, None] | None:
    """The attention mask of a decoder pass over whole right-padded rows, ``mask`` [B, L] on the CPU
    (1 at real tokens), chosen on the host. The rows are right-padded, so under causal attention no
    real token sees a pad (every pad of a row comes after its real tokens), and what the pads' own
    positions compute nothing reads: their log-probs are masked, and the gradient they pass back is
    exactly zero. For `UNMASKED_MODELS` under SDPA on full-attention layers the pass therefore takes
    no mask, with or without padding: SDPA's causal attention, which on a GPU can run its flash kernel
    and its grouped-query path, where a [B, 1, L, L] padding mask sends it to a masked kernel and has
    transformers repeat the key/value heads. It is handed over per layer type, so that transformers
    takes it as it is: given none, it reads the position ids back from the device to look for packed
    sequences, and given a 2D mask, the mask, to see whether it has padding; either makes the host
    wait for the GPU. Otherwise the 2D mask on the device (``on_device``: the mask there already, or
    the device to copy it to), or None without padding."""
    _refuse_pads_before_real_tokens(mask)
    config = causal_lm_parts(model)[0].config
    if config.model_type in UNMASKED_MODELS and config._attn_implementation == "sdpa" and prefix_is_exact(model):
        return {"full_attention": None}
    if bool(mask.all()):
        return None
    return to_device(mask, on_device) if isinstance(on_device, torch.device) else on_device


def _continuation_mask(model: PreTrainedModel | PeftModel, prefix: PromptPrefix, mask: torch.Tensor,
                       device: torch.device) -> torch.Tensor | dict[str, CausalBias]:
    """The attention mask of a pass that continues ``prefix`` with right-padded rows, ``mask`` [B, L]
    on the CPU (1 at real tokens). Its queries sit after the P prefix keys, so causal attention is
    aligned to the bottom right: query t sees keys 0..P + t. When no prefix is padded, that is the
    whole mask for `UNMASKED_MODELS` under SDPA (the rows' own pads come after their real tokens, as
    in `_whole_rows_mask`): a `causal_lower_right` bias, which SDPA runs with its flash kernel on a
    GPU in bf16/fp16 (its memory-efficient one in float32) and no [B, 1, P + L, L] mask. Otherwise the
    [B, P + L] 2D mask of the prefix's and the rows' real tokens, from which transformers builds a 4D
    mask (a masked kernel). Both repeat the key/value heads (transformers gives SDPA its grouped-query
    path only without a mask). One query is left to the 2D mask: transformers folds the heads of a
    single query into its query axis, which a bottom-right bias would misalign."""
    config = causal_lm_parts(model)[0].config
    if (not prefix.padded and mask.shape[1] > 1 and config.model_type in UNMASKED_MODELS
            and config._attn_implementation == "sdpa" and prefix_is_exact(model)):
        _refuse_pads_before_real_tokens(mask)
        return {"full_attention": _bottom_right_causal(mask.shape[1], prefix.attention_mask.shape[1] + mask.shape[1])}
    return torch.cat([prefix.attention_mask, to_device(mask, device).to(prefix.attention_mask)], dim=1)


@functools.lru_cache(maxsize=16)
def _bottom_right_causal(queries: int, keys: int) -> CausalBias:
    """SDPA's bottom-right causal bias for ``queries`` queries after ``keys - queries`` earlier keys,
    made once per shape (its wrapped tensor is an unfilled [2, queries, keys] allocation)."""
    # A Tensor subclass cannot be made under a TorchDispatchMode (a FlopCounterMode, an op count),
    # where the raw tensor it wraps comes back already wrapped; make it outside any such mode.
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def _response_hidden(
    model: PreTrainedModel | PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    inputs_embeds: torch.Tensor | None,
    prefix: PromptPrefix | None,
) -> tuple[torch.Tensor, torch.Tensor, _ResponsePositions, nn.Module]:
    """The decoder pass of `sequence_logprobs`: (the final hidden states that predict a response
    token [N, d], those tokens int64 [N], where they sit, ``lm_head``)."""
    device = input_ids.device
    at = _response_positions(response_mask, device)
    decoder, lm_head = causal_lm_parts(model)
    inputs = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    if prefix is None:
        attention_mask = _whole_rows_mask(model, attention_mask.to("cpu"), device)
    else:
        positions = torch.arange(input_ids.shape[1], device=device)
        inputs.update({_cache_name(decoder): prefix.cache}, position_ids=prefix.lengths[:, None] + positions[None, :])
        attention_mask = _continuation_mask(model, prefix, attention_mask.to("cpu"), device)
    hidden = decoder(**inputs, attention_mask=attention_mask, use_cache=False).last_hidden_state  # [B, L, d]
    if prefix is not None:
        # The cache is single use: drop what it holds now, every layer's prefix and continuation keys and
        # values. Attention's backward saved what it needs; a checkpointed layer keeps the cache object.
        for layer in prefix.cache.layers:
            layer.keys = layer.values = None
    return hidden.flatten(0, 1)[at.hidden], input_ids.flatten()[at.hidden + 1], at, lm_head


def _target_logprobs(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, acc_dtype: torch.dtype,
    others: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(lm_head(hidden))[target] [n], and with ``others`` [n, K] (-1: none) each other
    token's log-prob less the target's [n, K], 0 where none, without a graph) for [n, d] hidden
    states and [n] targets."""
    logits = lm_head(hidden).to(acc_dtype)  # [n, V]; bf16 matmul, fp32 normalisation (DESIGN 5.5)
    own = logits.gather(1, targets[:, None])  # [n, 1]
    logp = own.squeeze(1) - torch.logsumexp(logits, dim=-1)
    if others is None:
        return logp, None
    with torch.no_grad():  # the normaliser cancels: logit(other) - logit(target)
        gained = logits.gather(1, others.clamp(min=0)) - own  # [n, K]
        return logp, torch.where(others >= 0, gained, 0.0)
