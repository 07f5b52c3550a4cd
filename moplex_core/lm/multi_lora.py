"""k LoRA adapters on one base model, applied per row of a batch (DESIGN 5.5).

Every target ``nn.Linear`` (W: d_in -> d_out; or transformers' ``Conv1D``, GPT-2's, which stores W
transposed) of a causal LM is replaced in place by a `MultiLoRALinear` holding k adapters stacked in
two parameters, adapter c as

    A_c = lora_A[c]: [d_in, r]    (PEFT's ``lora_A.weight`` [r, d_in], transposed)
    B_c = lora_B[c]: [r, d_out]   (PEFT's ``lora_B.weight`` [d_out, r], transposed)

and computing, for row b of a batch routed to adapter c_b,

    y_b = x_b W^T + (alpha / r) * (dropout(x_b) A_{c_b}) B_{c_b}

`MultiLoRA.route` says which adapter each row of the next forwards uses. Each row's adapter is
gathered into [B, d_in, r] and [B, r, d_out] and applied by one ``bmm`` and one ``baddbmm`` that
accumulates into the base output, so one forward serves rows of all k clusters; a batch of one
adapter takes two plain matmuls. Without gradients into the adapters (the E-step's input-gradient
pass, scoring) the rows' adapters are gathered from the stacks in the activations' dtype, a copy
that each layer keeps until an adapter changes or an M-step pass drops it (`MultiLoRALinear.frozen`;
240 MB in bf16 for Qwen3-0.6B at k = 12, r = 16; in the masters' own dtype the parameters
themselves, detached), so such a pass casts nothing, and a pass without any gradient (scoring) skips
the autograd Function. With gradients into the adapters (the M-step) the layer's own autograd
Function (`_LoRALinear`) takes the rows' adapters from the stacked parameters themselves and its
backward writes their gradients, each adapter's rows summed by one GEMM: one autograd leaf per layer
and matrix, where k separate parameters would cost a stack forward and, backward, a select, a detach
and a gradient accumulation per adapter (host work the GPU waits on). That backward also accumulates
the LoRA part of dL/dx into the base part in the matmul that computes it, where autograd would write
it and add it in a separate pass. The gradient is zero at the adapters a pass did not route, and
`moplex_core.lm.routed_adam.RoutedAdam` steps only the adapters a minibatch routed, so the others
stay exactly where they are, as PEFT's inactive adapters under AdamW. Outside a route every adapter
is off and the model is exactly the base model, pi_ref (no second copy of the weights). The base
model's own weights are frozen.

The adapters are read and written in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors`` per adapter), so ``PeftModel.from_pretrained(base, path)`` loads what
`MultiLoRA.save_peft` writes, and `MultiLoRA.load_peft` reads what PEFT saved. Under a bf16/fp16
base model the adapter weights are float32 (the optimizer's master copy) and are cast to the
activations' dtype for the two matmuls; otherwise they have the base model's dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers.pytorch_utils import Conv1D

from moplex_core.lm.backward import first_order_only
from moplex_core.lm.device import to_device

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PeftModel(base) names base's modules base_model.model.<name>


@dataclass(frozen=True)
class LoRASettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass
class _Route:
    """The current batch's routing, shared by every layer of a `MultiLoRA`; adapters off when
    ``rows`` is empty."""

    rows: tuple[int, ...] = ()  # row b of the batch -> adapter rows[b]
    present: tuple[int, ...] = ()  # the adapters the batch uses, ascending
    adapters: torch.Tensor | None = None  # int64 [B] on the model's device: rows, when more than one is present
    summing: tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None = None  # `to_adapters`'s, with what it was made for

    def to_adapters(self, scaling: float, dtype: torch.dtype, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the adapters present, int64 [p], and S [p, B]: ``scaling`` where row b uses the i-th of
        them, else 0) on ``device``, S in ``dtype`` (the masters'): S @ the rows' gradients, flattened,
        sums each present adapter's rows and scales them in one GEMM (`_into_stack`). Made by the first
        layer of a pass that asks, for these rows, scaling, dtype and device."""
        key = (self.rows, scaling, dtype, device)
        if self.summing is None or self.summing[0] != key:
            present = list(self.present)
            summing = torch.zeros(len(present), len(self.rows), dtype=dtype)  # [p, B]
            summing[[present.index(c) for c in self.rows], list(range(len(self.rows)))] = scaling
            self.summing = (key, (to_device(torch.tensor(present), device), to_device(summing, device)))
        return self.summing[1]

    def snapshot(self) -> tuple[Any, ...]:
        """The routing as it is now, for `restore` (a checkpointed layer runs again in its backward,
        after the route has changed: moplex_core.lm.checkpointing). Not ``summing``: a cache that
        `to_adapters` checks against the rows it was made for."""
        return self.rows, self.present, self.adapters

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        self.rows, self.present, self.adapters = snapshot


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (or transformers' ``Conv1D``, GPT-2's projections: the same map with W
    stored transposed) plus k LoRA adapters, one chosen per row by the shared route."""

    def __init__(self, base: nn.Linear | Conv1D, k: int, settings: LoRASettings, route: _Route,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.base, self.route, self.scaling = base, route, settings.scaling
        self.transposed = isinstance(base, Conv1D)  # W stored [d_in, d_out], computing x W + b
        d_in, d_out = base.weight.shape if self.transposed else (base.in_features, base.out_features)
        device = base.weight.device
        dtype = base.weight.dtype if base.weight.dtype in (torch.float32, torch.float64) else torch.float32
        # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(d_in), 1/sqrt(d_in)), B = 0,
        # so every adapter starts exactly at the base model.
        bound = 1.0 / math.sqrt(d_in)
        a = (torch.rand(k, d_in, settings.r, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))  # [k, d_in, r]
        self.lora_B = nn.Parameter(torch.zeros(k, settings.r, d_out, device=device, dtype=dtype))  # [k, r, d_out]
        self.dropout_p = settings.dropout
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self._frozen: tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None = None  # (key, (A, B))

    def frozen(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every adapter in ``dtype`` outside autograd, A [k, d_in, r] and B [k, r, d_out]: what a pass
        without gradients into the adapters reads (the E-step's input-gradient pass, scoring), so that
        it casts nothing per layer, and indexes instead. Rebuilt when an adapter changed: an optimizer
        step, ``load_peft`` or any in-place update on a parameter moves its version counter; new storage
        (``Module.to``, a copy of the model, a ``.data`` assignment, a replaced parameter) moves its
        address. Not seen: writes that bypass both, through ``p.data`` (``p.data.copy_``): moplex makes
        none. A pass with gradients into the adapters drops the copy (an M-step does not carry k
        adapters' copy). In the masters' own dtype it is the parameters themselves, detached."""
        masters = (self.lora_A, self.lora_B)
        key = (dtype, *(p._version for p in masters), *(p.data_ptr() for p in masters))
        if self._frozen is None or self._frozen[0] != key:
            # Outside inference mode even under it: the copy may be saved for a later input-gradient backward.
            with torch.inference_mode(False), torch.no_grad():
                self._frozen = (key, (self.lora_A.detach().to(dtype), self.lora_B.detach().to(dtype)))
        return self._frozen[1]

    @property
    def base_weight(self) -> torch.Tensor:
        """W as ``nn.Linear`` holds it, [d_out, d_in] (a view of a Conv1D's)."""
        return self.base.weight.T if self.transposed else self.base.weight

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without the stack of `frozen` (a cache, rebuilt on use)."""
        return {**self.__dict__, "_frozen": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed, present = self.route.rows, self.route.present
        if not routed:
            return self.base(x)
        # x: [B, L, d_in], or [B*L, d_in] where a block flattens the rows' positions (a shared expert's MLP)
        if x.shape[0] != len(routed) and (x.dim() != 2 or x.shape[0] % len(routed)):
            raise ValueError(f"the batch has {x.shape[0]} rows but the route names adapters for {len(routed)}; "
                             "route exactly the rows of the batch (MultiLoRA.route)")
        if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
            raise RuntimeError("the multi-LoRA layer runs in the model's own dtype, not under torch.autocast: load "
                               "the model in bfloat16 instead (its adapters keep float32 masters)")
        dropped = self.dropout(x) if self.dropout_p > 0 else x  # no module call for no dropout
        pick = present[0] if len(present) == 1 else self.route.adapters  # the adapter, or each row's [B]
        if len(present) == 1:  # one adapter for every row: the rows' positions as one matrix, plain GEMMs
            rows = x.reshape(-1, x.shape[-1])  # [N, d_in]
        else:  # [B, L, d_in] (a decoder's already is)
            rows = x if x.dim() == 3 else x.reshape(len(routed), -1, x.shape[-1])
        lora_input = None if dropped is x else dropped.reshape(rows.shape)
        if torch.is_grad_enabled() and self.lora_A.requires_grad:  # into the adapters (an M-step)
            self._frozen = None  # this pass's step will change the adapters: the copy would be stale
            summing = (None if isinstance(pick, int)
                       else self.route.to_adapters(self.scaling, self.lora_A.dtype, self.lora_A.device))
            out = _LoRALinear.apply(rows, lora_input, self.base_weight, self.base.bias, self.lora_A, self.lora_B,
                                    self.scaling, pick, summing)
        else:
            a, b = (_pick(stacked, pick, x.dtype) for stacked in self.frozen(x.dtype))  # nothing to cast: a copy
            if torch.is_grad_enabled():
                out = _LoRALinear.apply(rows, lora_input, self.base_weight, self.base.bias, a, b, self.scaling)
            else:  # no graph to record: the same ops without the autograd Function's cost per call
                out = _lora_linear(rows, lora_input, self.base_weight, self.base.bias, a, b, self.scaling)[0]
        return out if rows is x else out.view(*x.shape[:-1], out.shape[-1])  # [N or B, (L,) d_out] -> x's shape


class _LoRALinear(torch.autograd.Function):
    """out = x W^T + bias + s (x' A) B, with x' the LoRA input (x itself, or x after dropout), over
    the positions of all rows as one matrix x [N, d_in] with one adapter (A [d_in, r], B [r, d_out]),
    or over rows x [B, L, d_in] with one adapter per row (A [B, d_in, r], B [B, r, d_out]); W and bias
    are frozen.

    Without ``pick``, ``a`` and ``b`` are the rows' adapters, constants (a pass without gradients
    into them). With it, they are the k stacked masters ([k, d_in, r], [k, r, d_out]) and ``pick`` the
    adapter of every row (an int) or of each row (int64 [B], with ``summing`` = `_Route.to_adapters`):
    the rows' adapters are taken from the stacks and cast to x's dtype here, outside autograd, and the
    backward writes the stacks' gradients itself (`_into_stack`). Autograd would record a select or a
    gather and a cast per matrix, and its backward a cast back and a scatter into zeros (on CUDA an
    accumulating ``index_put``, which sorts the rows first): host work and launches that a GPU waits
    on in an M-step's small passes.

    Autograd of the same ops would write the LoRA part of dL/dx, then add it to the base part: per
    projection, three x-sized tensors more read or written than the two here, where (when x' is x)
    the LoRA part is accumulated into the base part by the matmul that computes it. x and x A are
    kept for the backward only when A or B need gradients."""

    @staticmethod
    def forward(ctx, x, lora_input, weight, bias, a, b, scaling, pick=None, summing=None):
        into_adapters = ctx.needs_input_grad[4:6]
        if pick is None and any(into_adapters):
            raise RuntimeError("gradients into the adapters go to the stacked masters: pass them with pick")
        ctx.stacks = None
        if pick is not None:
            ctx.stacks = (a.shape[0], a.dtype, pick, summing)  # (k, the masters' dtype, ...): `_into_stack`'s
            a, b = _pick(a, pick, x.dtype), _pick(b, pick, x.dtype)  # [(B,) d_in, r], [(B,) r, d_out]
        source = x if lora_input is None else lora_input  # like x
        out, xa = _lora_linear(x, lora_input, weight, bias, a, b, scaling)  # [..., d_out], [..., r]
        ctx.scaling, ctx.separate = scaling, lora_input is not None
        ctx.save_for_backward(source if into_adapters[0] else None, weight, a, b, xa if into_adapters[1] else None)
        return out

    @staticmethod
    @first_order_only  # x A is kept without its graph: a second derivative would be wrong, so none
    def backward(ctx, grad_out):  # like out
        source, weight, a, b, xa = ctx.saved_tensors
        need_x, need_lora_input, need_weight, need_bias, need_a, need_b = ctx.needs_input_grad[:6]
        if need_weight or need_bias:
            raise RuntimeError("MultiLoRA freezes the base model's weights; they get no gradient (requires_grad_"
                               "(False) on them, or train them outside MultiLoRA)")
        scaling = ctx.scaling
        grad_xa = _product(grad_out, b.mT)  # like xa, without the scaling
        grad_x = grad_lora_input = grad_a = grad_b = None
        if need_x:
            grad_x = torch.matmul(grad_out, weight)  # like x
            if not ctx.separate:
                grad_x = _add_product(grad_x, grad_xa, a.mT, scaling)
        if need_lora_input:
            grad_lora_input = _product(grad_xa, a.mT).mul_(scaling)  # like x
        if need_a:  # like a (summed over the positions of each row), unscaled, into the stack
            grad_a = _into_stack(_product(source.mT, grad_xa), scaling, *ctx.stacks)
        if need_b:
            grad_b = _into_stack(_product(xa.mT, grad_out), scaling, *ctx.stacks)
        return grad_x, grad_lora_input, None, None, grad_a, grad_b, None, None, None


def _pick(stacked: torch.Tensor, pick: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The adapter ``pick`` of ``stacked`` [k, i, j] as [i, j] (a view where no cast is needed), or each
    row's, int64 [B], as [B, i, j]; in ``dtype``."""
    picked = stacked[pick] if isinstance(pick, int) else stacked.index_select(0, pick)
    return picked.to(dtype)


def _into_stack(grad: torch.Tensor, scaling: float, k: int, dtype: torch.dtype, pick: int | torch.Tensor,
                summing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The gradient of k stacked adapters [k, i, j] in ``dtype`` (the masters'; a bf16 pass's rows are
    summed and scaled in float32) from ``grad``, unscaled: that of adapter ``pick``, [i, j], or each
    row's, [B, i, j], which the present adapters' S [p, B] (``summing``, with their indices) sums per
    adapter in one GEMM. Exactly +0 at the adapters no row uses. A row whose gradient is not finite
    makes every present adapter's so (0 * inf in the GEMM): a failed step either way."""
    out = grad.new_zeros((k, *grad.shape[-2:]), dtype=dtype)  # [k, i, j]
    if isinstance(pick, int):
        out[pick].add_(grad, alpha=scaling)  # computed in the masters' dtype
        return out
    present, weights = summing  # [p], [p, B]
    sums = torch.mm(weights, grad.reshape(weights.shape[1], -1).to(dtype))  # [p, i * j]
    return out.index_copy_(0, present, sums.view(len(present), *grad.shape[-2:]))


def _lora_linear(x: torch.Tensor, lora_input: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 a: torch.Tensor, b: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T + bias + s (x' A) B, x' A) for x' = ``lora_input`` or x, and x [N, d_in] with one
    adapter (A [d_in, r], B [r, d_out]) or x [B, L, d_in] with one per row ([B, d_in, r], [B, r, d_out])."""
    xa = _product(x if lora_input is None else lora_input, a)  # [N, r] or [B, L, r]
    return _add_product(F.linear(x, weight, bias), xa, b, scaling), xa


def _product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right for 2D left [n, i] and right [i, j] (``mm``) or 3D [B, n, i] and [B, i, j] (``bmm``):
    the kernel called directly, where ``torch.matmul`` would reach it through reshapes and views, host
    work on every layer of a pass."""
    return torch.bmm(left, right) if right.dim() == 3 else torch.mm(left, right)


def _add_product(into: torch.Tensor, left: torch.Tensor, right: torch.Tensor, alpha: float) -> torch.Tensor:
    """``into += alpha * left @ right`` in place and returned, 2D ([n, j] += [n, i] @ [i, j]) or 3D
    ([B, n, j] += [B, n, i] @ [B, i, j])."""
    return into.baddbmm_(left, right, alpha=alpha) if right.dim() == 3 else into.addmm_(left, right, alpha=alpha)


def target_layers(model: nn.Module, target_modules: Sequence[str]) -> dict[str, nn.Linear | Conv1D]:
    """The layers of ``model`` that take adapters: each ``nn.Linear`` (or transformers' ``Conv1D``,
    GPT-2's) whose name ends in one of ``target_modules`` (train.lora_targets), by its full name.
    Raises `ValueError` when a name matches no such layer (naming the model's linear layers), or
    matches one the multi-LoRA layer cannot wrap: a subclass or a hooked layer (quantized, offloaded),
    or the output layer. Runs on a model built on the meta device as well, to check a model before any
    stage loads it."""
    targets = set(target_modules)
    output = model.get_output_embeddings()
    layers: dict[str, nn.Linear | Conv1D] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, nn.Linear | Conv1D):
            hooked = module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
            if type(module) not in (nn.Linear, Conv1D) or hooked:
                raise ValueError(f"{name} is a {type(module).__qualname__}{' with hooks' if hooked else ''}, not a "
                                 "plain torch.nn.Linear (or Conv1D); the multi-LoRA layer computes its base from its "
                                 "weight, which would not be this layer's output (a quantized layer, or one that "
                                 "accelerate's device_map offloads: load the model on one device)")
            if module is output:
                raise ValueError(f"target_modules (train.lora_targets) names the output layer ({name}), which takes "
                                 "no adapter here: it runs on the response tokens of a batch, not on its rows, so it "
                                 "cannot be routed per row; target the decoder layers' projections "
                                 "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
            layers[name] = module
    unmatched = sorted(targets - {name.rsplit(".", 1)[-1] for name in layers})
    if unmatched:
        last = {name: name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        linear = sorted({last[name] for name, module in model.named_modules()
                         if isinstance(module, nn.Linear | Conv1D) and module is not output})
        other = {last[name]: type(module).__qualname__ for name, module in model.named_modules()
                 if last[name] in unmatched and not isinstance(module, nn.Linear | Conv1D)}
        kinds = "".join(f"; {name} is a {layer_type}, not a linear layer" for name, layer_type in sorted(other.items()))
        experts = any("expert" in part for part in last.values())
        moe = ("; a mixture-of-experts model's expert projections are fused parameters, not layers: target the "
               "attention projections" if experts else "")
        example = (f"; e.g. --set train.lora_targets='{json.dumps(linear)}' (moplex experiment approximation: "
                   f"--lora-targets {','.join(linear)})" if linear else "")
        raise ValueError(f"target_modules (train.lora_targets) {unmatched} match no linear layer of "
                         f"{type(model).__name__}{kinds}; its linear layers (but the output layer): {linear or 'none'}"
                         f"{moe}{example}")
    return layers


class MultiLoRA:
    """k LoRA adapters injected into ``model`` (modified in place: its own weights are frozen and
    untouched, target linear layers are wrapped).

    The LoRA A matrices are drawn from a generator seeded by ``seed`` (the same adapters for the
    same seed, whatever the global RNG).
    """

    def __init__(self, model: nn.Module, k: int, settings: LoRASettings, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"need at least one adapter, got k = {k}")
        self.model, self.k, self.settings = model, k, settings
        model.requires_grad_(False)
        self._route = _Route()
        generator = torch.Generator().manual_seed(seed)
        self.layers: dict[str, MultiLoRALinear] = {}
        for name, module in target_layers(model, settings.target_modules).items():
            layer = MultiLoRALinear(module, k, settings, self._route, generator)
            model.set_submodule(name, layer)
            self.layers[name] = layer
        self._device = next(iter(self.layers.values())).lora_A.device
        # Built once: `requires_grad` runs before every scoring pass.
        params = {f"{name}.{part}": getattr(layer, part) for name, layer in self.layers.items()
                  for part in ("lora_A", "lora_B")}
        self._parameters = dict(sorted(params.items()))
        self.train_dropout(False)  # scoring until an M-step asks for it (a new module starts in training mode)

    def train_dropout(self, active: bool) -> None:
        """LoRA dropout on (an M-step) or off. Only the adapters' dropout: the base model's own modules
        keep their mode, eval, so a base model with dropout of its own (GPT-2's, a config's
        attention_dropout) scores as pi_ref was cached, without it."""
        for layer in self.layers.values():
            layer.dropout.train(active)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The adapters' parameters by a stable name, ``<module>.lora_A`` [k, d_in, r] and
        ``<module>.lora_B`` [k, r, d_out], sorted (a reproducible optimizer order)."""
        return dict(self._parameters)

    def at_base(self) -> bool:
        """True when every adapter is exactly the base model (all B = 0, as initialised)."""
        return all(not layer.lora_B.any() for layer in self.layers.values())

    @contextmanager
    def route(self, adapters: Sequence[int] | torch.Tensor) -> Iterator[None]:
        """Forwards inside use adapter ``adapters[b]`` for row b (int [B], values in 0..k-1)."""
        ids = torch.as_tensor(adapters, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.k:
            shown = ids.unique().tolist()[:10] if ids.numel() else "none"
            raise ValueError(f"route needs one adapter index in 0..{self.k - 1} per row, got {shown}")
        present = torch.unique(ids)  # [p] ascending
        previous = self._route.snapshot()
        self._route.rows, self._route.present = tuple(ids.tolist()), tuple(present.tolist())
        self._route.adapters = to_device(ids, self._device) if len(present) > 1 else None
        try:
            yield
        finally:
            self._route.restore(previous)

    @contextmanager
    def requires_grad(self, flag: bool) -> Iterator[None]:
        """Adapter parameters require grad (``flag``) inside and what they required before after. Off
        for passes that take gradients w.r.t. the inputs alone."""
        params = self._parameters.values()
        before = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(flag)
        try:
            yield
        finally:
            for p, previous in zip(params, before):
                p.requires_grad_(previous)

    # -- PEFT's format -------------------------------------------------------------------------

    def peft_state_dict(self, c: int) -> dict[str, torch.Tensor]:
        """Adapter c under PEFT's names and shapes (lora_A.weight [r, d_in], lora_B.weight [d_out, r])."""
        state = {}
        for name, layer in self.layers.items():
            state[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A[c].detach().T.contiguous().cpu()
            state[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B[c].detach().T.contiguous().cpu()
        return state

    def save_peft(self, directory: str | Path, names: Sequence[str], base_model_name_or_path: str) -> Path:
        """Write ``directory/<names[c]>/`` in PEFT's format for every adapter c.

        ``target_modules`` is written sorted and the JSON with sorted keys, so equal adapters give
        equal bytes in any process (PEFT writes its target set in hash-seed order)."""
        if len(names) != self.k:
            raise ValueError(f"need one name per adapter ({self.k}), got {len(names)}")
        transposed = any(layer.transposed for layer in self.layers.values())  # Conv1D: PEFT's fan_in_fan_out
        config = LoraConfig(r=self.settings.r, lora_alpha=self.settings.alpha, lora_dropout=self.settings.dropout,
                            target_modules=sorted(self.settings.target_modules), bias="none", fan_in_fan_out=transposed,
                            base_model_name_or_path=base_model_name_or_path, inference_mode=True,
                            task_type="CAUSAL_LM").to_dict()  # AutoPeftModelForCausalLM reads it
        config["target_modules"] = sorted(config["target_modules"])
        for c, name in enumerate(names):
            out = Path(directory) / name
            out.mkdir(parents=True, exist_ok=True)
            save_file(self.peft_state_dict(c), str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
            (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        return Path(directory)

    def load_peft(self, c: int, path: str | Path) -> None:
        """Load the PEFT LoRA adapter saved at ``path`` into adapter c. Its rank, alpha and target
        modules must equal these adapters', and it must be plain LoRA: a different alpha, rsLoRA,
        DoRA or per-module rank/alpha patterns would change what the weights mean."""
        path = Path(path)
        if not (path / PEFT_CONFIG).is_file() or not (path / PEFT_WEIGHTS).is_file():
            raise FileNotFoundError(f"{path} holds no PEFT adapter ({PEFT_CONFIG} and {PEFT_WEIGHTS})")
        config = json.loads((path / PEFT_CONFIG).read_text())
        unsupported = [key for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(key)]
        if config.get("peft_type", "LORA") != "LORA" or unsupported or isinstance(config.get("target_modules"), str):
            raise ValueError(f"the adapter at {path} is not a plain LoRA adapter over a list of modules (peft_type "
                             f"{config.get('peft_type')!r}, target_modules {config.get('target_modules')!r}, "
                             f"set: {unsupported}); moplex reads only plain LoRA")
        saved = (config.get("r"), float(config.get("lora_alpha", 0)), sorted(config.get("target_modules") or []))
        ours = (self.settings.r, float(self.settings.alpha), sorted(self.settings.target_modules))
        if saved != ours:
            raise ValueError(f"the adapter at {path} has r, lora_alpha, target_modules = {saved}; these adapters "
                             f"have {ours}")
        weights = load_file(str(path / PEFT_WEIGHTS))
        expected = {f"{_PEFT_PREFIX}{name}.{part}.weight" for name in self.layers for part in ("lora_A", "lora_B")}
        if set(weights) != expected:
            unknown = sorted(set(weights) ^ expected)
            raise ValueError(f"the adapter at {path} does not fit this model: {len(unknown)} weight name(s) differ, "
                             f"e.g. {unknown[:2]}")
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.lora_A[c].copy_(weights[f"{_PEFT_PREFIX}{name}.lora_A.weight"].T)
                layer.lora_B[c].copy_(weights[f"{_PEFT_PREFIX}{name}.lora_B.weight"].T)
