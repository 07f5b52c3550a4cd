"""The LoRA policy scorer: k adapters on one base model, anchors, the M-step's gradients, PEFT format."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch
from lm_fixtures import (MetaReadsAsZeros, float64_rmsnorm, layer_runs, prompt_pass_counts,  # noqa: F401  (fixtures)
                         tiny_model_dir)
from peft import PeftModel
from stage_fixtures import write_synthetic

import moplex_core.scorers.lora_policy as lora_policy
from moplex_core.artifacts import ArtifactStore
from moplex_core.cache import load_policy_inputs, run_cache
from moplex_core.config import CacheConfig
from moplex_core.em import EMConfig, initial_responsibilities
from moplex_core.estimate import anchor_indices, reference_terms_batch, response_embeddings
from moplex_core.lm.device import PassOutOfMemoryError
from moplex_core.lm.loading import load_model, load_tokenizer
from moplex_core.lm.logprobs import embed, output_score_features, sequence_logprobs
from moplex_core.lm.tokenize import TokenizedResponse, pad_batch, tokenize_responses
from moplex_core.lm.multi_lora import LoRASettings
from moplex_core.pl import PAD, encode_tiers_batch
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, PolicyInputs

SMALL = LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory):  # noqa: F811
    store = ArtifactStore(tmp_path_factory.mktemp("lora-policy"))
    augmented = write_synthetic(store, n=8, m=3, n_generated=2)
    cache = run_cache(CacheConfig(model=str(tiny_model_dir)), augmented, store, progress=False)
    return load_policy_inputs(cache.path, split=None)[0]


def scorer(model_dir, **kwargs) -> LoRAPolicyScorer:
    return LoRAPolicyScorer(model_dir, 2, lora=SMALL, lr=1e-2, batch_size=4, score_batch_size=4, **kwargs)


def test_adapters_start_at_the_reference_and_the_m_step_moves_every_adapter(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    torch.testing.assert_close(policy.score(inputs, 0), torch.zeros(len(inputs), 2, 5, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    before = {name: p.detach().clone() for name, p in policy._lora.items() if name.endswith(".lora_B")}
    weights = torch.tensor([[0.9, 0.1]] * 4 + [[0.2, 0.8]] * 4, dtype=torch.float64)
    policy.fit(inputs, inputs.rankings(), weights, 0)
    for c in range(2):
        moved = [not torch.equal(policy._lora[name][c], b[c]) for name, b in before.items()]
        assert len(moved) == len(policy.lora.layers) and all(moved), f"adapter {c} was not trained in every layer"
    assert policy.exact_scores(inputs).abs().max() > 1e-3
    base = [p for name, p in policy.model.named_parameters() if ".lora_" not in name]
    assert base and all(p.grad is None and not p.requires_grad for p in base)


@pytest.mark.parametrize("anchors, share_prompts", [(None, True), (2, True), (2, False)])
def test_em_steps_run_with_the_model_on_another_device_than_the_host(tiny_model_dir, inputs, anchors,  # noqa: F811
                                                                      share_prompts):
    # The meta device stands in for a GPU (MetaReadsAsZeros): a tensor the host makes and one the
    # model's device makes cannot meet in one op there, which the CPU alone never shows (the E-step's
    # results once did, in one cat). Two iterations: the second M-step reuses the first E-step's estimates.
    policy = scorer(tiny_model_dir, anchors=anchors, share_prompts=share_prompts, device="meta")
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    with MetaReadsAsZeros():
        for iteration in range(2):
            policy.fit(inputs, inputs.rankings(), weights, iteration)
            scores = policy.score(inputs, iteration)
        exact = policy.exact_scores(inputs)
        features = policy.response_features(inputs)
    assert scores.shape == exact.shape == (len(inputs), 2, 5) and scores.device.type == "cpu"
    assert features.shape[:2] == (len(inputs), 5)
    pairs = 2 * len(inputs)  # (example, cluster), 4 per minibatch: each minibatch stepped both adapters
    assert policy.optimizer.steps == [2 * -(-pairs // 4)] * 2


@pytest.mark.parametrize("anchors", [None, 2])
def test_an_m_step_reads_the_device_back_once_not_per_pass(tiny_model_dir, inputs, anchors):  # noqa: F811
    # On a GPU every read of a device tensor makes the host wait for the card before it can launch
    # the next pass. The M-step's objectives (the Plackett-Luce likelihood of the passes' log-probs)
    # stay there; the host reads them once an M-step (and every PROGRESS_EVERY steps, for the bar).
    policy = scorer(tiny_model_dir, anchors=anchors, device="meta")  # passes of 4 rows: several a minibatch
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    with MetaReadsAsZeros():
        policy.score(inputs, 0)  # the estimates the M-step holds (a pass of its own otherwise)
    with MetaReadsAsZeros() as device:
        policy.fit(inputs, inputs.rankings(), weights, 1)
    steps = -(-2 * len(inputs) // 4)
    assert policy.last_fit["steps"] == steps < lora_policy.PROGRESS_EVERY and device.reads == 1


def test_a_pass_out_of_device_memory_names_the_setting_that_sizes_it(tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 139.8 GiB\nmore")

    monkeypatch.setattr(lora_policy, "anchor_pass", out_of_memory)
    with pytest.raises(PassOutOfMemoryError, match=r"E-step 0 runs up to score_batch_size = 4 rows a pass \(a "
                       r"response under one adapter, with its input gradients\); lower it \(--set "
                       r"train.score_batch_size=2.*; or set train.gradient_checkpointing = true \(CUDA out of memory. "
                       r"Tried to allocate 2.00 GiB. GPU 0 has"):
        policy.score(inputs, 0)
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    with pytest.raises(torch.OutOfMemoryError, match="never fewer than a pair's 2; lower train.score_batch_size"):
        policy.fit(inputs, inputs.rankings(), weights, 0)  # still a torch.OutOfMemoryError (em_gpu records OOM)


def test_the_first_m_step_runs_first_epochs_and_the_later_ones_epochs(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=None, epochs=1, first_epochs=3)
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)  # 2 pairs per example: 4 minibatches of 4
    steps = []
    for iteration in range(2):
        policy.fit(inputs, inputs.rankings(), weights, iteration)
        steps.append(policy.last_fit["steps"])
    assert steps == [3 * 4, 4]
    with pytest.raises(ValueError, match="first_epochs=0"):
        scorer(tiny_model_dir, first_epochs=0)


def test_a_cluster_without_weight_is_left_exactly_where_it_is(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    policy.fit(inputs, inputs.rankings(), torch.full((len(inputs), 2), 0.5, dtype=torch.float64), 0)
    policy.score(inputs, 0)
    frozen = {name: p[1].detach().clone() for name, p in policy._lora.items()}
    moments = {name: m[1].clone() for name, m in policy.optimizer.exp_avg.items()}
    steps = policy.optimizer.steps[1]
    only_c0 = torch.tensor([[1.0, 0.0]] * len(inputs), dtype=torch.float64)
    policy.fit(inputs, inputs.rankings(), only_c0, 1)  # Adam holds momentum for cluster 1 from iteration 0
    for name, value in frozen.items():
        assert torch.equal(policy._lora[name][1], value), name
        assert torch.equal(policy.optimizer.exp_avg[name][1], moments[name]), name
    assert policy.optimizer.steps[1] == steps


def test_shared_prompts_change_neither_the_scores_nor_the_training(tiny_model_dir, inputs, float64_rmsnorm):  # noqa: F811
    # score_batch_size 3 splits (example, cluster) groups across passes, and the M-step's minibatch
    # of 4 pairs holds several prompts, of different lengths (the synthetic prompts all have one
    # length, so every other example loses the first i tokens of its prompt: prefixes get padded)
    shortened = tuple(tuple(TokenizedResponse(seq.input_ids[i % 2 * i:], seq.response_start - i % 2 * i) for seq in seqs)
                      for i, seqs in enumerate(inputs.sequences))
    varied = dataclasses.replace(inputs, sequences=shortened)
    assert len({seqs[0].response_start for seqs in shortened}) > 2
    weights = torch.tensor([[0.9, 0.1]] * 4 + [[0.2, 0.8]] * 4, dtype=torch.float64)
    runs = []
    for share in (False, True):
        policy = scorer(tiny_model_dir, anchors=2, share_prompts=share, dtype=torch.float64)
        policy.score_batch_size = 3
        policy.fit(varied, varied.rankings(), weights, 0)
        estimated = policy.score(varied, 0)  # anchors with input gradients, the rest estimated
        policy.fit(varied, varied.rankings(), weights, 1)  # holds that E-step's estimates
        runs.append((estimated, policy.exact_scores(varied)))
    assert runs[0][1].abs().max() > 1e-2
    for unshared, shared in zip(*runs):
        torch.testing.assert_close(shared, unshared, rtol=0, atol=1e-9)


@pytest.mark.parametrize("share", [False, True], ids=["rows whole", "shared prompts"])
def test_checkpointed_layers_change_neither_the_scores_nor_the_training(tiny_model_dir, inputs, layer_runs,  # noqa: F811
                                                                        share):
    weights = torch.tensor([[0.9, 0.1]] * 4 + [[0.2, 0.8]] * 4, dtype=torch.float64)
    runs, layers_run = [], []
    for checkpointed in (False, True):
        policy = scorer(tiny_model_dir, anchors=2, share_prompts=share, gradient_checkpointing=checkpointed)
        layer_runs[0] = 0
        policy.fit(inputs, inputs.rankings(), weights, 0)
        estimated = policy.score(inputs, 0)  # anchors with input gradients, the rest estimated
        policy.fit(inputs, inputs.rankings(), weights, 1)  # holds that E-step's estimates
        layers_run.append(layer_runs[0])
        runs.append([estimated, policy.exact_scores(inputs), *(p.detach().clone() for p in policy._lora.values())])
    assert runs[0][1].abs().max() > 1e-2
    assert layers_run[1] > 1.5 * layers_run[0]  # the layers of every pass with gradients ran again
    for ours, reference in zip(*runs, strict=True):
        assert torch.equal(ours, reference)


def test_each_pass_runs_one_prompt_per_example_and_cluster(tiny_model_dir, inputs, prompt_pass_counts):  # noqa: F811
    prompt_passes = prompt_pass_counts
    policy = scorer(tiny_model_dir, anchors=2)
    policy.score_batch_size = 4  # (example 0, c0), (example 0, c1); then (1, c0), (1, c1); ...
    policy.score(inputs, 0)
    assert prompt_passes == [2] * len(inputs)
    prompt_passes.clear()
    policy.fit(inputs, inputs.rankings(), torch.full((len(inputs), 2), 0.5, dtype=torch.float64), 1)
    assert sum(prompt_passes) == 2 * len(inputs)  # one per weighted (example, cluster) pair


def record_passes(monkeypatch, inputs) -> list[tuple[str, set, bool]]:
    """(phase, {(example, response)}, input_grads) of every anchor pass the scorer runs."""
    where = {id(seq): (i, j) for i, seqs in enumerate(inputs.sequences) for j, seq in enumerate(seqs)}
    calls: list[tuple[str, set, bool]] = []
    real_pass = lora_policy.anchor_pass

    def recording_pass(model, sequences, *args, input_grads, **kwargs):
        calls.append(("train" if kwargs.get("keep_graph") else "score", {where[id(s)] for s in sequences}, input_grads))
        return real_pass(model, sequences, *args, input_grads=input_grads, **kwargs)

    monkeypatch.setattr(lora_policy, "anchor_pass", recording_pass)
    return calls


def test_the_m_step_reuses_the_previous_e_steps_anchors_and_runs_no_input_gradient_pass(
        tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    calls = record_passes(monkeypatch, inputs)
    policy = scorer(tiny_model_dir, anchors=2)
    weights = torch.ones(len(inputs), 2, dtype=torch.float64)
    policy.fit(inputs, inputs.rankings(), weights, 0)  # at the base model: estimates from the cache
    assert calls and all(phase == "train" and not grads for phase, _, grads in calls)
    calls.clear()
    policy.score(inputs, 0)
    assert all(phase == "score" and grads for phase, _, grads in calls)
    e_step_rows = set().union(*(rows for _, rows, _ in calls))
    assert e_step_rows == set(zip(*torch.nonzero(policy.last_scores.is_anchor).T.tolist(), strict=True))
    assert len(e_step_rows) == 2 * len(inputs)
    calls.clear()
    policy.fit(inputs, inputs.rankings(), weights, 1)
    assert all(phase == "train" and not grads for phase, _, grads in calls), "the M-step took input gradients"
    assert set().union(*(rows for _, rows, _ in calls)) == e_step_rows


def test_estimates_from_the_cache_equal_an_input_gradient_pass_at_the_base_model(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    picks = policy._anchor_picks(inputs, 0, 2)
    from_cache = policy._estimates(inputs, 0, picks)
    passed = policy._score_all(inputs, 0, 2, "check")[0]
    assert from_cache.abs().max() == 0  # delta mode: s_c = s_ref and delta_c = 0 at the base model
    torch.testing.assert_close(passed, from_cache, atol=1e-5, rtol=0)
    logpi = scorer(tiny_model_dir, anchors=2, estimation="logpi")
    torch.testing.assert_close(logpi._score_all(inputs, 0, 2, "check")[0], logpi._estimates(inputs, 0, picks),
                               atol=1e-4, rtol=1e-5)


def test_the_m_step_holds_the_e_steps_estimates_and_differentiates_the_objective_it_computes(
        tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    """Non-anchor scores are the E-step's, constant (no gradient, the same value at every step), the
    anchors' exact; so the M-step's gradient is its objective's (checked by a finite difference)."""
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    policy = scorer(tiny_model_dir, anchors=2)
    policy.fit(inputs, inputs.rankings(), weights, 0)
    scores = policy.score(inputs, 0)  # [n, k, M]
    e_step, is_anchor = policy._estep.deltas, policy.last_scores.is_anchor
    torch.testing.assert_close(scores, policy.beta * e_step, rtol=0, atol=0)
    params = list(policy._lora.values())
    seen: list[tuple[int, int, torch.Tensor, list[float]]] = []
    real_hold = lora_policy.hold_estimates

    def checking_hold(idx, anchor_delta, estimates):  # inside the M-step, while its graph is alive
        delta = real_hold(idx, anchor_delta, estimates)
        per_response = []
        for j in range(delta.shape[0]):
            grads = torch.autograd.grad(delta[j], params, retain_graph=True, allow_unused=True)
            per_response.append(sum(g.abs().sum().item() for g in grads if g is not None))
        seen.append((idx.tolist(), delta.detach().cpu(), per_response))
        return delta

    monkeypatch.setattr(lora_policy, "hold_estimates", checking_hold)
    policy.fit(inputs, inputs.rankings(), weights, 1)
    assert len(seen) == 2 * len(inputs)
    held = torch.stack([e_step[i, c] for i in range(len(inputs)) for c in range(2)])  # [n * k, M] in some order
    for anchors, delta, per_response in seen:
        assert [j for j, norm in enumerate(per_response) if norm > 0] == anchors
        estimated = [j for j in range(len(delta)) if j not in anchors]
        assert any(torch.equal(delta[estimated], row[: len(delta)][estimated]) for row in held)
    monkeypatch.undo()

    # One pair's gradient against a central difference of its objective along that gradient.
    one = scorer(tiny_model_dir, anchors=2)
    one.fit(inputs, inputs.rankings(), weights, 0)
    one.score(inputs, 0)
    i = int(torch.nonzero(~is_anchor.all(1))[0])  # an example with an estimated response
    only = torch.zeros_like(weights)
    only[i, 0] = 1.0
    picks = one._anchor_picks(inputs, 1, 2)
    terms = lora_policy._MStepTerms.of(inputs, picks, one._estimates(inputs, 1, picks), only, one.model.device)

    def objective() -> float:  # log P_0(sigma_i), held estimates; accumulates its gradient's negative
        one.optimizer.zero_grad()
        return float(one._weighted_logp(inputs, inputs.rankings(), terms, [[i, 0]], 1))

    objective()
    ascent = {name: -p.grad.detach().clone() for name, p in one._lora.items()}
    step = 1e-3
    with torch.no_grad():
        for name, p in one._lora.items():
            p.add_(ascent[name], alpha=step)
    up = objective()
    with torch.no_grad():
        for name, p in one._lora.items():
            p.add_(ascent[name], alpha=-2 * step)
    down = objective()
    squared = sum(float(g.pow(2).sum()) for g in ascent.values())
    assert squared > 0
    torch.testing.assert_close((up - down) / (2 * step), squared, rtol=2e-2, atol=0)


def test_the_m_step_objective_is_the_weighted_breslow_log_likelihood_written_out(
        tiny_model_dir, float64_rmsnorm):  # noqa: F811
    """-sum over (example, cluster) pairs of w_ic log P_c(sigma_i) / pairs, P_c of Breslow ties over a
    top-l prefix with every response of the slate in the denominators, the anchors' scores exact
    (beta (log pi_c - log pi_ref)) and the others the E-step's held estimates, constants: its value and
    its gradient against autograd of that formula, computed response by response (float64)."""
    beta = 0.5
    policy = LoRAPolicyScorer(tiny_model_dir, 2, anchors=2, beta=beta, dtype=torch.float64, lora=SMALL,
                              score_batch_size=8, seed=3)
    tokenizer = load_tokenizer(tiny_model_dir)
    slates = [tokenize_responses(tokenizer, "Rank by criterion 1: which list is best?", ["3 1 2", "5 0 2 7", "1 1",
                                                                                          "4 2 9", "7 7"]),
              tokenize_responses(tokenizer, "Rank by criterion 2: which is best?", ["9 9", "0 1 2", "8 1", "2 2 2 2"])]
    width = 5
    ref_logp, s_ref = torch.zeros(2, width, dtype=torch.float64), torch.zeros(2, width, width)
    for e, slate in enumerate(slates):
        (logp, contraction), = reference_terms_batch(policy.model, [slate], policy.pad_token_id)
        ref_logp[e, :len(slate)], s_ref[e, :len(slate), :len(slate)] = logp, contraction
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # adapters away from the reference, so that anchors and estimates differ
        for param in policy.lora.named_parameters().values():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    rankings = [[[1], [0, 2]], [[2], [0], [1], [3]]]  # a tie; with slate 0's last two and 1's last one unranked
    inputs = PolicyInputs(("a", "b"), tuple(map(tuple, slates)), ref_logp, s_ref,
                          encode_tiers_batch(rankings, [5, 4]), torch.tensor([2, 2]))
    policy.score(inputs, 0)  # the E-step whose estimates the next M-step holds
    held = policy._estep.deltas.clone()  # [n, k, M]
    weights = torch.tensor([[0.8, 0.2], [0.0, 0.6]], dtype=torch.float64)
    picks = policy._anchor_picks(inputs, 1, 2)
    terms = lora_policy._MStepTerms.of(inputs, picks, policy._estimates(inputs, 1, picks), weights, policy.model.device)
    pairs = [[0, 0], [0, 1], [1, 1]]
    policy.optimizer.zero_grad()
    objective = float(policy._weighted_logp(inputs, inputs.rankings(), terms, pairs, len(pairs) + 1))
    computed = {name: param.grad.detach().clone() for name, param in policy._lora.items() if param.grad is not None}
    policy.optimizer.zero_grad()

    def logpi(e: int, j: int, c: int) -> torch.Tensor:
        batch = pad_batch([slates[e][j]], policy.pad_token_id)
        with policy.lora.route([c]), policy.lora.requires_grad(True):
            return sequence_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.response_mask).sum()

    def breslow(r: list[torch.Tensor], tiers: list[list[int]], prefix: int) -> torch.Tensor:
        below, total = list(range(len(r))), torch.zeros((), dtype=torch.float64)
        for tier in tiers[:prefix]:
            total = total + sum(r[j] for j in tier) - len(tier) * torch.logsumexp(torch.stack([r[j] for j in below]), 0)
            below = [j for j in below if j not in tier]
        return total

    expected = torch.zeros((), dtype=torch.float64)
    with policy.lora.requires_grad(True):
        for e, c in pairs:
            r = [beta * held[e, c, j] for j in range(len(slates[e]))]
            for j in picks[e].tolist():
                r[j] = beta * (logpi(e, j, c) - ref_logp[e, j])
            expected = expected + weights[e, c] * breslow(r, rankings[e], 2)
        expected = expected / (len(pairs) + 1)
        params = list(policy._lora.values())
        grads = torch.autograd.grad(-expected, params, allow_unused=True)
    assert objective == pytest.approx(float(expected.detach()), rel=1e-10)
    for name, grad in zip(policy._lora, grads, strict=True):
        if grad is None:
            assert name not in computed or not computed[name].any()
        else:
            torch.testing.assert_close(computed[name], grad, rtol=1e-7, atol=1e-10)


def test_a_resumed_scorer_repeats_the_m_step_exactly(tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    first = scorer(tiny_model_dir, anchors=2)
    first.fit(inputs, inputs.rankings(), weights, 0)
    first.score(inputs, 0)
    resumed = scorer(tiny_model_dir, anchors=2)
    resumed.load_state_dict(torch.load(io.BytesIO(_saved(first.state_dict())), weights_only=True))  # as state.pt loads
    first.fit(inputs, inputs.rankings(), weights, 1)
    calls = record_passes(monkeypatch, inputs)
    resumed.fit(inputs, inputs.rankings(), weights, 1)
    assert calls and not any(grads for _, _, grads in calls), "the resumed M-step lost the E-step's estimates"
    for name, p in first._lora.items():
        torch.testing.assert_close(resumed._lora[name], p, rtol=0, atol=0)
    # the next checkpoint's bytes too (the chaos tests compare state.pt by its hash)
    assert _saved(resumed.state_dict()) == _saved(first.state_dict())


def test_a_state_saved_with_offsets_resumes_recomputing_the_estimates(tiny_model_dir, inputs):  # noqa: F811
    # Checkpoints before 2026-11-25 kept the E-step's offsets, not its deltas: the M-step recomputes them.
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    first = scorer(tiny_model_dir, anchors=2)
    first.fit(inputs, inputs.rankings(), weights, 0)
    first.score(inputs, 0)
    state = first.state_dict()
    state["estep"] = {"round": 1, "inputs": state["estep"]["inputs"], "offsets": torch.zeros(1)}
    resumed = scorer(tiny_model_dir, anchors=2)
    resumed.load_state_dict(state)
    assert resumed._estep is None
    first.fit(inputs, inputs.rankings(), weights, 1)
    resumed.fit(inputs, inputs.rankings(), weights, 1)  # an input-gradient pass first, at the same parameters
    for name, p in first._lora.items():
        torch.testing.assert_close(resumed._lora[name], p, rtol=0, atol=1e-6)


def _saved(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_an_m_step_undone_twice_and_redone_at_a_quarter_is_one_taken_only_at_a_quarter(tiny_model_dir, inputs):  # noqa: F811
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    backtracked, straight = scorer(tiny_model_dir, anchors=2), scorer(tiny_model_dir, anchors=2)
    for policy in (backtracked, straight):
        policy.fit(inputs, inputs.rankings(), weights, 0)
        policy.score(inputs, 0)
    before = backtracked.state_dict()  # as EM's backtracking does (moplex_core.em.fit._m_and_e_step)
    for factor in (1.0, 0.5):  # two attempts undone, each from the same state
        backtracked.scale_steps(factor)
        backtracked.fit(inputs, inputs.rankings(), weights, 1)
        backtracked.score(inputs, 1)
        assert backtracked._estep.round == 2
        backtracked.load_state_dict(before)
        assert backtracked._estep.round == 1 and torch.equal(backtracked._estep.deltas, before["estep"]["deltas"])
    backtracked.scale_steps(0.25)
    backtracked.fit(inputs, inputs.rankings(), weights, 1)
    straight.optimizer.lr = 0.25e-2
    straight.fit(inputs, inputs.rankings(), weights, 1)
    for name, p in straight._lora.items():  # adapters, Adam moments and steps, shuffling all undone
        torch.testing.assert_close(backtracked._lora[name], p, rtol=0, atol=0)
    backtracked.scale_steps(1.0)
    assert backtracked.optimizer.lr == 1e-2


def test_lora_dropout_masks_depend_on_seed_and_iteration_only(tiny_model_dir, inputs):  # noqa: F811
    dropout = dataclasses.replace(SMALL, dropout=0.3)
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    trained = []
    for global_seed in (1, 2):  # what ran before (another M-step, a resumed process) moved the global RNG
        policy = LoRAPolicyScorer(tiny_model_dir, 2, lora=dropout, lr=1e-2, batch_size=4, score_batch_size=4,
                                  anchors=None)
        torch.manual_seed(global_seed)
        policy.fit(inputs, inputs.rankings(), weights, 1)
        trained.append(policy)
    for name, p in trained[0]._lora.items():
        torch.testing.assert_close(trained[1]._lora[name], p, rtol=0, atol=0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    trained[0].fit(inputs, inputs.rankings(), weights, 2)
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG is left where it was


def test_an_m_step_turns_on_lora_dropout_only_not_the_base_models_own(tiny_model_dir, inputs):  # noqa: F811
    # pi_ref was cached without the base model's dropout (GPT-2's, a config's attention_dropout)
    policy = LoRAPolicyScorer(tiny_model_dir, 2, lora=dataclasses.replace(SMALL, dropout=0.3), lr=1e-2, batch_size=4,
                              score_batch_size=4, anchors=None)
    modes = []
    attention = next(module for name, module in policy.model.named_modules() if name.endswith("self_attn"))
    attention.register_forward_pre_hook(lambda module, args: modes.append(("base", module.training)))
    next(iter(policy.lora.layers.values())).dropout.register_forward_pre_hook(
        lambda module, args: modes.append(("lora", module.training)))
    policy.fit(inputs, inputs.rankings(), torch.full((len(inputs), 2), 0.5, dtype=torch.float64), 1)
    assert set(modes) == {("base", False), ("lora", True)}
    assert all(p.grad is None for p in policy._lora.values())  # not held through the E-step
    modes.clear()
    policy.score(inputs, 1)
    assert set(modes) == {("base", False), ("lora", False)}


def test_m_step_passes_of_a_few_rows_accumulate_the_same_step(tiny_model_dir, inputs):  # noqa: F811
    weights = torch.full((len(inputs), 2), 0.5, dtype=torch.float64)
    whole, split = scorer(tiny_model_dir, anchors=2), scorer(tiny_model_dir, anchors=2)
    split.score_batch_size = 2  # one pair (2 anchors) per forward + backward
    whole.fit(inputs, inputs.rankings(), weights, 0)
    split.fit(inputs, inputs.rankings(), weights, 0)
    for name, p in whole._lora.items():
        torch.testing.assert_close(split._lora[name], p, rtol=1e-4, atol=1e-5)  # a lost group: ~lr = 1e-2


def test_mixed_cluster_passes_equal_one_row_at_a_time(tiny_model_dir, inputs):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    one_row = scorer(tiny_model_dir, anchors=2)
    one_row.load_state_dict(trained.state_dict())
    one_row.score_batch_size = 1
    torch.testing.assert_close(one_row.exact_scores(inputs), trained.exact_scores(inputs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one_row.score(inputs, 3), trained.score(inputs, 3), atol=1e-5, rtol=1e-5)


def test_scores_copied_to_the_host_after_every_pass_equal_one_copy_for_all(tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    # The E-step keeps each pass's results on the device for PASSES_PER_COPY passes: copies after every
    # pass (and over examples of different lengths, with and without contractions) give the same scores.
    from moplex_core.lm import device

    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    assert len(inputs) * 2 * 2 > 2 * trained.score_batch_size  # several passes at 2 anchors
    estimated, exact = trained.score(inputs, 1), trained.exact_scores(inputs)
    monkeypatch.setattr(device, "PASSES_PER_COPY", 1)
    assert torch.equal(trained.score(inputs, 1), estimated) and torch.equal(trained.exact_scores(inputs), exact)
    assert trained.score(inputs.subset([]), 1).shape[:2] == (0, 2)  # no rows, no pass, no copy


def test_every_response_an_anchor_gives_the_exact_scores(tiny_model_dir, inputs):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    state = trained.state_dict()
    for anchors in (None, 5):
        full = scorer(tiny_model_dir, anchors=anchors)
        full.load_state_dict(state)
        torch.testing.assert_close(full.score(inputs, 1), trained.exact_scores(inputs))
        assert bool(full.last_scores.is_anchor.all())


def test_examples_whose_every_response_is_an_anchor_take_no_input_gradients(tiny_model_dir, inputs,
                                                                             monkeypatch):  # noqa: F811
    """A ragged slate: examples 0 and 3 keep two responses, so a = 2 anchors are all of them. Their rows
    run forward only; the others' scores are what scoring them alone gives."""
    tiers = inputs.tiers.clone()
    tiers[[0, 3], 2:] = PAD
    sequences = tuple(seqs[:2] if i in (0, 3) else seqs for i, seqs in enumerate(inputs.sequences))
    ragged = dataclasses.replace(inputs, sequences=sequences, tiers=tiers)
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(ragged, ragged.rankings(), torch.ones(len(ragged), 2, dtype=torch.float64), 0)
    calls = record_passes(monkeypatch, ragged)
    scores = trained.score(ragged, 1)
    with_grads = set().union(*(rows for _, rows, grads in calls if grads))
    without = set().union(*(rows for _, rows, grads in calls if not grads))
    assert {i for i, _ in with_grads} == set(range(len(ragged))) - {0, 3}
    assert without == {(i, j) for i in (0, 3) for j in (0, 1)}
    torch.testing.assert_close(scores[[0, 3]], trained.exact_scores(ragged)[[0, 3]])
    others = [i for i in range(len(ragged)) if i not in (0, 3)]
    torch.testing.assert_close(scores[others], trained.score(ragged.subset(others), 1))


def test_the_nearest_anchor_weighting_changes_only_the_estimates(tiny_model_dir, inputs):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    state = trained.state_dict()
    scores = {}
    for weighting in ("mean", "nearest"):
        for anchors in (1, 2):
            policy = scorer(tiny_model_dir, anchors=anchors, anchor_weighting=weighting)
            policy.load_state_dict(state)
            scores[weighting, anchors] = policy.score(inputs, 1), policy.last_scores.is_anchor
    assert torch.equal(scores["mean", 1][0], scores["nearest", 1][0])  # one anchor: nothing to weigh
    (mean, is_anchor), (nearest, same) = scores["mean", 2], scores["nearest", 2]
    assert torch.equal(is_anchor, same)
    at = is_anchor.unsqueeze(1).expand_as(mean)
    assert torch.equal(mean[at], nearest[at]) and not torch.allclose(mean[~at], nearest[~at])
    with pytest.raises(ValueError, match="anchor_weighting must be one of"):
        scorer(tiny_model_dir, anchors=2, anchor_weighting="closest")


def test_anchors_drawn_by_length_take_one_of_each_length_stratum(tiny_model_dir, inputs):  # noqa: F811
    lengths = [[len(s.input_ids) - s.response_start for s in seqs] for seqs in inputs.sequences]
    for draw in ("uniform", "by_length"):
        policy = scorer(tiny_model_dir, anchors=2, anchor_draw=draw)
        policy.score(inputs, 1)  # the E-step of iteration 1 draws round 2's anchors
        expected = [anchor_indices(e, len(n), 2, policy.seed, 2, n if draw == "by_length" else None)
                    for e, n in zip(inputs.example_ids, lengths, strict=True)]
        assert [row.nonzero().flatten().tolist() for row in policy.last_scores.is_anchor] == [
            e.tolist() for e in expected]
    with pytest.raises(ValueError, match="anchor_draw must be one of"):
        scorer(tiny_model_dir, anchors=2, anchor_draw="longest")


def test_adapters_round_trip_through_peft_format(tiny_model_dir, inputs, tmp_path):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    trained.save_adapters(tmp_path / "adapters")
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir() if p.is_dir()) == ["c0", "c1"]

    peft = PeftModel.from_pretrained(load_model(tiny_model_dir), str(tmp_path / "adapters" / "c1")).eval()
    batch = pad_batch(list(inputs.sequences[0]), trained.pad_token_id)
    with torch.no_grad():
        logp = sequence_logprobs(peft, batch.input_ids, batch.attention_mask, batch.response_mask).double()
    expected = trained.exact_scores(inputs.subset([0]))[0, 1] / trained.beta + inputs.ref_logp[0]
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-6)  # float32 sums of ~100 nats

    reloaded = scorer(tiny_model_dir, anchors=2)
    reloaded.load_adapters(tmp_path / "adapters")
    torch.testing.assert_close(reloaded.exact_scores(inputs), trained.exact_scores(inputs))


def test_saved_adapter_configs_list_their_target_modules_sorted(tiny_model_dir, tmp_path):  # noqa: F811
    # PEFT writes its target_modules set in hash-seed order; two processes saving equal adapters
    # (a killed train run and its rerun) must write equal bytes.
    targets = ("v_proj", "up_proj", "q_proj", "o_proj", "k_proj", "gate_proj", "down_proj")
    policy = LoRAPolicyScorer(tiny_model_dir, 2, lora=LoRASettings(r=2, alpha=4.0, target_modules=targets))
    policy.save_adapters(tmp_path)
    for name in ("c0", "c1"):
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["target_modules"] == sorted(targets)


def test_response_features_are_each_responses_reference_output_gradient(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    policy.fit(inputs, inputs.rankings(), torch.full((len(inputs), 2), 0.5, dtype=torch.float64), 0)  # adapters moved
    features = policy.response_features(inputs, width=4)  # [n, M, 16]
    assert features.shape == (*inputs.tiers.shape, 16) and features.dtype == torch.float64
    tiers = inputs.tiers.clone()
    tiers[0, -1] = PAD  # example 0 loses its last response: a ragged slate
    ragged = dataclasses.replace(inputs, sequences=(inputs.sequences[0][:-1], *inputs.sequences[1:]), tiers=tiers)
    padded = policy.response_features(ragged, width=4)
    assert (padded[ragged.tiers == PAD] == 0).all() and (features[0, -1] != 0).any()
    torch.testing.assert_close(padded[ragged.tiers != PAD], features[ragged.tiers != PAD], rtol=1e-4, atol=1e-4)
    generator = torch.Generator().manual_seed(policy.seed)
    vocab, hidden = policy.model.get_output_embeddings().weight.shape
    left = torch.randn(vocab, 4, generator=generator, dtype=torch.float64)
    right = torch.randn(hidden, 4, generator=generator, dtype=torch.float64)
    base = load_model(tiny_model_dir, dtype="float32")  # no adapters: the reference model
    for i, j in [(0, 0), (3, 4), (len(inputs) - 1, 2)]:
        one = pad_batch([inputs.sequences[i][j]], policy.pad_token_id)
        alone = output_score_features(base, one.input_ids, one.attention_mask, one.response_mask, left, right)[0]
        torch.testing.assert_close(features[i, j], alone, rtol=1e-4, atol=1e-4)
    gamma = initial_responsibilities(EMConfig(k=2, init="linearized"), policy, inputs, inputs.rankings(), seed=0)
    assert gamma.shape == (len(inputs), 2) and torch.allclose(gamma.sum(1), torch.ones(len(inputs), dtype=torch.float64))


def test_the_exact_fallback_is_part_of_the_state_a_redo_or_a_resume_restores(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2, exact_fallback=4, fallback_above=0.0)  # any error falls back
    policy.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    before = policy.state_dict()
    estimated = policy.score(inputs, 0)
    assert policy.anchors is None and policy.fell_back["iteration"] == 0 and policy.fell_back["relative_error"] > 0
    assert not bool(policy.last_scores.is_anchor.all())  # it returns the failed estimates: EM redoes the step
    exact = policy.exact_scores(inputs)
    assert not torch.allclose(estimated, exact)
    torch.testing.assert_close(policy.score(inputs, 0), exact)  # from then on every response is exact
    assert bool(policy.last_scores.is_anchor.all())
    after = policy.state_dict()
    policy.load_state_dict(before)  # a backtracking redo of that iteration starts with the anchors again
    assert policy.anchors == 2 and policy.fell_back is None
    resumed = scorer(tiny_model_dir, anchors=2, exact_fallback=4)
    resumed.load_state_dict(after)
    assert resumed.anchors is None and resumed.fell_back == after["fell_back"]
    exact = scorer(tiny_model_dir, anchors=None)
    exact.load_state_dict(before)  # a state without a fallback keeps the loading scorer's own anchors
    assert exact.anchors is None


def test_estimates_within_the_fallback_threshold_change_nothing(tiny_model_dir, inputs):  # noqa: F811
    plain, guarded = scorer(tiny_model_dir, anchors=2), scorer(tiny_model_dir, anchors=2, exact_fallback=4,
                                                                fallback_above=1e6)
    for policy in (plain, guarded):
        policy.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    torch.testing.assert_close(guarded.score(inputs, 0), plain.score(inputs, 0), rtol=0, atol=0)
    assert guarded.anchors == 2 and guarded.fell_back is None


def test_adapters_that_diverged_are_not_an_estimates_failure(tiny_model_dir, inputs):  # noqa: F811
    # Exact scores that are not finite are the adapters', not the anchors': no fallback, and EM's
    # finite check (a halved step with train.backtracks, else an error) takes it from there.
    policy = scorer(tiny_model_dir, anchors=2, exact_fallback=4, fallback_above=0.0)
    policy.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    with torch.no_grad():
        next(iter(policy.lora.named_parameters().values())).fill_(float("inf"))
    assert not torch.isfinite(policy.score(inputs, 0)).all()
    assert policy.fell_back is None and policy.anchors == 2


@pytest.mark.parametrize("estimation", ["delta", "logpi"])
def test_estimates_under_moved_adapters_are_algorithm_1_by_finite_differences(tiny_model_dir, float64_rmsnorm,  # noqa: F811
                                                                               estimation):
    """With the adapters away from the reference, each non-anchor estimate is Algorithm 1 computed
    independently: the anchors' mean of their exact value plus the directional derivative, by central
    finite differences in float64, along the aligned embedding difference e_j - e_i, plus the target
    term, y_j's tokens scored in y_i's contexts less y_i's own, from full logits (delta mode: of
    log pi_c - log pi_ref; logpi mode: of log pi_c, with log pi_ref(y_i) - log pi_ref(y_j) added)."""
    sc = LoRAPolicyScorer(tiny_model_dir, 2, anchors=2, estimation=estimation, dtype=torch.float64, lora=SMALL,
                          score_batch_size=3, seed=1)
    seqs = tuple(tokenize_responses(load_tokenizer(tiny_model_dir), "Rank by criterion 1: which list is best?",
                                    ["3 1 2", "5 0 2 7", "1 1", "4 2 9 9 1"]))
    (ref_logp, s_ref), = reference_terms_batch(sc.model, [seqs], sc.pad_token_id)  # float64 [4], float32 [4, 4]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in sc.lora.named_parameters().values():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    one = PolicyInputs(("ex",), (seqs,), ref_logp[None], s_ref[None], encode_tiers_batch([[[0], [1], [2], [3]]], [4]))
    estimated = sc.score(one, iteration=4)[0] / sc.beta  # [k, M]: delta estimates (exact at anchors)
    anchors = sc.last_scores.is_anchor[0].nonzero().flatten().tolist()
    exact = sc.exact_scores(one)[0] / sc.beta  # [k, M]
    emb, lengths = response_embeddings(sc.model, seqs)  # [M, T, d], [M]

    def logp(i: int, embeds: torch.Tensor, cluster: int | None) -> float:
        batch = pad_batch([seqs[i]], sc.pad_token_id)
        with sc.lora.route([cluster]) if cluster is not None else contextlib.nullcontext(), torch.no_grad():
            return sequence_logprobs(sc.model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                     inputs_embeds=embeds).item()

    def derivative(i: int, j: int, cluster: int | None) -> float:
        """d log pi(y_i) along e_j - e_i over the aligned response positions (Richardson-extrapolated)."""
        batch = pad_batch([seqs[i]], sc.pad_token_id)
        h = embed(sc.model, batch.input_ids).detach()  # [1, L, d]
        direction = torch.zeros_like(h)
        cut, start = int(min(lengths[i], lengths[j])), seqs[i].response_start
        direction[0, start:start + cut] = (emb[j, :cut] - emb[i, :cut]).to(h.dtype)

        def central(eps: float) -> float:
            return (logp(i, h + eps * direction, cluster) - logp(i, h - eps * direction, cluster)) / (2 * eps)

        return (4 * central(0.01) - central(0.02)) / 3

    def target(i: int, j: int, cluster: int | None) -> float:
        """sum_t log p(y_j[t] | x, y_i[:t]) - log p(y_i[t] | x, y_i[:t]) over the aligned positions."""
        with sc.lora.route([cluster]) if cluster is not None else contextlib.nullcontext(), torch.no_grad():
            logits = sc.model(torch.tensor([seqs[i].input_ids])).logits[0]  # [L, V]
        logp_all, start = torch.log_softmax(logits.double(), dim=-1), seqs[i].response_start
        own, other = seqs[i].input_ids[start:], seqs[j].input_ids[seqs[j].response_start:]
        return float(sum(logp_all[start + t - 1, other[t]] - logp_all[start + t - 1, own[t]]
                         for t in range(min(len(own), len(other)))))

    def first_order(i: int, j: int, cluster: int | None) -> float:
        return derivative(i, j, cluster) + target(i, j, cluster)

    assert len(anchors) == 2
    for c in range(2):
        for j in set(range(4)) - set(anchors):
            if estimation == "delta":
                by_hand = sum(exact[c, i] + first_order(i, j, c) - first_order(i, j, None) for i in anchors) / 2
            else:
                by_hand = sum(exact[c, i] + ref_logp[i] + first_order(i, j, c) for i in anchors) / 2 - ref_logp[j]
            assert float(estimated[c, j]) == pytest.approx(float(by_hand), abs=1e-5), (c, j)
            assert abs(float(estimated[c, j] - exact[c, j])) > 1e-3  # moved adapters: a real estimate, not the exact value
