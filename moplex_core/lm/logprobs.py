"""Sequence log-probabilities log pi(y|x) at response positions only, in chunks (DESIGN 5.1, 5.5).

    log pi(y|x) = sum_{t in response} log p(token_t | tokens_<t)

summed over the response tokens and its EOS; prompt and padding positions are masked. The decoder
runs once over the whole sequence, but the vocabulary projection (``lm_head``) and the softmax only
touch the hidden states that predict a response token, ``chunk_size`` of them at a time. A naive
full-vocabulary log_softmax would hold a [B, L, V] float32 tensor (Qwen3: V = 151,936, so 5 GB for
8 x 1024 tokens); here at most [chunk_size, V] logits exist at once, and under autograd each chunk is
recomputed in the backward pass instead of being kept.

Works for a Hugging Face causal LM, with or without moplex's `MultiLoRA` adapters (routed per row,
moplex_core.lm.multi_lora), and for a PEFT ``PeftModel`` wrapping one: PEFT injects its LoRA layers
into the wrapped model's modules, so calling its decoder and ``lm_head`` directly applies the active
adapter (the tests and benchmarks compare against it).
"""

from __future__ import annotations

import torch
from peft import PeftModel
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def causal_lm_parts(model: PreTrainedModel | PeftModel) -> tuple[nn.Module, nn.Module]:
    """The decoder (token embeddings -> last hidden states) and ``lm_head`` of a causal LM."""
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    for transform in ("final_logit_softcapping", "logit_scale"):
        # Applied in the ForCausalLM forward after lm_head (Gemma 2/3, Cohere); skipping it here
        # would give wrong log-probs without any error.
        if getattr(causal_lm.config, transform, None) not in (None, 1.0):
            raise ValueError(
                f"{type(causal_lm).__name__} rescales its logits after lm_head ({transform}), which "
                "response-only chunked log-probs do not reproduce; use a model without it (Qwen, "
                "Llama, Mistral, Gemma 1)"
            )
    lm_head = causal_lm.get_output_embeddings()
    if lm_head is None:
        raise ValueError(
            f"{type(causal_lm).__name__} has no output embeddings (lm_head); load the model with "
            "AutoModelForCausalLM, not AutoModel"
        )
    return causal_lm.get_decoder(), lm_head


def embed(model: PreTrainedModel | PeftModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Input embeddings h(x, y) of ``input_ids`` [B, L] -> [B, L, d], to pass as ``inputs_embeds``.

    Take gradients w.r.t. the returned tensor (detach it and set requires_grad) for DESIGN 5.4.
    """
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    return causal_lm.get_input_embeddings()(input_ids)


def sequence_logprobs(
    model: PreTrainedModel | PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    inputs_embeds: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """log pi(y|x) of each sequence: float32 [B] (float64 [B] for a float64 model).

    input_ids:      int64 [B, L]; the targets whose log-probs are summed (always needed, also
                    when the forward pass reads ``inputs_embeds``).
    attention_mask: [B, L], 1 at real tokens (right padding, see moplex_core.lm.tokenize).
    response_mask:  [B, L], nonzero at response tokens (EOS included); position 0 must be prompt.
    inputs_embeds:  [B, L, d] or None; when given the decoder runs on it instead of embedding
                    ``input_ids`` (gradients w.r.t. it, DESIGN 5.4).
    chunk_size:     response positions projected to the vocabulary at a time.

    Differentiable w.r.t. ``inputs_embeds`` and the model's (LoRA) parameters.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    response_mask = response_mask.bool()
    if response_mask[:, 0].any():
        rows = torch.nonzero(response_mask[:, 0]).flatten().tolist()
        raise ValueError(
            f"response_mask marks position 0 as a response token in rows {rows}; the first response "
            "token must follow at least one prompt token that predicts it (see tokenize.encode_prompt)"
        )
    decoder, lm_head = causal_lm_parts(model)
    if inputs_embeds is None:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    else:
        hidden = decoder(inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False)
    hidden = hidden.last_hidden_state  # [B, L, d]
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32

    # The hidden state at t predicts the token at t + 1.
    predicts_response = response_mask[:, 1:]  # bool [B, L-1]
    selected = hidden[:, :-1][predicts_response]  # [N, d], N = response tokens in the batch
    targets = input_ids[:, 1:][predicts_response]  # [N]

    # Under autograd keep only each chunk's [n, d] input; its [n, V] logits are recomputed in backward.
    recompute = torch.is_grad_enabled() and (
        selected.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    chunks = []
    for start in range(0, targets.shape[0], chunk_size):
        end = start + chunk_size
        args = (lm_head, selected[start:end], targets[start:end], acc_dtype)
        if recompute:
            chunks.append(checkpoint(_target_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_target_logprobs(*args))
    token_logprobs = torch.cat(chunks) if chunks else selected.new_zeros(0, dtype=acc_dtype)  # [N]

    # Scatter back to [B, L-1] and sum per row: deterministic, unlike index_add on CUDA.
    per_position = torch.zeros(predicts_response.shape, dtype=acc_dtype, device=hidden.device)
    return per_position.masked_scatter(predicts_response, token_logprobs).sum(dim=1)  # [B]


def _target_logprobs(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, acc_dtype: torch.dtype
) -> torch.Tensor:
    """log softmax(lm_head(hidden))[target] for [n, d] hidden states and [n] targets -> [n]."""
    logits = lm_head(hidden).to(acc_dtype)  # [n, V]; bf16 matmul, fp32 normalisation (DESIGN 5.5)
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
