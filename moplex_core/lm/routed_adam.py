"""Adam over k adapters stacked in each parameter, stepping only the adapters a minibatch routed.

`moplex_core.lm.multi_lora` keeps the k adapters of a layer in two parameters, A [k, d_in, r] and
B [k, r, d_out], so that an M-step pass has one autograd leaf per layer and matrix instead of k
(with k separate parameters, gathering a mixed batch's adapters costs a stack, and its backward a
select, a detach and a gradient accumulation per adapter: host work that a GPU waits on). The
gradient of such a parameter is zero at the adapters a pass did not route, and an optimizer step
must leave those adapters exactly where they are, moments and step count included, as torch's AdamW
leaves a parameter without a gradient. `RoutedAdam.step` is told which adapters the minibatch routed
and steps those alone, each with its own step count.

The step is torch's own: `torch.optim.adam.adam`, the function torch.optim.AdamW steps with
(weight_decay = 0, where AdamW is Adam), over the routed adapters' slices of every parameter, with
one step counter per parameter and adapter as AdamW keeps one per parameter. So k separate
parameters under AdamW and their stack here give the same bits on any device: on the CPU AdamW's
single-tensor loop, on a GPU its foreach kernels over the routed slices, same-shaped and contiguous
as separate parameters would be (tests/test_routed_adam.py checks the CPU). Unlike AdamW, a step
refuses a parameter without a gradient (AdamW would skip it): every pass moplex makes reaches every
adapted layer, so a missing gradient is a mistake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.adam import adam


class RoutedAdam:
    """Adam over ``params`` (name -> a leaf tensor whose dim 0 indexes the k adapters)."""

    def __init__(self, params: dict[str, torch.Tensor], k: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        wrong = [name for name, p in params.items() if p.dim() < 1 or p.shape[0] != k]
        if wrong:
            raise ValueError(f"every parameter must stack k = {k} adapters along dim 0; {wrong[:3]} do not")
        self.params, self.k, self.lr, self.betas, self.eps = dict(params), k, lr, betas, eps
        self.exp_avg: dict[str, torch.Tensor] = {}  # first and second moments, made at the first step
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        # AdamW's step counters, one per parameter and adapter as AdamW keeps one per parameter (its
        # step advances each in place), in the dtype AdamW makes them
        counter_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self._counters = {name: [torch.tensor(0.0, dtype=counter_dtype) for _ in range(k)] for name in self.params}

    @property
    def steps(self) -> list[int]:
        """Each adapter's step count (every parameter's counter of an adapter moves with it)."""
        counters = next(iter(self._counters.values()), None)
        return [0] * self.k if counters is None else [int(counter) for counter in counters]

    def zero_grad(self) -> None:
        """Every gradient dropped (set to None), as ``zero_grad(set_to_none=True)``."""
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, adapters: Sequence[int]) -> None:
        """One Adam step of the ``adapters`` the minibatch routed; the others are left as they are."""
        adapters = sorted(set(int(c) for c in adapters))
        if not adapters:
            return
        if adapters[0] < 0 or adapters[-1] >= self.k:
            raise ValueError(f"adapters must be in 0..{self.k - 1}, got {adapters}")
        missing = [name for name, p in self.params.items() if p.grad is None]
        if missing:
            raise RuntimeError(f"{len(missing)} parameter(s) have no gradient, e.g. {missing[0]}: step after a backward "
                               "through a pass that routed these adapters")
        # The routed adapters' slices (views) of every parameter, gradient and moment, stepped by
        # torch's own Adam: its single-tensor loop on the CPU, its foreach kernels over same-shaped
        # tensors on a GPU, as torch.optim.AdamW over k separate parameters would run them.
        params, grads, exp_avgs, exp_avg_sqs, counters = [], [], [], [], []
        for name, p in self.params.items():
            if name not in self.exp_avg:
                self.exp_avg[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.exp_avg_sq[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            for c in adapters:
                params.append(p[c])
                grads.append(p.grad[c])
                exp_avgs.append(m[c])
                exp_avg_sqs.append(v[c])
                counters.append(self._counters[name][c])
        beta1, beta2 = self.betas
        adam(params, grads, exp_avgs, exp_avg_sqs, [], counters, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False)

    def state_dict(self) -> dict[str, Any]:
        """A snapshot on the CPU (copies): step counts, moments, learning rate and constants."""
        return {"steps": self.steps, "lr": self.lr, "betas": self.betas, "eps": self.eps,
                "exp_avg": {name: t.detach().cpu().clone() for name, t in self.exp_avg.items()},
                "exp_avg_sq": {name: t.detach().cpu().clone() for name, t in self.exp_avg_sq.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (copied onto each parameter's device and dtype: a state restored twice
        shares no tensor with an earlier restore)."""
        if (not {"steps", "lr", "betas", "eps", "exp_avg", "exp_avg_sq"} <= set(state)
                or len(state["steps"]) != self.k):
            raise ValueError("the saved optimizer state is not RoutedAdam's over these k adapters (saved by another k "
                             "or an earlier moplex version, whose optimizer was torch's AdamW)")
        for key in ("exp_avg", "exp_avg_sq"):  # every parameter's moments (after a step) or none (before one)
            if set(state[key]) not in (set(), set(self.params)):
                raise ValueError(f"the saved optimizer state's {key} covers other parameters than this one's "
                                 f"({len(set(state[key]) ^ set(self.params))} names differ)")
            wrong = [name for name, t in state[key].items() if t.shape != self.params[name].shape]
            if wrong:
                raise ValueError(f"the saved optimizer state's {key} of {wrong[0]} has shape "
                                 f"{tuple(state[key][wrong[0]].shape)}, the parameter {tuple(self.params[wrong[0]].shape)}")
        self.lr = state["lr"]
        for counters in self._counters.values():
            for counter, count in zip(counters, state["steps"], strict=True):
                counter.fill_(count)
        self.betas, self.eps = tuple(state["betas"]), state["eps"]
        # Keyed by this optimizer's own name strings (the objects themselves), in its order, as its first
        # step makes them: pickle writes an object it has seen once by reference, so a state saved again
        # pickles to the bytes an uninterrupted run's does.
        self.exp_avg, self.exp_avg_sq = (
            {name: state[key][name].to(p.device, p.dtype, copy=True) for name, p in self.params.items()
             if name in state[key]}
            for key in ("exp_avg", "exp_avg_sq"))
