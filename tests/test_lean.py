"""The lean RMSNorm and SwiGLU MLP give transformers' own outputs and gradients to the bit, and keep
fewer bytes for the backward."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config, Qwen3Config

from moplex_core.lm.lean import LeanRMSNorm, LeanSwiGLUMLP, make_lean
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA

B, L = 3, 10


def _model(family: str, dtype: torch.dtype) -> PreTrainedModel:
    """A random 2-layer Qwen2 or Qwen3 (seeded), stock transformers modules."""
    config_class, heads = (Qwen3Config, {"head_dim": 8}) if family == "qwen3" else (Qwen2Config, {})  # Qwen2: 32 / 4
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", **heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # RMSNorm weights start at one; move them so that their gradient path counts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _pass(model: PreTrainedModel, embeds: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hidden states and the gradient of <weight, hidden> w.r.t. the input embeddings and every
    parameter that takes one."""
    embeds = embeds.detach().requires_grad_(True)
    hidden = model.model(inputs_embeds=embeds, attention_mask={"full_attention": None}).last_hidden_state
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((hidden.float() * weight).sum(), [embeds, *params])
    return (hidden.detach(), *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("trained", ["inputs", "norm weights", "adapters"])
def test_lean_modules_give_transformers_outputs_and_gradients_to_the_bit(family, dtype, trained) -> None:
    stock, lean = _model(family, dtype), _model(family, dtype)
    replaced = make_lean(lean)
    norms = 4 * 2 + 1 if family == "qwen3" else 2 * 2 + 1  # Qwen3 also normalises the query and key heads
    assert replaced == norms + 2
    assert sum(isinstance(m, LeanRMSNorm) for m in lean.modules()) == norms
    assert sum(isinstance(m, LeanSwiGLUMLP) for m in lean.modules()) == 2
    assert lean.state_dict().keys() == stock.state_dict().keys()
    for model in (stock, lean):
        model.requires_grad_(False)
        if trained == "norm weights":
            for name, p in model.named_parameters():
                p.requires_grad_("norm" in name)
        if trained == "adapters":
            lora = MultiLoRA(model, 2, LoRASettings(r=4, alpha=8.0), seed=0)
            with torch.no_grad():
                for name, p in lora.named_parameters().items():
                    p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype))
            model.lora = lora
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(B, L, 32, generator=generator).to(dtype)
    weight = torch.randn(B, L, 32, generator=generator)

    def routed(model: PreTrainedModel):
        return model.lora.route([0, 1, 0]) if trained == "adapters" else contextlib.nullcontext()

    with routed(stock):
        theirs = _pass(stock, embeds, weight)
    with routed(lean):
        ours = _pass(lean, embeds, weight)
        with torch.no_grad():  # and without a graph (scoring): the same ops
            scored = lean.model(inputs_embeds=embeds, attention_mask={"full_attention": None}).last_hidden_state
    assert len(ours) == len(theirs) >= 2
    for expected, got in zip(theirs, ours, strict=True):
        assert got.dtype == expected.dtype and torch.isfinite(got).all() and torch.equal(got, expected)
    assert all(g.abs().max() > 0 for g in ours[1:])  # the compared gradients are not all zero
    assert torch.equal(scored, ours[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lean_modules_keep_fewer_bytes_for_the_backward(dtype, monkeypatch) -> None:
    # counted as benchmarks/activation_memory.py counts them (saved_tensors_hooks, parameters aside)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from activation_memory import saved_bytes

    stock, lean = _model("qwen3", dtype), _model("qwen3", dtype)
    make_lean(lean)
    for model in (stock, lean):
        model.requires_grad_(False)
    embeds = torch.randn(B, L, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    # per token, in bf16 and float16: the MLP keeps SiLU(gate) no more (48 elements a layer, 2 bytes), and
    # the four norms of a layer keep their input in half precision, not float32 (32 + 32 + 4 x 8 + 2 x 8
    # elements), and the final norm too (32), at 2 bytes less each; in float32 both run autograd
    expected = 2 * 48 * 2 + (2 * (32 + 32 + 32 + 16) + 32) * 2 if dtype != torch.float32 else 0
    assert saved_bytes(stock, embeds, True) - saved_bytes(lean, embeds, True) == B * L * expected


def test_off_the_cpu_the_norm_is_torchs_rms_norm_which_rounds_once(monkeypatch) -> None:
    # On a GPU LeanRMSNorm runs torch's fused rms_norm (the meta device stands in: no values, the
    # same dispatch off the CPU); on the CPU transformers' ops, above. The call it makes on meta is
    # run again on the CPU's tensors, for its values: torch's op applies the weight in float32 and
    # rounds once, so in bf16 it is nearer to float64 than transformers' two roundings, and within
    # bf16's rounding of it everywhere. Rows of eps's scale (their mean square 1e-6) see the eps.
    calls = []
    rms_norm = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm",
                        lambda *args, **kw: calls.append((args, kw)) or rms_norm(*args, **kw))
    generator = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter((1 + 0.3 * torch.randn(64, generator=generator)).to(torch.bfloat16))
    scale = torch.tensor([4.0, 1e-3]).repeat_interleave(128)[:, None]  # [256, 1]
    x = (scale * torch.randn(256, 64, generator=generator)).to(torch.bfloat16)
    norm = LeanRMSNorm(weight, 1e-6)
    transformers_rounding = norm(x)
    assert not calls
    meta_x, meta_weight = x.to("meta"), torch.nn.Parameter(weight.to("meta"))
    with torch.no_grad():
        on_meta = LeanRMSNorm(meta_weight, 1e-6)(meta_x)
    assert len(calls) == 1 and on_meta.shape == x.shape and on_meta.dtype == torch.bfloat16
    on_cpu = {id(meta_x): x, id(meta_weight): weight}
    args, kw = calls[0]
    with torch.no_grad():
        fused = rms_norm(*(on_cpu.get(id(a), a) for a in args), **{k: on_cpu.get(id(v), v) for k, v in kw.items()})
    x64, w64 = x.double(), weight.detach().double()
    exact = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    fused_error = (fused.double() - exact).abs()
    transformers_error = (transformers_rounding.double() - exact).abs()
    assert (fused_error <= exact.abs() * 2.0**-8).all()  # one rounding: at most half a bf16 ulp
    assert fused_error.mean() < transformers_error.mean()
