"""Adam over k adapters stacked in each parameter, stepping only the adapters a minibatch routed.

`moplex_core.lm.multi_lora` keeps the k adapters of a layer in two parameters, A [k, d_in, r] and
B [k, r, d_out], so that an M-step pass has one autograd leaf per layer and matrix instead of k
(with k separate parameters, gathering a mixed batch's adapters costs a stack, and its backward a
select, a detach and a gradient accumulation per adapter: host work that a GPU waits on). The
gradient of such a parameter is zero at the adapters a pass did not route, and an optimizer step
must leave those adapters exactly where they are, moments and step count included, as torch's AdamW
leaves a parameter without a gradient. `RoutedAdam.step` is told which adapters the minibatch routed
and steps those alone, each with its own step count.

The arithmetic is torch.optim.AdamW's with weight_decay = 0 (then AdamW is Adam), op for op as its
single-tensor path computes it (the CPU's default), so that k separate parameters under AdamW and
their stack here give the same bits (tests/test_routed_adam.py): per adapter c at its step t_c,

    m_c <- lerp(m_c, g_c, 1 - beta1)
    v_c <- beta2 v_c + (1 - beta2) g_c^2
    p_c <- p_c + (-lr / (1 - beta1^t_c)) * m_c / (sqrt(v_c) / sqrt(1 - beta2^t_c) + eps)

with each adapter's two scalars computed in Python floats and rounded to the parameter's dtype, as
AdamW's kernels round them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moplex_core.lm.device import to_device


class RoutedAdam:
    """Adam over ``params`` (name -> a leaf tensor whose dim 0 indexes the k adapters)."""

    def __init__(self, params: dict[str, torch.Tensor], k: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        wrong = [name for name, p in params.items() if p.dim() < 1 or p.shape[0] != k]
        if wrong:
            raise ValueError(f"every parameter must stack k = {k} adapters along dim 0; {wrong[:3]} do not")
        self.params, self.k, self.lr, self.betas, self.eps = dict(params), k, lr, betas, eps
        self.steps = [0] * k  # each adapter's step count
        self.exp_avg: dict[str, torch.Tensor] = {}  # first and second moments, made at the first step
        self.exp_avg_sq: dict[str, torch.Tensor] = {}

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
        beta1, beta2 = self.betas
        for c in adapters:
            self.steps[c] += 1
        # Per adapter, in Python floats as AdamW computes them: a routed adapter's Adam constants; an
        # unrouted one's leave it exactly as it is, whatever its gradient (m + 0 (g - m) = m,
        # v * 1 + c g (0 g) = v, p + (0 m) / denom = p), so every parameter is updated in place, whole,
        # in a few ops, without gathering the routed adapters out and back.
        routed = set(adapters)
        constants = [(1 - beta1, beta2, 1.0, -self.lr / (1 - beta1 ** self.steps[c]),
                      (1 - beta2 ** self.steps[c]) ** 0.5) if c in routed else (0.0, 1.0, 0.0, 0.0, 1.0)
                     for c in range(self.k)]
        for name, p in self.params.items():
            if name not in self.exp_avg:
                self.exp_avg[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.exp_avg_sq[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for (device, dtype, dims), names in self._groups().items():
            # [k, 1, ...]: each adapter's constants, broadcast over its entries; rounded to the parameters'
            # dtype, as AdamW's kernels round its scalars
            weight, decay, keep, step_size, root = (t.view((self.k,) + (1,) * (dims - 1)) for t in
                                                    to_device(torch.tensor(constants, dtype=dtype), device).T.unbind())
            params = [self.params[name] for name in names]
            grads = [p.grad for p in params]
            m, v = [self.exp_avg[name] for name in names], [self.exp_avg_sq[name] for name in names]
            torch._foreach_lerp_(m, grads, [weight] * len(names))
            torch._foreach_mul_(v, [decay] * len(names))
            torch._foreach_addcmul_(v, grads, torch._foreach_mul(grads, [keep] * len(names)), 1 - beta2)
            denom = torch._foreach_div(torch._foreach_sqrt(v), [root] * len(names))
            torch._foreach_add_(denom, self.eps)
            # AdamW's addcdiv_(m, denom, value=-step_size), which computes (value * m) / denom
            torch._foreach_add_(params, torch._foreach_div(torch._foreach_mul(m, [step_size] * len(names)), denom))

    def _groups(self) -> dict[tuple[torch.device, torch.dtype, int], list[str]]:
        """The parameters' names by (device, dtype, dimensions): one set of foreach ops each."""
        groups: dict[tuple[torch.device, torch.dtype, int], list[str]] = {}
        for name, p in self.params.items():
            groups.setdefault((p.device, p.dtype, p.dim()), []).append(name)
        return groups

    def state_dict(self) -> dict[str, Any]:
        """A snapshot on the CPU (copies): step counts, moments, learning rate and constants."""
        return {"steps": list(self.steps), "lr": self.lr, "betas": self.betas, "eps": self.eps,
                "exp_avg": {name: t.detach().cpu().clone() for name, t in self.exp_avg.items()},
                "exp_avg_sq": {name: t.detach().cpu().clone() for name, t in self.exp_avg_sq.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (copied onto each parameter's device and dtype: a state restored twice
        shares no tensor with an earlier restore)."""
        if not {"steps", "exp_avg", "exp_avg_sq"} <= set(state) or len(state["steps"]) != self.k:
            raise ValueError("the saved optimizer state is not RoutedAdam's over these k adapters (saved by another k "
                             "or an earlier moplex version, whose optimizer was torch's AdamW)")
        unknown = set(state["exp_avg"]) - set(self.params)
        if unknown:
            raise ValueError(f"the saved optimizer state has moments of parameters this one lacks, e.g. {min(unknown)}")
        self.steps, self.lr = list(state["steps"]), state["lr"]
        self.betas, self.eps = tuple(state["betas"]), state["eps"]
        # Keyed by this optimizer's own name strings, in its order, as its first step makes them: a state
        # saved again then pickles to the bytes an uninterrupted run's does (pickle shares equal objects).
        self.exp_avg, self.exp_avg_sq = (
            {name: state[key][name].to(p.device, p.dtype, copy=True) for name, p in self.params.items()
             if name in state[key]}
            for key in ("exp_avg", "exp_avg_sq"))
