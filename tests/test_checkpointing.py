"""Gradient checkpointing of the decoder layers (moplex_core.lm.checkpointing): the same bits, less memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_fixtures import layer_runs, tiny_model_dir  # noqa: F401  (fixtures)
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen3Config)
from transformers.modeling_layers import GradientCheckpointingLayer

from moplex_core.estimate import anchor_pass
from moplex_core.lm.checkpointing import checkpoint_layers
from moplex_core.lm.lean import make_lean
from moplex_core.lm.loading import load_model, load_tokenizer
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA
from moplex_core.lm.tokenize import TokenizedResponse, tokenize_responses

RESPONSES = ["1. Apples 2. Pears", "A longer list: figs, plums, cherries and grapes", "None.", "Pears, then apples"]


def _model(model_dir: Path, dtype: torch.dtype, dropout: float) -> tuple[torch.nn.Module, MultiLoRA]:
    model = load_model(model_dir, dtype=dtype)
    lora = MultiLoRA(model, 3, LoRASettings(r=4, alpha=8.0, dropout=dropout), seed=0)
    moved = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every adapter away from the base model, each its own way
        for name, p in lora.named_parameters().items():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=moved) * 0.05)
    return model, lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [False, True], ids=["rows whole", "shared prompts"])
@pytest.mark.parametrize("step", ["E-step", "M-step", "M-step with LoRA dropout"])
def test_checkpointed_layers_run_again_and_give_the_same_bits(tiny_model_dir, layer_runs,  # noqa: F811
                                                               dtype, grouped, step):
    # The passes as LoRAPolicyScorer runs them: the E-step's input gradients inside the route and
    # requires_grad(False), the M-step's backward after both have closed (the layers run again
    # outside the route); with shared prompts a prompt pass writes the cache that the rows continue
    # (the layers run again on the keys they saw, not on the longer ones the cache holds by then).
    tokenizer = load_tokenizer(tiny_model_dir)
    one, other = (tokenize_responses(tokenizer, prompt, RESPONSES) for prompt in ("Which list is best?", "Best?"))
    rows, adapters = [one[0], one[1], other[2], other[0], one[3]], [0, 0, 1, 1, 2]
    groups = [(seq in one, c) for seq, c in zip(rows, adapters)] if grouped else None
    dropout = 0.3 if step.endswith("dropout") else 0.0

    def run(model, lora) -> list[torch.Tensor]:
        route = lambda sub: lora.route([adapters[r] for r in sub])  # noqa: E731
        torch.manual_seed(5)  # the dropout masks
        if step == "E-step":
            with lora.requires_grad(False):
                passed = anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=True, groups=groups, route=route,
                                     alternatives=[one] * len(rows))
            return [passed.logp, passed.input_grads, passed.target_terms]
        params = list(lora.named_parameters().values())
        with lora.requires_grad(True):
            passed = anchor_pass(model, rows, tokenizer.pad_token_id, input_grads=False, keep_graph=True,
                                 groups=groups, route=route)
        (torch.arange(1.0, len(rows) + 1, dtype=torch.float64) * passed.logp).sum().backward()
        return [passed.logp.detach(), *(p.grad for p in params)]

    model, lora = _model(tiny_model_dir, dtype, dropout)
    lora.train_dropout(dropout > 0)
    layers = model.config.num_hidden_layers
    layer_runs[0] = 0
    expected = run(model, lora)
    as_it_is = layer_runs[0]
    for p in lora.named_parameters().values():
        p.grad = None
    assert checkpoint_layers(model) == checkpoint_layers(model) == layers  # a second call changes nothing
    layer_runs[0] = 0
    got = run(model, lora)
    # every layer of a pass with a gradient runs twice; the E-step's prompt pass has none
    prompt_pass = 0 if not grouped else layers if step == "E-step" else 2 * layers
    assert (as_it_is, layer_runs[0]) == ((2 if grouped else 1) * layers, 2 * layers + prompt_pass)
    assert all(t.abs().max() > 0 for t in expected[1:])  # the compared gradients are not all zero
    for ours, reference in zip(got, expected, strict=True):
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)


def test_a_model_without_decoder_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no decoder layers .* gradient_checkpointing = false"):
        checkpoint_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_a_layer_inside_another_runs_again_with_it_not_on_its_own() -> None:
    class Inner(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).tanh()

    class Outer(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 2

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(Outer(), Outer()), torch.randn(3, 4, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    assert checkpoint_layers(model) == 2
    assert "forward" in vars(model[0]) and "forward" not in vars(model[0].inner)
    assert torch.equal(torch.autograd.grad(model(x).sum(), x)[0], expected)


def _eight_layers(checkpointed: bool) -> tuple[torch.nn.Module, MultiLoRA]:
    """A Qwen3 of 8 layers, width 64, lean modules and 3 adapters, for memory: each pass's activations
    are most of what it holds."""
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    make_lean(model)
    lora = MultiLoRA(model, 3, LoRASettings(r=4, alpha=8.0), seed=0)
    if checkpointed:
        checkpoint_layers(model)
    return model, lora


@pytest.mark.parametrize("kind", ["E-step", "M-step"])
def test_checkpointed_passes_hold_less_at_their_peak(kind, monkeypatch) -> None:
    # measured as benchmarks/activation_memory.py measures a pass's peak (PeakBytes), on 8 layers: the
    # activations of every layer against each layer's input and one layer's activations at a time
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from activation_memory import pass_peak

    embeds = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(1))
    peaks = []
    for checkpointed in (False, True):
        model, lora = _eight_layers(checkpointed)
        with lora.route([0, 1, 2, 0]), lora.requires_grad(kind == "M-step"):
            pass_peak(model, embeds, kind == "E-step")  # the E-step's stacked adapters are made once
            peaks.append(pass_peak(model, embeds, kind == "E-step"))
    assert 0 < peaks[1] < 0.5 * peaks[0], peaks


def _decoder(kind: str) -> tuple[torch.nn.Module, MultiLoRA]:
    """A small GPT-2 (its blocks take the cache by position, Conv1D projections) or Llama with moved adapters."""
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=64, n_positions=64))
        targets = ("c_attn", "c_proj", "c_fc")
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
        targets = ("q_proj", "v_proj", "down_proj")
    lora = MultiLoRA(model.eval(), 2, LoRASettings(r=2, alpha=4.0, target_modules=targets), seed=0)
    with torch.no_grad():
        for name, p in lora.named_parameters().items():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    return model, lora


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_other_decoders_continue_a_shared_prompt_through_checkpointed_layers_to_the_same_bits(kind) -> None:
    # One pass takes the input gradients and keeps its graph for the M-step's backward into the
    # adapters after it (estimate.anchor_pass with both): every layer runs again at each backward.
    model, lora = _decoder(kind)
    first, second = [5, 6, 7, 8], [9, 10, 11]
    rows = [TokenizedResponse(first + [20, 21, 22], 4), TokenizedResponse(first + [23, 24], 4),
            TokenizedResponse(second + [30, 31, 32, 33], 3)]
    adapters = [0, 0, 1]
    params = list(lora.named_parameters().values())

    def run() -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        passed = anchor_pass(model, rows, 0, input_grads=True, keep_graph=True, groups=[(0, 0), (0, 0), (1, 1)],
                             route=lambda sub: lora.route([adapters[r] for r in sub]))
        passed.logp.sum().backward()
        return [passed.logp.detach(), passed.input_grads, *(p.grad for p in params)]

    expected = run()
    assert checkpoint_layers(model) == 3
    got = run()
    assert all(t.abs().max() > 0 for t in expected)
    for ours, reference in zip(got, expected, strict=True):
        assert torch.equal(ours, reference)


def test_a_checkpointed_continuation_keeps_no_layers_keys_until_its_backward(monkeypatch) -> None:
    # After an M-step pass through a shared prompt, before its backward: what the graph holds. The
    # checkpointed layers hold their inputs, not the prefix and continuation keys of every layer.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from activation_memory import PeakBytes

    prompt = torch.randint(1, 64, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    rows = [TokenizedResponse(prompt + [3 + r] * 8, len(prompt)) for r in range(8)]  # one prompt, two adapters
    held = []
    for checkpointed in (False, True):
        model, lora = _eight_layers(checkpointed)
        with PeakBytes() as counted:
            passed = anchor_pass(model, rows, 0, input_grads=False, keep_graph=True,
                                 groups=[r // 4 for r in range(8)], route=lambda sub: lora.route([r // 4 for r in sub]))
            held.append(counted.live)
            passed.logp.sum().backward()
    assert 0 < held[1] < 0.2 * held[0], held  # 0.15 (2.8 of 18.8 MB); 0.27 when the cache kept its keys
