"""Host work of the LM path's passes: aten ops dispatched and host time per pass (issue 9).

    PYTHONPATH=. python3 benchmarks/host_ops.py [--layers 28] [--k 12] [--rows 12] [--repeats 7]

A pass whose kernels are small keeps its GPU waiting on the host, which dispatches one op after
another (the H200 profiles in docs/em_gpu_h200*.json: the mixed E-step pass of 12 rows kept the card
busy 225 of its 317 ms on 2026-11-24; on 2026-11-26 an M-step pass of two pairs through the prompt
pass 200 of its 388 ms). The host's share does not depend on the card, so it is measured here, on
the CPU, on a Qwen3 with Qwen3-0.6B's depth and LoRA layout (``--layers`` decoder layers, k LoRA
adapters of rank 16 on all 7 projections) but a width of 16 (2 heads, one key/value head) and rows
of 4 prompt + 4 response tokens, float32 (``--dtype``), one thread, where the kernels' arithmetic
costs little (the plain pass takes about 25 ms at 2 rows and 32 at 12). The ops dispatched are the host's work
(each a Python-to-C++ call and a dispatcher walk); those that compute, the views left out, are about
the kernels a GPU would launch. The host time is indicative only: this CPU runs a batched matmul
(the mixed passes' ``bmm``) as one small GEMM per row, where a GPU launches one kernel.

Rows, over ``--rows`` rows routed to adapter b mod k (benchmarks/em_gpu.py's passes, from em_gpu_rig.py):
- the plain base model's forward + input gradient (no adapters), with moplex's lean RMSNorm and MLP
  (load_model's) and with transformers' own;
- the E-step's pass, k adapters mixed, forward + input gradient;
- the M-step's pass, forward + backward into the adapters: k adapters mixed, one adapter, k
  mixed with each row's prompt run in a prompt pass first (shared prompts), and k mixed with every
  decoder layer checkpointed (train.gradient_checkpointing);
- one M-step minibatch through `LoRAPolicyScorer.fit` (the pass, the PL likelihood, the backward
  and the optimizer step): one (example, cluster) pair of a = 2 rows, and k pairs of 2 rows.

Prints one markdown table: ops dispatched (forward and backward, counted by a TorchDispatchMode),
those that compute, and the median host time of ``--repeats`` passes after two warm-ups.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import em_gpu_rig
from moplex_core.lm.checkpointing import checkpoint_layers
from moplex_core.lm.tiny import build_tiny_model
from moplex_core.scorers.lora_policy import LoRAPolicyScorer


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, and those of them that compute: not views (a view,
    ``_unsafe_view`` included, makes a tensor header and launches nothing), so about the kernels a
    GPU would launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.computing = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        self.computing += not (func.is_view or func is torch.ops.aten._unsafe_view.default)
        return func(*args, **(kwargs or {}))


def measure(run: Callable[[], Any], repeats: int) -> tuple[int, int, float]:
    """(aten ops one ``run`` dispatches, those that compute, its median host time in ms)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    with _OpCount() as count:
        run()
    return count.ops, count.computing, 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B has 28)")
    parser.add_argument("--k", type=int, default=12, help="LoRA adapters")
    parser.add_argument("--rows", type=int, default=12, help="rows per pass")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype (the card runs bf16, where the lean RMSNorm is an autograd Function)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = replace(em_gpu_rig.TINY, k=args.k, batch_rows=(args.rows,), prompt_tokens=4, response_tokens=4,
                    dtype=getattr(torch, args.dtype))
    rows: list[tuple[str, int, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", [em_gpu_rig.TOKENIZER_TEXTS], layers=args.layers,
                                     hidden_size=16, heads=2, kv_heads=1, seed=0)
        batch = em_gpu_rig.random_batches(model_dir, sizes)[args.rows]
        plain = em_gpu_rig.load_frozen_model(model_dir, sizes)
        rows.append(("plain base model, fwd + input grad", *measure(lambda: em_gpu_rig.input_grad_pass(plain, batch),
                                                                      args.repeats)))
        del plain
        stock = em_gpu_rig.load_stock_model(model_dir, sizes)
        rows.append(("plain base model, transformers' RMSNorm and MLP (not lean), fwd + input grad",
                     *measure(lambda: em_gpu_rig.input_grad_pass(stock, batch), args.repeats)))
        del stock
        model, lora = em_gpu_rig.load_lora_model(model_dir, sizes)
        params = list(lora.named_parameters().values())
        with lora.requires_grad(False):
            rows.append((f"E-step pass, {args.k} adapters mixed",
                         *measure(lambda: em_gpu_rig.mixed_pass(model, lora, batch, sizes), args.repeats)))
        m_step_passes = (
            (f"M-step pass, {args.k} adapters mixed", lambda: em_gpu_rig.mixed_pass(model, lora, batch, sizes, params)),
            ("M-step pass, one adapter", lambda: em_gpu_rig.weight_grad_pass(
                model, batch, params, route=lambda sub: lora.route([0] * len(sub)))),
            (f"M-step pass, {args.k} adapters mixed, shared prompts",
             lambda: em_gpu_rig.mixed_pass(model, lora, batch, sizes, params, shared_prompts=True)))
        for label, run in m_step_passes:
            rows.append((label, *measure(run, args.repeats)))
        checkpoint_layers(model)  # train.gradient_checkpointing: every layer runs again in the backward
        rows.append((f"M-step pass, {args.k} adapters mixed, checkpointed layers", *measure(m_step_passes[0][1],
                                                                                         args.repeats)))
        del model, lora
        vocab_size, eos_id = em_gpu_rig.model_vocab(model_dir)
        inputs = em_gpu_rig.synthetic_inputs(sizes, 4, args.k, vocab_size, eos_id)  # k examples of m' = 4
        rankings = inputs.rankings()
        scorer = LoRAPolicyScorer(model_dir, args.k, anchors=2, lora=em_gpu_rig.LORA, batch_size=args.k,
                                  score_batch_size=2 * args.k, seed=0, dtype=sizes.dtype)
        scorer.fit(inputs, rankings, torch.ones(args.k, args.k, dtype=torch.float64), 0)  # every adapter trained once
        scorer.score(inputs, 0)  # the estimates the timed M-steps hold
        one = torch.zeros(args.k, args.k, dtype=torch.float64)
        one[0, 0] = 1.0
        every = torch.zeros_like(one)
        every[torch.arange(args.k), torch.arange(args.k)] = 1.0  # k pairs, one per cluster: one minibatch
        for label, weights in (("M-step minibatch (fit): 1 pair, a = 2", one),
                               (f"M-step minibatch (fit): {args.k} pairs of {args.k} clusters, a = 2", every)):
            rows.append((label, *measure(lambda w=weights: scorer.fit(inputs, rankings, w, 1), args.repeats)))
    print(f"## Host work per pass ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"1 thread; {args.dtype} Qwen3 of {args.layers} layers, hidden 16, k = {args.k}, LoRA r = 16 on 7 "
          f"projections, {args.rows} rows of 4 + 4 tokens)\n")
    print("| pass | aten ops | of which compute | host ms |\n|---|---|---|---|")
    for label, ops, computing, ms in rows:
        print(f"| {label} | {ops:,} | {computing:,} | {ms:.1f} |")


if __name__ == "__main__":
    main()
