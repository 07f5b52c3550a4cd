"""Qwen2/Qwen3 RMSNorm and SwiGLU MLP that keep fewer bytes for the backward (DESIGN 5.5).

Every moplex pass that takes a gradient (the E-step's w.r.t. the input embeddings, the M-step's into
the adapters, the cache's w.r.t. the input embeddings) keeps each decoder layer's activations until
its backward; they, not the weights, set a pass's peak memory. Two of transformers' modules keep
more than their backward needs:

- ``Qwen3RMSNorm`` (and Qwen2's: the same code) casts its input to float32 first, so autograd keeps
  that float32 copy, 4 bytes an element, for the square and the scaling. Four of them run per Qwen3
  layer (before attention, before the MLP, on every query head and every key head). On a bf16 (or
  float16) input `LeanRMSNorm` keeps the input in its own dtype and the per-vector 1/rms, and casts
  again in the backward; on a float32 input the copy is the input itself, and it runs autograd.
  Off the CPU (a GPU) it runs torch's ``rms_norm`` instead: one fused kernel forward and one
  backward, keeping the same input and 1/rms, where transformers' ops launch several elementwise
  kernels each way, most in PyTorch's slow path for operands of two dtypes. On the H200 that made
  the plain pass of 12 rows 1.45x faster (150.5 against 217.9 ms, the same 14.8 GiB;
  docs/gpu-efficiency.md). It rounds once, weight times x / rms(x) in float32, where transformers
  rounds x / rms(x) to bf16 before the weight: nearer to float32, not transformers' bits.
- The MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` keeps the gate for the SiLU and both factors for
  the product. On bf16 (or float16) activations `LeanSwiGLUMLP` keeps the gate and up, and
  recomputes SiLU(gate) in the backward.

On the CPU both run autograd on float32 (and float64) activations: there the norm has nothing to
save, and the MLP's saving (a sixth of a float32 pass's activations) cost the CPU's passes time,
where memory is not what limits them (in a throwaway A/B of benchmarks/em_gpu.py --cpu, full
computation's M-step about 10% slower). A GPU runs bf16 (`dtype: auto`).

`benchmarks/activation_memory.py` counts what each pass keeps. On the CPU the forward runs
transformers' ops in transformers' order, and the backward runs the ops autograd runs for them (the
same kernels, operands and order: derivatives.yaml's formulas for mul, rsqrt, mean, pow, silu and
the casts), so outputs and gradients are equal to the bit (tests/test_lean.py). `make_lean` swaps
the modules of a loaded model in place; their parameters and names stay, so state dicts and PEFT
adapter names do not change.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from moplex_core.lm.backward import first_order_only

LEAN_MODELS = ("qwen2", "qwen3")
"""Model types whose RMSNorm and SiLU MLP `make_lean` replaces (their modules' code is the one
reproduced here)."""
_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm")
_MLPS = ("Qwen2MLP", "Qwen3MLP")


def make_lean(model: PreTrainedModel) -> int:
    """Replace, in place, the RMSNorm and SiLU-gated MLP modules of a Qwen2/Qwen3 ``model`` by
    `LeanRMSNorm` and `LeanSwiGLUMLP` (the same parameters and submodules); other models are left
    as they are. Returns how many modules were replaced."""
    if getattr(model.config, "model_type", None) not in LEAN_MODELS:
        return 0
    replaced = 0
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind in _NORMS:
            model.set_submodule(name, LeanRMSNorm(module.weight, module.variance_epsilon))
        elif kind in _MLPS and type(module.act_fn).__name__ in ("SiLUActivation", "SiLU"):
            model.set_submodule(name, LeanSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj))
        else:
            continue
        replaced += 1
    return replaced


class LeanRMSNorm(nn.Module):
    """weight * (x / rms(x)). On the CPU computed in float32 and cast back to x's dtype before the
    weight, as transformers' Qwen2/Qwen3 RMSNorm; on a half-precision x under autograd it keeps x (its
    own dtype) and 1/rms for the backward, otherwise it runs transformers' ops. Elsewhere torch's
    ``rms_norm`` (fused on CUDA; the weight applied in float32, one rounding)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        if torch.is_grad_enabled() and x.dtype.itemsize < 4:
            return _RMSNorm.apply(x, self.weight, self.variance_epsilon)
        # Without a graph, or where the float32 copy is x itself (float32: nothing to save) or smaller
        # (float64), autograd's own graph of the same ops. (In float32 autograd sums x's gradient from
        # the square, the scaling and the residual in its own order, which one node could not keep.)
        return _rms_norm(x, self.weight, self.variance_epsilon)[0]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * (x / rms(x)) like x, 1/rms(x) float32 [..., 1]): transformers' ops in its order."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    return weight * (x32 * rstd).to(x.dtype), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):  # like the output
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # weight * normed: grad * normed, summed to the weight's shape
            grad_weight = (grad * (x32 * rstd).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        grad_h = (grad * weight).to(x.dtype).to(torch.float32)  # through weight * normed and both casts
        grad_rstd = (grad_h * x32).sum_to_size(rstd.shape)  # h = x32 * rstd, w.r.t. rstd
        grad_mean = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt's backward, from its result
        grad_square = grad_mean.expand_as(x32) / x32.shape[-1]  # mean's backward
        grad_x = grad_h * rstd + grad_square * (2.0 * x32)  # h w.r.t. x32, plus pow(2)'s backward
        return grad_x.to(x.dtype), grad_weight, None


class LeanSwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), as transformers' Qwen2/Qwen3 MLP; on half-precision
    activations under autograd it keeps the gate and up for the backward and recomputes the SiLU
    there, otherwise it runs transformers' ops."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # [..., intermediate] each
        if torch.is_grad_enabled() and gate.dtype.itemsize < 4:
            return self.down_proj(_SwiGLU.apply(gate, up))
        return self.down_proj(F.silu(gate) * up)  # autograd's own graph (float32: the CPU's, see the module)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        return grad_gate, grad_up
