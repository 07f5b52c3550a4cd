"""Activation checkpointing of a decoder's layers (``train.gradient_checkpointing``,
``cache.gradient_checkpointing``).

A pass that takes a gradient (the cache's and the E-step's w.r.t. the input embeddings, the M-step's
into the adapters) keeps every layer's activations until its backward: with them, not the weights,
the rows of a pass set its peak memory (benchmarks/activation_memory.py counts them per token and
layer). Checkpointed, a layer keeps only its inputs, and its backward runs its forward again first,
one layer at a time: the activations of one layer plus each layer's [B, L, d] input, for one forward
more per pass and more host time than that (torch's checkpoint runs Python for every tensor a layer
saves: benchmarks/host_ops.py).

torch's non-reentrant checkpoint keeps the forward's autograd graph and recomputes only the tensors
the layer saved for its backward, during that backward. Two things a moplex pass holds outside the
layer's arguments are no longer as the forward saw them by then, and are put back while the layer
runs again (`_AsInForward`):

- the multi-LoRA route (moplex_core.lm.multi_lora): which adapter each row takes, set by
  `MultiLoRA.route` around the forward only. An M-step backpropagates after it has closed
  (`LoRAPolicyScorer._weighted_logp`). Whether the adapters require grad decides what the LoRA layer
  keeps, too: a backward outside the `MultiLoRA.requires_grad` of its forward, under another setting,
  fails loudly (torch's checkpoint counts the tensors the layer keeps each time); moplex takes none.
- a key/value cache (a shared prompt's prefix, `moplex_core.lm.logprobs.prompt_prefix`), found by
  its type among the layer's arguments (each model names it its own way, GPT-2 passes it by
  position): the layer appended its keys and values to it, so the cache holds more keys than the
  forward attended to. The layer runs again on the keys it saw, and the cache is left as it is (the
  continuation drops its tensors once its decoder call is done, `logprobs._response_hidden`, so that
  the checkpoint, which holds the cache as an argument, does not keep every layer's keys).

What the layer reads live is read again as it is at the backward: the adapters' values (their
`MultiLoRALinear.frozen` copy in the E-step), whether they require grad, LoRA dropout's mode. moplex
backpropagates before any of them changes; a backward after an optimizer step would see the new
adapters, where a pass without checkpointing would use the saved ones (the version counters catch
what a pass saved, not what it runs again).

The RNG state (LoRA dropout's masks) is restored by torch's checkpoint. The recomputation runs the
same kernels on the same inputs, so the gradients are the same bits (tests/test_checkpointing.py):
the setting is left out of the stages' versions, as the pass sizes are.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import torch
from peft import PeftModel
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Cache, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from moplex_core.lm.logprobs import causal_lm_parts
from moplex_core.lm.multi_lora import MultiLoRALinear


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` in place (transformers' `GradientCheckpointingLayer`
    modules of its decoder, whatever its model type; not those inside another) and return how many
    are; calling it again changes nothing. Passes without gradients run the layers as before."""
    decoder = causal_lm_parts(model)[0] if isinstance(model, PreTrainedModel | PeftModel) else model
    layers: list[tuple[str, nn.Module]] = []
    for name, module in decoder.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in layers)
        if isinstance(module, GradientCheckpointingLayer) and not inside:
            layers.append((name, module))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers that transformers marks as checkpointable "
                         "(GradientCheckpointingLayer); run it with gradient_checkpointing = false")
    for _, layer in layers:
        current = layer.forward
        if not (isinstance(current, functools.partial) and current.func is _checkpointed):
            layer.forward = functools.partial(_checkpointed, layer, current)  # over its class's (or a hook's)
    return len(layers)


def _checkpointed(layer: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # no backward to run it again for
        return forward(*args, **kwargs)
    again = _AsInForward(layer, next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), again), **kwargs)


class _AsInForward:
    """A context in which ``layer`` runs again as it ran when this was made: its LoRA route, and the
    keys and values of its ``cache`` (None: none) before it appended its own. Entered at every
    recomputation (a graph kept for a second backward runs the layer again)."""

    def __init__(self, layer: nn.Module, cache: Cache | None) -> None:
        self.route = next((m.route for m in layer.modules() if isinstance(m, MultiLoRALinear)), None)
        self.routing = None if self.route is None else self.route.snapshot()
        self.cache = cache
        if cache is not None:
            self.index = next((m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)),
                              None)
            if self.index is None:
                raise ValueError(f"{type(layer).__name__} names no layer_idx, so which of the cache's layers it writes "
                                 "is unknown; run it without gradient checkpointing")
            held = cache.layers[self.index] if self.index < len(cache.layers) else None
            keys = getattr(held, "keys", None)
            self.held = None if keys is None or keys.numel() == 0 else (keys, held.values)  # [B, heads, P, head_dim]

    def __enter__(self) -> None:
        self.now = None if self.route is None else self.route.snapshot()
        if self.route is not None:
            self.route.restore(self.routing)
        if self.cache is not None:
            self.cache.update = self._update  # the instance's, over its class's, while the layer runs again

    def __exit__(self, *exc: object) -> None:
        if self.cache is not None:
            del self.cache.update
        if self.route is not None:
            self.route.restore(self.now)

    def _update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, heads, P + L, head_dim] as the forward's
        if layer_idx != self.index:
            raise RuntimeError(f"the layer checkpointed for cache layer {self.index} wrote cache layer {layer_idx}")
        if self.held is None:
            return keys, values
        return torch.cat([self.held[0], keys], dim=-2), torch.cat([self.held[1], values], dim=-2)
