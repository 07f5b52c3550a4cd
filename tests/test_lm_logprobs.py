"""Chunked response-only log-probs equal the full-vocabulary computation, and differentiate correctly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lm_fixtures import tiny_model_dir  # noqa: F401 (session fixture)
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel

from moplex_core.lm.loading import load_model, load_tokenizer
from moplex_core.lm.logprobs import causal_lm_parts, embed, output_score_features, prompt_prefix, sequence_logprobs
from moplex_core.lm.tokenize import PaddedBatch, pad_batch, tokenize_responses

PROMPTS = {
    "Rank by criterion 0: which list is best?": ["3 1 4", "1 5 9 2 6 5 3", "8"],
    "Rank by criterion 2: which list is worst?": ["2 7 1 8 2 8", "0 0"],
}


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path) -> PaddedBatch:
    tokenizer = load_tokenizer(tiny_model_dir)
    sequences = [seq for p, texts in PROMPTS.items() for seq in tokenize_responses(tokenizer, p, texts)]
    return pad_batch(sequences, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def model64(tiny_model_dir: Path) -> PreTrainedModel:
    return load_model(tiny_model_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def model32(tiny_model_dir: Path) -> PreTrainedModel:
    return load_model(tiny_model_dir, dtype="float32")


def score(model: torch.nn.Module, batch: PaddedBatch, **kwargs: object) -> torch.Tensor:
    return sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask, **kwargs)


def full_vocab_logprobs(model: torch.nn.Module, batch: PaddedBatch, **inputs: torch.Tensor) -> torch.Tensor:
    """Reference: float64 log_softmax over the whole [B, L, V] logits, masked to the response."""
    inputs = inputs or {"input_ids": batch.input_ids}
    logits = model(**inputs, attention_mask=batch.attention_mask).logits.double()  # [B, L, V]
    token_logp = logits[:, :-1].log_softmax(-1).gather(2, batch.input_ids[:, 1:, None]).squeeze(2)  # [B, L-1]
    return (token_logp * batch.response_mask[:, 1:]).sum(1)  # [B]


@torch.no_grad()
def test_chunked_logprobs_equal_the_full_vocabulary_reference(model64, model32, batch) -> None:
    reference = full_vocab_logprobs(model64, batch)
    logp64, logp32 = score(model64, batch, chunk_size=5), score(model32, batch, chunk_size=5)
    assert logp64.dtype == torch.float64 and logp32.dtype == torch.float32
    assert logp64.shape == (batch.input_ids.shape[0],)
    torch.testing.assert_close(logp64, reference, rtol=0, atol=1e-10)
    torch.testing.assert_close(logp32.double(), reference, rtol=0, atol=1e-4)
    assert (logp64 < 0).all()


@torch.no_grad()
def test_chunk_size_does_not_change_the_result(model64, batch) -> None:
    results = [score(model64, batch, chunk_size=size) for size in (1, 3, 7, 1024)]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=0, atol=1e-12)


@torch.no_grad()
def test_vocabulary_projection_only_sees_response_positions_a_chunk_at_a_time(model32, batch) -> None:
    _, lm_head = causal_lm_parts(model32)
    projected: list[tuple[int, ...]] = []
    handle = lm_head.register_forward_hook(lambda _, args, __: projected.append(tuple(args[0].shape)))
    try:
        score(model32, batch, chunk_size=4)
    finally:
        handle.remove()
    assert all(len(shape) == 2 and shape[0] <= 4 for shape in projected)
    assert sum(shape[0] for shape in projected) == int(batch.response_mask.sum())


def test_backward_keeps_no_vocabulary_sized_tensor(model32, batch) -> None:
    vocab_size = model32.config.vocab_size
    saved_shapes: list[tuple[int, ...]] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        saved_shapes.append(tuple(tensor.shape))
        return tensor

    inputs_embeds = embed(model32, batch.input_ids).detach().requires_grad_(True)  # [B, L, d]
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        logp = score(model32, batch, inputs_embeds=inputs_embeds, chunk_size=4)
    logp.sum().backward()
    assert inputs_embeds.grad is not None and saved_shapes
    # Each chunk's logits [n, V] are recomputed in backward, so autograd keeps nothing of width V.
    assert not [shape for shape in saved_shapes if shape[-1] == vocab_size]


@torch.no_grad()
def test_padding_and_batch_neighbours_do_not_change_a_sequences_logprob(model64, model32, batch) -> None:
    for model, tolerance in ((model64, 1e-10), (model32, 1e-5)):
        in_batch = score(model, batch)
        for row in range(batch.input_ids.shape[0]):
            n = int(batch.attention_mask[row].sum())
            alone = PaddedBatch(
                input_ids=batch.input_ids[row : row + 1, :n],
                attention_mask=batch.attention_mask[row : row + 1, :n],
                response_mask=batch.response_mask[row : row + 1, :n],
            )
            torch.testing.assert_close(in_batch[row : row + 1], score(model, alone), rtol=0, atol=tolerance)


@pytest.mark.parametrize("rows", [[0, 0, 1, 1, 1], [0, 0], [0, 0, 0], [0, 1, 0], [1, 0], [1, 1]])
@torch.no_grad()
def test_a_prompt_prefix_gives_each_row_its_own_groups_keys_and_values(tiny_model_dir, model64, rows) -> None:
    # Row b continues prefix rows[b], whatever the order: runs of groups in order are broadcast, and
    # any other order is indexed (transformers' batch_select_indices). [0, 0] and [0, 0, 0] leave the
    # second prefix to no row, which is dropped, not handed to row 1 nor a reason to fail.
    from transformers import DynamicCache

    tokenizer = load_tokenizer(tiny_model_dir)
    prefixes = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(prefixes[0]) != len(prefixes[1])  # the shorter one is padded in the shared pass
    alone = [prompt_prefix(model64, [p], torch.tensor([0]), tokenizer.pad_token_id).cache for p in prefixes]
    indexed = []
    select = DynamicCache.batch_select_indices
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DynamicCache, "batch_select_indices", lambda cache, i: indexed.append(i) or select(cache, i))
        shared = prompt_prefix(model64, prefixes, torch.tensor(rows), tokenizer.pad_token_id)
    in_runs = rows == sorted(rows) and rows[0] == 0
    assert bool(indexed) != in_runs
    assert shared.lengths.tolist() == [len(prefixes[g]) for g in rows]
    for layer, (whole, part) in enumerate(zip(shared.cache.layers, zip(*(c.layers for c in alone)), strict=True)):
        for b, g in enumerate(rows):
            n = len(prefixes[g])
            assert whole.keys.shape[0] == len(rows) and shared.attention_mask[b].sum() == n
            torch.testing.assert_close(whole.keys[b, :, :n], part[g].keys[0], rtol=0, atol=1e-12, msg=f"layer {layer}")
            torch.testing.assert_close(whole.values[b, :, :n], part[g].values[0], rtol=0, atol=1e-12)


def test_gradient_wrt_input_embeddings_matches_the_reference_and_finite_differences(model64, batch) -> None:
    inputs_embeds = embed(model64, batch.input_ids).detach().requires_grad_(True)  # [B, L, d]

    def total_logp(embeds: torch.Tensor) -> torch.Tensor:
        return score(model64, batch, inputs_embeds=embeds, chunk_size=4).sum()

    (grad,) = torch.autograd.grad(total_logp(inputs_embeds), inputs_embeds)  # [B, L, d]
    assert grad.abs().sum() > 0
    # Right padding: nothing after a sequence's end can influence it.
    assert (grad[batch.attention_mask == 0] == 0).all()

    reference_embeds = inputs_embeds.detach().requires_grad_(True)
    reference = full_vocab_logprobs(model64, batch, inputs_embeds=reference_embeds).sum()
    (reference_grad,) = torch.autograd.grad(reference, reference_embeds)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=1e-10)

    # Qwen3's RMSNorm computes in float32 even in a float64 model, which puts ~1e-5 of noise on a
    # central difference; a wrong gradient is off by far more than the 1e-3 allowed.
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(inputs_embeds.shape, generator=generator, dtype=torch.float64)
    eps = 1e-4
    with torch.no_grad():
        step = eps * direction
        finite_difference = (total_logp(inputs_embeds + step) - total_logp(inputs_embeds - step)) / (2 * eps)
    torch.testing.assert_close(finite_difference, (grad * direction).sum(), rtol=1e-3, atol=0)


@torch.no_grad()
def test_inputs_embeds_from_embed_give_the_same_logprobs_as_input_ids(model64, batch) -> None:
    from_embeds = score(model64, batch, inputs_embeds=embed(model64, batch.input_ids))
    torch.testing.assert_close(from_embeds, score(model64, batch), rtol=0, atol=1e-12)


def test_peft_model_scores_with_its_adapter_and_as_reference_without_it(tiny_model_dir, model64, batch):
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)  # init_lora_weights=False draws A and B at random so the adapter moves the scores
    policy = get_peft_model(load_model(tiny_model_dir, dtype=torch.float64), lora)

    policy_logp = score(policy, batch, chunk_size=4)
    with torch.no_grad():
        full_vocab = full_vocab_logprobs(policy, batch)
        torch.testing.assert_close(policy_logp.detach(), full_vocab, rtol=0, atol=1e-10)
        with policy.disable_adapter():
            reference_logp = score(policy, batch)
    torch.testing.assert_close(reference_logp, score(model64, batch).detach(), rtol=0, atol=1e-10)
    assert (policy_logp.detach() - reference_logp).abs().max() > 1e-3

    policy_logp.sum().backward()
    lora_grads = [p.grad for name, p in policy.named_parameters() if "lora_" in name]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    assert all(p.grad is None for name, p in policy.named_parameters() if "lora_" not in name)


@torch.no_grad()
@torch.no_grad()
def test_bfloat16_weights_accumulate_in_float32(tiny_model_dir, model32, batch) -> None:
    """The bf16 model's own logits (its matmuls round in bf16), normalised and summed in float32: they
    agree with the same logits normalised in float64 to float32 rounding, where bf16 normalisation or a
    bf16 sum would be off by about 1e-2."""
    model16 = load_model(tiny_model_dir, dtype=torch.bfloat16)
    logp16 = score(model16, batch)
    assert logp16.dtype == torch.float32
    torch.testing.assert_close(logp16.double(), full_vocab_logprobs(model16, batch), rtol=0, atol=1e-4)
    torch.testing.assert_close(logp16, score(model32, batch), rtol=0.05, atol=0.1)  # and near the float32 model


def test_a_response_at_position_zero_is_refused(model32, batch) -> None:
    response_mask = batch.response_mask.clone()
    response_mask[1, 0] = True
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        sequence_logprobs(model32, batch.input_ids, batch.attention_mask, response_mask)


def test_output_score_features_are_the_projected_lm_head_gradient_of_each_row(model64, batch) -> None:
    """Row b equals left^T (d log pi(y_b|x_b) / dW) right by autograd, W the output layer's weight as
    the output layer alone uses it (the tiny model ties it to the input embeddings), in several chunks."""
    decoder, lm_head = causal_lm_parts(model64)
    vocab, hidden = lm_head.weight.shape
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(vocab, 3, generator=generator, dtype=torch.float64)  # [V, p]
    right = torch.randn(hidden, 4, generator=generator, dtype=torch.float64)  # [d, q]
    features = output_score_features(model64, batch.input_ids, batch.attention_mask, batch.response_mask,
                                     left, right, chunk_size=4)  # [B, p*q]
    assert features.shape == (batch.input_ids.shape[0], 12) and features.dtype == torch.float64
    with torch.no_grad():
        states = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state  # [B, L, d]
    weight = lm_head.weight.detach().clone().requires_grad_(True)  # [V, d]
    for row in range(batch.input_ids.shape[0]):
        predicts = batch.response_mask[row, 1:]  # [L-1]
        token_logp = (states[row, :-1][predicts] @ weight.T).log_softmax(-1)  # [T, V]
        logp = token_logp.gather(1, batch.input_ids[row, 1:][predicts][:, None]).sum()
        (gradient,) = torch.autograd.grad(logp, weight)  # [V, d]
        torch.testing.assert_close(features[row], (left.T @ gradient @ right).flatten(), rtol=1e-9, atol=1e-10)


def _random_qwen2(vocab_size: int) -> PreTrainedModel:
    """A tiny Qwen2 with random weights (seeded), the other family of UNMASKED_MODELS."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("padded", [True, False])
def test_whole_rows_without_a_mask_give_transformers_own_results(model32, batch, padded, family) -> None:
    # _whole_rows_mask hands the decoder no mask, padded or not (right padding: no real token sees a
    # pad): at every real token the hidden states are those transformers computes with the 2D mask, to
    # the bit, and so are the log-probs.
    from moplex_core.lm.logprobs import UNMASKED_MODELS, _whole_rows_mask

    model = model32 if family == "qwen3" else _random_qwen2(model32.config.vocab_size)
    assert model.config.model_type == family and family in UNMASKED_MODELS
    if not padded:  # every row as long as the longest: no padding
        batch = PaddedBatch(batch.input_ids, torch.ones_like(batch.attention_mask), batch.response_mask)
    assert bool(batch.attention_mask.all()) != padded
    decoder, _ = causal_lm_parts(model)
    assert _whole_rows_mask(model, batch.attention_mask, batch.attention_mask.device) == {"full_attention": None}
    real = batch.attention_mask.bool()  # [B, L]
    with torch.no_grad():
        ours = decoder(input_ids=batch.input_ids, attention_mask={"full_attention": None}).last_hidden_state
        theirs = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        assert torch.equal(ours[real], theirs[real])
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
    token_logp = logits[:, :-1].log_softmax(-1).gather(2, batch.input_ids[:, 1:, None]).squeeze(2)  # [B, L-1]
    torch.testing.assert_close(score(model, batch).double(), (token_logp * batch.response_mask[:, 1:]).sum(1),
                               rtol=0, atol=1e-4)


def test_a_pad_before_a_real_token_is_refused(model32, batch) -> None:
    # Without a mask a left pad would be attended: a left-padded batch is refused, naming its rows.
    pads = (1 - batch.attention_mask).sum(1).tolist()  # [B]
    left = PaddedBatch(*(torch.stack([row.roll(n) for row, n in zip(part, pads)])  # each row's pads moved first
                         for part in (batch.input_ids, batch.attention_mask, batch.response_mask)))
    padded_rows = [b for b, n in enumerate(pads) if n]
    assert padded_rows and not left.attention_mask[padded_rows, 0].any()
    with pytest.raises(ValueError, match=re.escape(f"pad before a real token in rows {padded_rows}")):
        score(model32, left)


def _random_gemma2(vocab_size: int, cap: float) -> PreTrainedModel:
    """A tiny Gemma 2 in float64 with random weights (seeded) large enough that ``cap`` bends its logits:
    final logit soft-capping, attention soft-capping (eager attention), sliding-window layers."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=cap)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)  # tied: logits of a few units before the cap
    return model


def test_a_soft_capped_model_gives_its_own_log_probs_gradients_and_output_features(model32, batch) -> None:
    """Gemma 2 soft-caps its logits after lm_head (cap tanh(logits / cap)): the chunked log-probs, their
    input-embedding gradients and the output-layer features equal transformers' own forward and autograd."""
    model = _random_gemma2(model32.config.vocab_size, cap=2.0)
    decoder, lm_head = causal_lm_parts(model)
    with torch.no_grad():
        states = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        raw = lm_head.head(states[batch.attention_mask.bool()])  # [N, V] before the cap
    assert raw.abs().max() > 4.0  # the cap bends them
    inputs_embeds = embed(model, batch.input_ids).detach().requires_grad_(True)  # [B, L, d]
    ours = score(model, batch, inputs_embeds=inputs_embeds, chunk_size=3)
    (ours_grad,) = torch.autograd.grad(ours.sum(), inputs_embeds)
    reference_embeds = inputs_embeds.detach().clone().requires_grad_(True)
    reference = full_vocab_logprobs(model, batch, inputs_embeds=reference_embeds)
    (reference_grad,) = torch.autograd.grad(reference.sum(), reference_embeds)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-10)
    torch.testing.assert_close(ours_grad, reference_grad, rtol=0, atol=1e-10)
    plain = full_vocab_logprobs(_random_gemma2(model32.config.vocab_size, cap=None), batch).detach()
    assert (plain - reference.detach()).abs().max() > 1.0  # without the cap: other log-probs
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(lm_head.head.weight.shape[0], 3, generator=generator, dtype=torch.float64)  # [V, p]
    right = torch.randn(lm_head.head.weight.shape[1], 4, generator=generator, dtype=torch.float64)  # [d, q]
    features = output_score_features(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                     left, right, chunk_size=4)  # [B, p*q]
    weight = lm_head.head.weight.detach().clone().requires_grad_(True)  # [V, d]
    for row in range(batch.input_ids.shape[0]):
        predicts = batch.response_mask[row, 1:]  # [L-1]
        capped = 2.0 * torch.tanh(states[row, :-1][predicts] @ weight.T / 2.0)  # [T, V]
        logp = capped.log_softmax(-1).gather(1, batch.input_ids[row, 1:][predicts][:, None]).sum()
        (gradient,) = torch.autograd.grad(logp, weight)  # [V, d]
        torch.testing.assert_close(features[row], (left.T @ gradient @ right).flatten(), rtol=1e-9, atol=1e-10)


def test_soft_capping_runs_in_float32_on_a_bf16_head() -> None:
    """A bf16 head's logits are capped in float32, against a float64 reference of the same logits."""
    from moplex_core.lm.logprobs import SoftCappedHead

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)  # [V = 40, d = 16]
    hidden = (4 * torch.randn(5, 16)).to(torch.bfloat16)  # [n, d]
    capped = SoftCappedHead(head, cap=30.0)(hidden)  # [n, V]
    reference = 30.0 * torch.tanh(head(hidden).double() / 30.0)
    assert capped.dtype == torch.float32
    torch.testing.assert_close(capped.double(), reference, rtol=0, atol=1e-5)
