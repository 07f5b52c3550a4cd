"""Bytes a pass keeps for its backward, per token and decoder layer: transformers' modules against
moplex's lean RMSNorm and SwiGLU MLP (moplex_core.lm.lean); and the peak of a whole pass with and
without gradient checkpointing (moplex_core.lm.checkpointing).

    PYTHONPATH=. python3 benchmarks/activation_memory.py [--layers 4] [--rows 4] [--tokens 128]

A pass's peak memory on a GPU is its weights plus what its forward keeps for the backward; the
latter grows with the rows and tokens of a pass and sets how large a pass fits. What is kept does not
depend on the device (the kernels differ, the tensors they keep for the backward are the same ones:
SDPA's query, key, value, output and log-sum-exp on a GPU's flash kernel as on the CPU's), so it is
counted here, on the CPU, with ``torch.autograd.graph.saved_tensors_hooks``: the distinct storages a
forward hands to autograd, the model's parameters left out. The model has Qwen3-0.6B's layer shapes
(hidden 1024, MLP 3072, 16 query and 8 key-value heads of 128) and ``--layers`` decoder layers with
random weights; k = 4 LoRA adapters of rank 16 on the 7 projections; ``--rows`` rows of ``--tokens``
tokens through the decoder (the log-probs' chunks, which keep [chunk, d] inputs, are left out).

Passes: the plain model's forward with the gradient w.r.t. the input embeddings (the cache stage),
the E-step's (adapters mixed per row, gradient w.r.t. the inputs), the M-step's (adapters mixed,
backward into the adapters). Prints one markdown table, KiB per token and layer (the final norm's
share spread over the layers).

The second table runs each pass whole (forward, then backward) on the lean modules, once as it is
and once with every decoder layer checkpointed, and gives the most bytes that the pass's own tensors
held at once (`PeakBytes`: every storage an op creates, counted until it is freed; the weights and
the input embeddings are made before and left out) and its time on this CPU (median of 3, one
thread). Checkpointed, a layer keeps its input and runs its forward again in the backward.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from moplex_core.lm.checkpointing import checkpoint_layers
from moplex_core.lm.lean import make_lean
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA

K = 4


def saved_bytes(model: PreTrainedModel, embeds: torch.Tensor, input_grads: bool) -> int:
    """Bytes of the distinct storages the decoder's forward keeps for its backward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(inputs_embeds=embeds.detach().requires_grad_(input_grads),
                    attention_mask={"full_attention": None}).last_hidden_state.sum()
    return sum(storages.values())


class PeakBytes(TorchDispatchMode):
    """Inside, the bytes of every storage an op creates (not a view or an in-place result of its
    inputs) are counted from the op until the storage is freed (a finalizer on it: torch keeps a
    storage's Python object as long as the storage), and ``peak`` is the most they held at once: a
    pass's own memory, on the CPU as a GPU's allocator would count it, tensors made before it
    (weights, inputs) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if id(storage) not in self._alive and id(storage) not in given:  # new: not a view, not in place
                    self._alive.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out


def run_pass(model: PreTrainedModel, embeds: torch.Tensor, input_grads: bool) -> None:
    """One pass: the decoder's forward, then the backward of the sum of its last hidden states into the
    inputs (``input_grads``) or into whatever requires grad."""
    inputs = embeds.detach().requires_grad_(input_grads)
    out = model.model(inputs_embeds=inputs, attention_mask={"full_attention": None}).last_hidden_state.sum()
    if input_grads:
        torch.autograd.grad(out, inputs)
    else:
        out.backward()


def pass_peak(model: PreTrainedModel, embeds: torch.Tensor, input_grads: bool) -> int:
    """The peak bytes (`PeakBytes`) of one `run_pass`."""
    with PeakBytes() as counted:
        run_pass(model, embeds, input_grads)
    return counted.peak


def _model(layers: int, dtype: torch.dtype, lean: bool) -> tuple[PreTrainedModel, MultiLoRA]:
    config = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if lean:
        make_lean(model)
    return model, MultiLoRA(model, K, LoRASettings(r=16, alpha=32.0), seed=0)


@contextlib.contextmanager
def _pass(lora: MultiLoRA, kind: str, rows: int) -> Iterator[bool]:
    """Sets up pass ``kind`` and yields whether it takes the gradient w.r.t. the inputs."""
    if kind == "plain":
        yield True
        return
    with lora.route([b % K for b in range(rows)]), lora.requires_grad(kind == "M-step"):
        yield kind == "E-step"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    passes = {"plain": "plain model, fwd + grad w.r.t. inputs (cache)",
              "E-step": f"E-step: {K} adapters mixed, fwd + grad w.r.t. inputs",
              "M-step": f"M-step: {K} adapters mixed, fwd + backward into the adapters"}
    per_token_layer = 1024 * args.rows * args.tokens * args.layers
    table = []
    for dtype in (torch.bfloat16, torch.float32):
        embeds = torch.randn(args.rows, args.tokens, 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
        kept = {}
        for lean in (False, True):
            model, lora = _model(args.layers, dtype, lean)
            for kind in passes:
                with _pass(lora, kind, args.rows) as input_grads:
                    kept[kind, lean] = saved_bytes(model, embeds, input_grads) / per_token_layer
        for kind, label in passes.items():
            stock, ours = kept[kind, False], kept[kind, True]
            table.append((label, str(dtype).removeprefix("torch."), stock, ours, 1 - ours / stock))
    print(f"## Kept for the backward, KiB per token and decoder layer ({platform.machine()}, torch "
          f"{torch.__version__}; Qwen3-0.6B layer shapes, {args.layers} layers, {args.rows} rows of {args.tokens} "
          f"tokens, LoRA r = 16 on 7 projections)\n")
    print("| pass | dtype | transformers' modules | lean RMSNorm and MLP | less |\n|---|---|---|---|---|")
    for label, dtype_name, stock, ours, less in table:
        print(f"| {label} | {dtype_name} | {stock:.1f} | {ours:.1f} | {less:.0%} |")
    print("\n## Peak of one pass (forward + backward), MiB, lean modules, with and without gradient checkpointing "
          "(the same model and rows)\n")
    print("| pass | dtype | as it is MiB | checkpointed MiB | less | as it is s | checkpointed s | more time |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        embeds = torch.randn(args.rows, args.tokens, 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
        measured = {}
        for checkpointed in (False, True):
            model, lora = _model(args.layers, dtype, lean=True)
            if checkpointed:
                checkpoint_layers(model)
            for kind in passes:
                with _pass(lora, kind, args.rows) as input_grads:
                    pass_peak(model, embeds, input_grads)  # warm: the E-step's adapter stacks are made once
                    peak = pass_peak(model, embeds, input_grads)
                    seconds = []
                    for _ in range(3):  # outside PeakBytes, whose Python per op would be timed too
                        start = time.perf_counter()
                        run_pass(model, embeds, input_grads)
                        seconds.append(time.perf_counter() - start)
                measured[kind, checkpointed] = peak / 2**20, statistics.median(seconds)
        for kind, label in passes.items():
            (plain, plain_s), (ours, ours_s) = measured[kind, False], measured[kind, True]
            print(f"| {label} | {str(dtype).removeprefix('torch.')} | {plain:.1f} | {ours:.1f} | "
                  f"{1 - ours / plain:.0%} | {plain_s:.3f} | {ours_s:.3f} | {ours_s / plain_s - 1:+.0%} |")


if __name__ == "__main__":
    main()
