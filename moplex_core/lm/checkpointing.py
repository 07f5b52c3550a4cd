"""Activation checkpointing of a decoder's layers (``train.gradient_checkpointing``,
``cache.gradient_checkpointing``).

A pass that takes a gradient (the cache's and the E-step's w.r.t. the input embeddings, the M-step's
into the adapters) keeps every layer's activations until its backward: with them, not the weights,
the rows of a pass set its peak memory (benchmarks/activation_memory.py counts them per token and
layer). Checkpointed, a layer keeps only its inputs, and its backward runs its forward again first,
one layer at a time: the activations of one layer plus each layer's [B, L, d] input, for about one
forward more per pass.

torch's non-reentrant checkpoint keeps the forward's autograd graph and recomputes only the tensors
the layer saved for its backward, during that backward. Two things a moplex pass holds outside the
layer's arguments are no longer as the forward saw them by then, and are put back while the layer
runs again (`_as_in_forward`):

- the multi-LoRA route (moplex_core.lm.multi_lora): which adapter each row takes, set by
  `MultiLoRA.route` around the forward only. An M-step backpropagates after it has closed
  (`LoRAPolicyScorer._weighted_logp`). Whether the adapters require grad decides what the LoRA layer
  keeps, too: a backward outside the `MultiLoRA.requires_grad` of its forward, under another setting,
  fails loudly (torch's checkpoint counts the tensors the layer keeps each time); moplex takes none.
- a key/value cache (a shared prompt's prefix, `moplex_core.lm.logprobs.prompt_prefix`): the layer
  appended its keys and values to it, so the cache holds more keys than the forward attended to.
  The layer runs again on the keys it saw, and the cache is left as it is.

The RNG state (LoRA dropout's masks) is restored by torch's checkpoint. The recomputation runs the
same kernels on the same inputs, so the gradients are the same bits (tests/test_checkpointing.py):
the setting is left out of the stages' versions, as the pass sizes are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from moplex_core.lm.multi_lora import MultiLoRALinear

_CACHE_ARGUMENTS = ("cache", "past_key_values")  # a decoder layer's key/value cache: transformers 5.24's name, 5.17's


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` in place (transformers' `GradientCheckpointingLayer`
    modules, whatever their model type) and return how many; calling it again changes nothing. Passes
    without gradients run the layers as before."""
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers that transformers marks as checkpointable "
                         "(GradientCheckpointingLayer); run it with gradient_checkpointing = false")
    for layer in layers:
        if "forward" not in vars(layer):  # the instance's own forward shadows its class's
            layer.forward = functools.partial(_checkpointed, layer)
    return len(layers)


def _checkpointed(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(type(layer).forward, layer)
    if not torch.is_grad_enabled():  # no backward to run it again for
        return forward(*args, **kwargs)
    again = _as_in_forward(layer, kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), again), **kwargs)


def _as_in_forward(layer: nn.Module, kwargs: dict[str, Any]) -> AbstractContextManager[None]:
    """A context in which ``layer`` runs again as it ran now, taken now: its LoRA route, and the keys and
    values of its cache before it appended its own."""
    route = next((module.route for module in layer.modules() if isinstance(module, MultiLoRALinear)), None)
    cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    return _replaying(route, None if route is None else route.snapshot(), cache,
                      None if cache is None else _keys_before(cache, layer))


def _keys_before(cache: Any, layer: nn.Module) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the cache layer ``layer`` writes, the keys and values it holds now, None where it holds none)."""
    index = next((m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)
    if index is None:
        raise ValueError(f"{type(layer).__name__} names no layer_idx, so which of the cache's layers it writes is "
                         "unknown; run it without gradient checkpointing")
    held = cache.layers[index] if index < len(cache.layers) else None
    keys = getattr(held, "keys", None)
    return index, None if keys is None or keys.numel() == 0 else (keys, held.values)


@contextmanager
def _replaying(route: Any, routing: Any, cache: Any, before: tuple[int, tuple[torch.Tensor, torch.Tensor] | None] | None
               ) -> Iterator[None]:
    restore = nullcontext() if route is None else route.restored(routing)
    if cache is not None:
        index, held = before

        def update(keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, heads, P + L, head_dim] as the forward's
            if layer_idx != index:
                raise RuntimeError(f"the layer checkpointed for cache layer {index} wrote cache layer {layer_idx}")
            if held is None:
                return keys, values
            return torch.cat([held[0], keys], dim=-2), torch.cat([held[1], values], dim=-2)

        cache.update = update  # the instance's, over its class's, while the layer runs again
    try:
        with restore:
            yield
    finally:
        if cache is not None:
            del cache.update
