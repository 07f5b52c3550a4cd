"""Anchor estimation (paper Algorithm 1, DESIGN 5.4) on the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lm_fixtures import MetaReadsAsZeros, float64_rmsnorm, prompt_pass_counts, tiny_model_dir  # noqa: F401

from moplex_core.estimate import (
    estimation_error,
    anchor_indices,
    anchor_pass,
    apply_offsets,
    contraction,
    embedding_distance,
    estimate_delta,
    estimate_offsets,
    hold_estimates,
    nearest_anchor_weights,
    reference_terms_batch,
    response_embeddings,
)
from moplex_core.em import Rankings
from moplex_core.lm.loading import load_model, load_tokenizer
from moplex_core.lm.logprobs import embed, sequence_logprobs
from moplex_core.lm.tokenize import TokenizedResponse, pad_batch, tokenize_responses
from moplex_core.pl import PAD

RESPONSES = ["[3, 1, 2]", "[5, 0, 2, 7]", "[1, 1]", "[-4, -2, -9]"]


@pytest.fixture(scope="module")
def model64(tiny_model_dir):  # noqa: F811
    return load_model(tiny_model_dir, dtype=torch.float64), load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("groups", [None, [0, 0, 0, 0]])  # rows whole, and continuing one shared prompt pass
def test_target_terms_are_the_other_responses_tokens_scored_in_the_anchors_contexts(model64, groups):
    # u[i][j] = sum over t < min(n_i, n_j) of log p(y_j[t] | x, y_i[:t]) - log p(y_i[t] | x, y_i[:t]),
    # from transformers' own full logits of row i alone, in float64.
    model, tokenizer = model64
    seqs = tokenize_responses(tokenizer, "Which list is best?", RESPONSES)
    start = seqs[0].response_start  # an alternative of token id 0 (a token like any other: Qwen's "!")
    zeros = TokenizedResponse(seqs[0].input_ids[:start] + [0, 5, 0, tokenizer.eos_token_id], start)
    passed = anchor_pass(model, seqs, tokenizer.pad_token_id, input_grads=True, groups=groups,
                         alternatives=[[*seqs, zeros]] * len(seqs))
    assert passed.target_terms.shape == (len(seqs), len(seqs) + 1) and passed.target_terms.dtype == torch.float64
    for i, anchor in enumerate(seqs):
        with torch.no_grad():
            logits = model(torch.tensor([anchor.input_ids])).logits[0].double()  # [L, V]
        logp = torch.log_softmax(logits, dim=-1)
        start, own = anchor.response_start, anchor.input_ids[anchor.response_start :]
        for j, other in enumerate([*seqs, zeros]):
            tokens = other.input_ids[other.response_start :]
            expected = sum(logp[start + t - 1, tokens[t]] - logp[start + t - 1, own[t]]
                           for t in range(min(len(own), len(tokens))))
            torch.testing.assert_close(passed.target_terms[i, j], torch.as_tensor(expected, dtype=torch.float64),
                                       rtol=1e-6, atol=1e-6)
        assert passed.target_terms[i, i] == 0
    emb, lengths = response_embeddings(model, seqs)
    first_order = passed.first_order(slice(1, 3), torch.tensor([1, 2]), emb, lengths)  # [2, M]
    torch.testing.assert_close(first_order, contraction(passed.input_grads[1:3], torch.tensor([1, 2]), emb, lengths)
                               + passed.target_terms[1:3, : len(seqs)])  # the example's own responses


def test_first_order_term_equals_a_finite_difference_along_the_embedding_direction(model64):
    model, tokenizer = model64
    seqs = tokenize_responses(tokenizer, "Which list is best?", RESPONSES)
    ref = anchor_pass(model, seqs, tokenizer.pad_token_id, input_grads=True)
    emb, lengths = response_embeddings(model, seqs)
    emb = emb.double()
    s = contraction(ref.input_grads.double(), torch.arange(len(seqs)), emb, lengths)  # [M, M]
    for i, j in [(0, 1), (1, 2), (3, 0)]:
        batch = pad_batch([seqs[i]], tokenizer.pad_token_id)
        h = embed(model, batch.input_ids).detach()  # [1, L, d]
        direction = torch.zeros_like(h)
        cut, start = int(min(lengths[i], lengths[j])), seqs[i].response_start
        direction[0, start : start + cut] = emb[j, :cut] - emb[i, :cut]

        def logp(x):
            return sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                     inputs_embeds=x).item()

        def central(eps):
            return (logp(h + eps * direction) - logp(h - eps * direction)) / (2 * eps)

        # Qwen3's RMSNorm computes in float32 even in a float64 model, so a tiny step drowns in
        # rounding; Richardson extrapolation of two moderate steps cancels the eps^2 term instead.
        finite_difference = (4 * central(0.01) - central(0.02)) / 3
        assert s[i, j].item() == pytest.approx(finite_difference, rel=2e-3, abs=1e-5)
    torch.testing.assert_close(s.diagonal(), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)


def test_estimates_equal_exact_scores_when_every_response_is_an_anchor():
    ref_logp = torch.tensor([-3.0, -4.0, -2.5], dtype=torch.float64)
    exact = torch.tensor([-2.9, -4.2, -2.4], dtype=torch.float64)
    every = torch.arange(3)
    for mode in ("delta", "logpi"):
        delta = estimate_delta(mode, every, exact, None, ref_logp,
                               torch.randn(3, 3, generator=torch.Generator().manual_seed(0)))
        torch.testing.assert_close(delta, exact - ref_logp)


def test_delta_mode_is_exact_for_the_reference_and_logpi_mode_adds_the_cached_reference():
    ref_logp = torch.tensor([-3.0, -4.0, -2.5], dtype=torch.float64)
    s_ref = torch.tensor([[0.0, -0.7, 0.4], [0.2, 0.0, 0.1], [0.3, -0.5, 0.0]], dtype=torch.float64)
    anchors = torch.tensor([0, 2])
    # A policy equal to the reference: delta mode gives exactly 0 everywhere.
    at_ref = estimate_delta("delta", anchors, ref_logp[anchors], s_ref[anchors], ref_logp, s_ref)
    torch.testing.assert_close(at_ref, torch.zeros(3, dtype=torch.float64))
    logpi = estimate_delta("logpi", anchors, ref_logp[anchors], s_ref[anchors], ref_logp, s_ref)
    expected = ((ref_logp[0] + s_ref[0, 1]) + (ref_logp[2] + s_ref[2, 1])) / 2 - ref_logp[1]
    assert logpi[1].item() == pytest.approx(expected.item())
    assert logpi[0] == 0 and logpi[2] == 0


def test_the_nearest_weighting_is_the_estimate_of_the_anchor_closest_in_embedding_space():
    generator = torch.Generator().manual_seed(1)
    m, anchors = 6, torch.tensor([1, 4])
    emb = torch.randn(m, 5, 3, generator=generator)  # [M, T, d]
    emb[2] = emb[4] + 0.01  # response 2 sits by anchor 4; a response whose tail is absent counts that tail in full
    emb[5, 3:] = 0.0
    emb[5, :3] = emb[1, :3]
    weights = nearest_anchor_weights(anchors, emb)  # [a, M]
    distance = torch.stack([(emb - emb[i]).flatten(1).double().norm(dim=1) for i in anchors.tolist()])  # [a, M]
    assert torch.equal(weights, torch.nn.functional.one_hot(distance.argmin(0), 2).T.double())
    assert weights[:, anchors].diag().tolist() == [1.0, 1.0] and weights[1, 2] == 1
    ref_logp = -5 * torch.rand(m, generator=generator, dtype=torch.float64)
    s_ref = torch.randn(m, m, generator=generator, dtype=torch.float64)
    logp = ref_logp[anchors] + torch.randn(2, generator=generator, dtype=torch.float64)
    s_pol = torch.randn(2, m, generator=generator, dtype=torch.float64)
    delta = logp - ref_logp[anchors]
    nearest = distance.argmin(0).tolist()
    for mode in ("delta", "logpi"):
        alone = [estimate_delta(mode, anchors[[a]], logp[[a]], s_pol[[a]], ref_logp, s_ref) for a in range(2)]
        expected = torch.stack([alone[nearest[j]][j] for j in range(m)])
        expected[anchors] = delta
        torch.testing.assert_close(estimate_delta(mode, anchors, logp, s_pol, ref_logp, s_ref, weights), expected)
        uniform = torch.full((2, m), 0.5, dtype=torch.float64)  # weights of 1/a are the paper's mean
        torch.testing.assert_close(estimate_delta(mode, anchors, logp, s_pol, ref_logp, s_ref, uniform),
                                   estimate_delta(mode, anchors, logp, s_pol, ref_logp, s_ref))


def test_the_embedding_distance_counts_a_tail_only_one_response_has():
    generator = torch.Generator().manual_seed(2)
    emb = torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)  # [M, T, d]
    emb[0, 3:] = 0.0  # the anchor: 3 tokens
    emb[1, :3], emb[1, 5:] = emb[0, :3], 0.0  # the anchor's tokens and a tail of 2 the first-order term never sees
    full_norm = torch.tensor(10.0, dtype=torch.float64)
    distance = embedding_distance(emb.float(), 0, full_norm)  # [M]
    assert distance[0] == 0
    torch.testing.assert_close(distance[1], emb[1, 3:5].norm() / 10, rtol=1e-6, atol=0)
    torch.testing.assert_close(distance[2], (emb[2] - emb[0]).norm() / 10, rtol=1e-6, atol=0)


def test_offsets_plus_the_anchors_mean_delta_are_the_per_anchor_mean_of_algorithm_1():
    generator = torch.Generator().manual_seed(0)
    m, anchors = 6, torch.tensor([1, 4])
    ref_logp = -5 * torch.rand(m, generator=generator, dtype=torch.float64)
    s_ref = torch.randn(m, m, generator=generator, dtype=torch.float64)
    logp = ref_logp[anchors] + torch.randn(2, generator=generator, dtype=torch.float64)  # log pi_c at anchors
    s_pol = torch.randn(2, m, generator=generator, dtype=torch.float64)
    delta = logp - ref_logp[anchors]
    explicit = {
        "delta": torch.stack([delta[a] + s_pol[a] - s_ref[i] for a, i in enumerate(anchors.tolist())]).mean(0),
        "logpi": torch.stack([logp[a] + s_pol[a] for a in range(2)]).mean(0) - ref_logp,
    }
    for mode, expected in explicit.items():
        expected[anchors] = delta
        offsets = estimate_offsets(mode, anchors, s_pol, ref_logp, s_ref)
        assert offsets[anchors].abs().max() == 0
        torch.testing.assert_close(apply_offsets(anchors, delta, offsets), expected)
        torch.testing.assert_close(estimate_delta(mode, anchors, logp, s_pol, ref_logp, s_ref), expected)
    # The M-step's view: the anchors' deltas move (with their graph), the E-step's estimates stay.
    estimates = apply_offsets(anchors, delta, estimate_offsets("delta", anchors, s_pol, ref_logp, s_ref))
    moved = (delta + torch.tensor([0.3, -0.1], dtype=torch.float64)).requires_grad_(True)
    held = hold_estimates(anchors, moved, estimates)
    assert torch.equal(held[[0, 2, 3, 5]], estimates[[0, 2, 3, 5]]) and torch.equal(held[anchors], moved.detach())
    (grad,) = torch.autograd.grad(held.sum(), moved)
    assert torch.equal(grad, torch.ones(2, dtype=torch.float64))


def test_anchors_depend_only_on_seed_iteration_and_example():
    first = anchor_indices("ex-1", 8, 3, seed=0, iteration=2)
    assert np.array_equal(first, anchor_indices("ex-1", 8, 3, seed=0, iteration=2))
    assert len(set(first.tolist())) == 3 and np.all(np.diff(first) > 0)
    draws = {tuple(anchor_indices("ex-1", 8, 3, seed=0, iteration=t)) for t in range(10)}
    assert len(draws) > 1
    examples = {tuple(anchor_indices(f"ex-{i}", 8, 3, seed=0, iteration=2)) for i in range(40)}
    assert len(examples) > 10  # each example draws its own anchors (56 possible draws)
    seeds = {tuple(anchor_indices("ex-1", 8, 3, seed=s, iteration=2)) for s in range(10)}
    assert len(seeds) > 1
    assert np.array_equal(anchor_indices("ex-1", 8, None, 0, 0), np.arange(8))
    assert np.array_equal(anchor_indices("ex-1", 4, 9, 0, 0), np.arange(4))


def test_anchors_by_length_take_one_from_each_length_stratum():
    lengths = [8, 13, 8, 14, 8, 12, 8, 13]  # four originals of 8 tokens, four longer generated responses
    shortest, longest = {0, 2, 4, 6}, {1, 3, 5, 7}
    draws = [anchor_indices(f"ex-{i}", 8, 2, seed=0, iteration=1, lengths=lengths) for i in range(40)]
    assert all(len(shortest.intersection(d.tolist())) == len(longest.intersection(d.tolist())) == 1 for d in draws)
    assert len({tuple(d) for d in draws}) > 8  # each stratum's pick is drawn (16 possible draws)
    assert np.array_equal(draws[0], anchor_indices("ex-0", 8, 2, seed=0, iteration=1, lengths=lengths))
    for i in range(40):  # strata of 3, 3, 2 by length: 8 8 8 | 8 12 13 | 13 14
        three = anchor_indices(f"ex-{i}", 8, 3, seed=0, iteration=1, lengths=lengths)
        first, second, third = sorted(lengths[j] for j in three)
        assert first == 8 and second in (8, 12, 13) and third in (13, 14)
    ties = {tuple(anchor_indices(f"ex-{i}", 8, 2, 0, 1, [8] * 8)) for i in range(200)}
    assert len(ties) == 28  # equal lengths: any pair, the strata not cut by index (0-3 against 4-7)
    assert np.array_equal(anchor_indices("ex-1", 8, 1, 0, 1, lengths), anchor_indices("ex-1", 8, 1, 0, 1))
    assert np.array_equal(anchor_indices("ex-1", 8, 8, 0, 1, lengths), np.arange(8))
    with pytest.raises(ValueError, match="7 lengths for 8 responses"):
        anchor_indices("ex-1", 8, 2, 0, 1, lengths[:7])


def test_reference_terms_match_the_reference_log_probs(model64):
    model, tokenizer = model64
    seqs = tokenize_responses(tokenizer, "Which list is best?", RESPONSES)
    (ref_logp, s_ref), = reference_terms_batch(model, [seqs], tokenizer.pad_token_id)
    for j, seq in enumerate(seqs):
        batch = pad_batch([seq], tokenizer.pad_token_id)
        alone = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
        assert ref_logp[j].item() == pytest.approx(alone.item(), rel=1e-9)
    assert s_ref.shape == (4, 4) and s_ref.dtype == torch.float32


@pytest.mark.parametrize("order", ["groups interleaved", "groups in runs", "one group"])
@pytest.mark.parametrize("prompts", ["of different lengths", "of one length"])
def test_a_shared_prompt_pass_gives_the_whole_rows_log_probs_and_gradients(tiny_model_dir, float64_rmsnorm,  # noqa: F811
                                                                          monkeypatch, prompts, order):
    # Responses of different lengths, three adapters mixed in one batch, rows of one (prompt, adapter)
    # group not adjacent (indexed to their rows), each group's rows in one run (broadcast to them, as
    # moplex's passes run), or a single group: the prompt pass once per group must give what running
    # every row whole gives, for log pi, the input gradients and the LoRA gradients. Prompts of different lengths pad
    # the shorter prefix, and the continuation takes a 2D mask; prompts of one length leave no pad
    # before the continuation, which then runs under a bottom-right causal bias (the flash kernel on a GPU).
    from moplex_core.lm import logprobs
    from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA

    model, tokenizer = load_model(tiny_model_dir, dtype=torch.float64), load_tokenizer(tiny_model_dir)
    lora = MultiLoRA(model, 3, LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")), seed=2)
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.normal_(0, 0.2)
    short = tokenize_responses(tokenizer, "Best?", RESPONSES)
    other = "Which of these lists is the best one, and why?" if prompts == "of different lengths" else "Best!"
    long = tokenize_responses(tokenizer, other, RESPONSES[:3])
    assert (short[0].response_start != long[0].response_start) == (prompts == "of different lengths")
    assert short[0].input_ids[: short[0].response_start] != long[0].input_ids[: long[0].response_start]
    rows = [short[0], long[1], short[2], long[0], short[0], long[2], short[3]]
    adapters = [0, 1, 0, 1, 2, 1, 0]
    if order == "groups in runs":
        rows, adapters = [short[0], short[2], short[3], long[1], long[0], long[2], short[0]], [0, 0, 0, 1, 1, 1, 2]
    elif order == "one group":
        rows, adapters = [short[0], short[2], short[1], short[3]], [1] * 4
    groups = [(seq is short[0] or seq in short, c) for seq, c in zip(rows, adapters)]
    runs = sum(1 for r in range(len(groups)) if r == 0 or groups[r] != groups[r - 1])
    assert runs == {"groups interleaved": 7, "groups in runs": 3, "one group": 1}[order]
    params = list(lora.named_parameters().values())
    masks = []
    continuation_mask = logprobs._continuation_mask
    monkeypatch.setattr(logprobs, "_continuation_mask", lambda *args: masks.append(continuation_mask(*args)) or masks[-1])

    def run(grouped: bool):
        passed = anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=True, keep_graph=True,
                             groups=groups if grouped else None,
                             route=lambda sub: lora.route([adapters[r] for r in sub]))
        weights = torch.arange(1.0, len(rows) + 1, dtype=torch.float64)  # distinct rows, distinct gradients
        grads = torch.autograd.grad((weights * passed.logp).sum(), params, allow_unused=True)
        return passed, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    whole, whole_grads = run(grouped=False)
    shared, shared_grads = run(grouped=True)
    assert len(masks) == 1 and isinstance(masks[0], dict) == (prompts == "of one length" or order == "one group")
    torch.testing.assert_close(shared.logp, whole.logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(shared.input_grads, whole.input_grads, rtol=0, atol=1e-9)
    assert torch.equal(shared.lengths, whole.lengths)
    assert max(g.abs().max() for g in whole_grads) > 1e-3  # the gradients compared below are not all zero
    for ours, reference in zip(shared_grads, whole_grads):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-9)


@pytest.mark.parametrize("grouped, padded", [(False, True), (False, False), (True, True)])
def test_a_pass_never_reads_the_device_back(tiny_model_dir, grouped, padded):  # noqa: F811
    # On the meta device a tensor has a shape and no values, so whatever would make the host wait for
    # a GPU (.item(), bool() of a tensor, a boolean-mask index, a copy to the CPU) raises there. The
    # E-step's pass (log-probs, input gradients, contractions) and the M-step's (log-probs, backward
    # into the adapters) run on it: every decision they take is taken on the host's copies.
    from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA

    model, tokenizer = load_model(tiny_model_dir, dtype=torch.float32).to("meta"), load_tokenizer(tiny_model_dir)
    lora = MultiLoRA(model, 3, LoRASettings(r=4, alpha=8.0), seed=0)
    seqs = tokenize_responses(tokenizer, "Which list is best?", RESPONSES)
    rows, adapters = [seqs[0], seqs[1] if padded else seqs[0], seqs[0], seqs[3] if padded else seqs[0]], [0, 0, 1, 2]
    groups = [(0, c) for c in adapters] if grouped else None

    def route(sub):
        return lora.route([adapters[r] for r in sub])

    with lora.requires_grad(False):
        passed = anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=True, groups=groups, route=route,
                             alternatives=[seqs] * len(rows))
        emb, lengths = response_embeddings(model, seqs)
        s = passed.first_order(slice(None), torch.tensor([0, 1, 0, 3] if padded else [0, 0, 0, 0], device="meta"),
                               emb, lengths)
    assert passed.logp.device.type == "meta" and s.shape == (4, len(seqs))
    params = list(lora.named_parameters().values())
    with lora.requires_grad(True):
        passed = anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=False, keep_graph=True, groups=groups,
                             route=route)
        passed.logp.sum().backward()
    assert all(p.grad is not None for p in params) and len(params) == 2 * len(lora.layers)
    with pytest.raises(Exception, match="meta"):  # the probe: a read of the device does raise here
        bool(passed.logp.sum() > 0)


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("rows_per_pass", [32, 3])  # 3: passes mix the two examples and split each one
def test_the_shared_reference_terms_equal_one_example_at_a_time(model64, rows_per_pass, share_prompts):
    model, tokenizer = model64
    examples = [tokenize_responses(tokenizer, prompt, RESPONSES) for prompt in ("Which list is best?", "Best?")]
    together = reference_terms_batch(model, examples, tokenizer.pad_token_id, rows_per_pass=rows_per_pass,
                                     share_prompts=share_prompts)
    for sequences, (ref_logp, s_ref) in zip(examples, together):
        alone = anchor_pass(model, sequences, tokenizer.pad_token_id, input_grads=True,
                            alternatives=[sequences] * len(sequences))
        emb, lengths = response_embeddings(model, sequences)
        expected = alone.first_order(slice(None), torch.arange(len(sequences)), emb, lengths).float()
        torch.testing.assert_close(ref_logp, alone.logp, rtol=0, atol=1e-10)
        # contraction() takes cross - own in float32: the diagonal, 0 in exact arithmetic, is rounding noise
        # of terms near 8 that moves with the batch and the CPU's matmul kernel (2e-6 seen)
        torch.testing.assert_close(s_ref, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("contractions", [True, False])
def test_the_cache_stages_terms_come_back_from_another_device(tiny_model_dir, contractions):  # noqa: F811
    # The cache stage's passes with the model on meta, standing in for a GPU (MetaReadsAsZeros): its
    # results reach the host in one copy per device and dtype, each example's in its own shape.
    model, tokenizer = load_model(tiny_model_dir, dtype=torch.float32).to("meta"), load_tokenizer(tiny_model_dir)
    examples = [tokenize_responses(tokenizer, prompt, RESPONSES[:m]) for prompt, m in (("Best?", 4), ("Hm?", 3))]
    with MetaReadsAsZeros():
        terms = reference_terms_batch(model, examples, tokenizer.pad_token_id, rows_per_pass=3,
                                      contractions=contractions)
    assert [(ref.shape, ref.device.type, None if s is None else s.shape) for ref, s in terms] == \
        [((m,), "cpu", (m, m) if contractions else None) for m in (4, 3)]


def test_rows_grouped_under_one_prompt_must_share_it(model64):
    model, tokenizer = model64
    rows = [*tokenize_responses(tokenizer, "Best?", RESPONSES[:1]), *tokenize_responses(tokenizer, "Worst?", RESPONSES[:1])]
    with pytest.raises(ValueError, match="rows 0 and 1 are in group 'x' but their prompt tokens differ"):
        anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=False, groups=["x", "x"])


def test_the_cache_runs_each_examples_prompt_once(model64, prompt_pass_counts):  # noqa: F811
    model, tokenizer = model64
    counts = prompt_pass_counts
    examples = [tokenize_responses(tokenizer, prompt, RESPONSES) for prompt in ("Which list is best?", "Best?", "Hm?")]
    reference_terms_batch(model, examples, tokenizer.pad_token_id)
    assert counts == [3]
    reference_terms_batch(model, examples, tokenizer.pad_token_id, share_prompts=False)  # every row whole
    assert counts == [3]


def test_rows_run_whole_where_a_shared_prompt_would_not_be_exact(model64, prompt_pass_counts):  # noqa: F811
    # a one-token prompt (nothing before its last token), and a model with sliding-window layers,
    # whose mask counts the right-padded prefix's pads as positions
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from moplex_core.lm.logprobs import prefix_is_exact
    from moplex_core.lm.tokenize import TokenizedResponse

    model, tokenizer = model64
    counts = prompt_pass_counts
    one_token = [TokenizedResponse([5, 9, 11, tokenizer.eos_token_id], 1), TokenizedResponse([5, 7, tokenizer.eos_token_id], 1)]
    whole = anchor_pass(model, one_token, tokenizer.pad_token_id, input_grads=False)
    grouped = anchor_pass(model, one_token, tokenizer.pad_token_id, input_grads=False, groups=[0, 0])
    assert torch.equal(grouped.logp, whole.logp) and counts == []

    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1, use_sliding_window=True,
                         sliding_window=4, max_window_layers=0)
    torch.manual_seed(0)
    sliding = Qwen3ForCausalLM(config).double().eval()
    assert prefix_is_exact(model) and not prefix_is_exact(sliding)
    rows = [TokenizedResponse(list(range(2, 2 + p)) + list(range(40, 46)), p) for p in (3, 9)]  # prompts of 3 and 9
    whole = anchor_pass(sliding, rows, 0, input_grads=False)
    alone = torch.cat([anchor_pass(sliding, [row], 0, input_grads=False).logp for row in rows])
    grouped = anchor_pass(sliding, rows, 0, input_grads=False, groups=["a", "b"])
    torch.testing.assert_close(whole.logp, alone, rtol=0, atol=1e-10)
    assert torch.equal(grouped.logp, whole.logp) and counts == []


def test_estimation_error_against_a_plain_recomputation():
    gen = torch.Generator().manual_seed(3)
    n, k, m = 5, 2, 4
    exact = torch.randn(n, k, m, generator=gen, dtype=torch.float64)
    in_slate = torch.ones(n, m, dtype=torch.bool)
    in_slate[0, 3] = False  # a ragged slate: its padding is neither estimated nor part of the spread
    is_estimated = torch.zeros(n, k, m, dtype=torch.bool)
    is_estimated[:, :, 2:] = in_slate[:, None, 2:]
    noise = torch.randn(n, k, m, generator=gen, dtype=torch.float64)
    estimated = torch.where(is_estimated, exact + noise, exact)
    tiers = torch.arange(m).expand(n, m).clone()
    tiers[0, 3] = PAD
    rankings = Rankings(tiers)
    alpha = torch.tensor([0.3, 0.7], dtype=torch.float64)
    check = estimation_error(estimated, exact, is_estimated, in_slate, rankings.log_likelihood, alpha)

    errors = [abs(noise[i, c, j].item()) for i in range(n) for c in range(k) for j in range(m) if is_estimated[i, c, j]]
    spreads = [np.std(exact[i, c, :int(in_slate[i].sum())].numpy(), ddof=1) for i in range(n) for c in range(k)]
    assert check["estimated_entries"] == len(errors) == 2 * 2 * n - 2
    assert check["mean_abs_error"] == pytest.approx(np.mean(errors))
    assert check["score_spread"] == pytest.approx(np.mean(spreads))
    assert check["relative_error"] == pytest.approx(np.mean(errors) / np.mean(spreads))
    for name, scores in (("estimated", estimated), ("exact", exact)):
        joint = torch.log(alpha) + rankings.log_likelihood(scores)
        assert check[f"log_likelihood_{name}"] == pytest.approx(torch.logsumexp(joint, 1).mean().item())
    same = estimation_error(exact, exact, is_estimated, in_slate, rankings.log_likelihood, alpha)
    assert same["mean_abs_error"] == 0 and same["same_cluster"] == 1
    assert same["log_likelihood_estimated"] == same["log_likelihood_exact"]
