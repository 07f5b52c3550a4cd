"""The backward of moplex's own autograd Functions (the multi-LoRA layer, the lean norm and MLP).

They compute first derivatives only (a backward keeps tensors without their graph, or accumulates in
place), so a second derivative through them would be silently wrong. torch's ``once_differentiable``
guards that, but runs every backward under a ``no_grad`` context and checks its outputs after: about
20 us of host time per call on this machine (`first_order_only`: 1 us), and a pass of Qwen3-0.6B
calls such a backward 196 times (the LoRA layers) to 336 times (in bf16, with the lean modules); a
GPU waits on that host time when a pass's kernels are small (docs/gpu-efficiency.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A Function's ``backward`` that refuses to run where autograd would record it for a second
    derivative: with ``create_graph=True`` the engine runs a backward with grad mode on (and only
    then), so this raises there, and otherwise calls ``backward`` as it is. Earlier than
    ``once_differentiable``, which let a ``create_graph=True`` backward through and failed only when
    something differentiated its result again: a gradient penalty through these layers, say, now
    fails at its first backward (moplex takes none)."""

    @functools.wraps(backward)
    def checked(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError(f"{backward.__qualname__} computes first derivatives only: a backward with "
                               "create_graph=True (a second derivative) cannot go through it")
        return backward(ctx, *grads)

    return checked
