"""Cost of one EM iteration over k LoRA adapters, full computation vs MoPLEx anchors (issue 9).

    PYTHONPATH=. python3 benchmarks/em_gpu.py --out DIR [--examples 2] [--sections check,em,throughput,profile,ceilings]
                                              [--m-primes 26,32] [--resume EARLIER/em_gpu.json]
                                              [--pairs-per-step 16] [--score-batch-size 32]
    PYTHONPATH=. python3 benchmarks/em_gpu.py --cpu --out DIR       # a small model on the CPU
    PYTHONPATH=. python3 benchmarks/em_gpu.py --tiny --out DIR      # the CPU path the tests run
    PYTHONPATH=. python3 benchmarks/em_gpu.py --smoke --out DIR     # the tiny sizes on the GPU in bf16 (seconds)

The model is Qwen3-0.6B-shaped with seeded random weights (moplex_core.lm.tiny.build_qwen3_0_6b_shape:
28 layers, hidden 1024, 16 / 8 heads of 128, vocabulary 151,936) in bf16 with SDPA attention,
built into a temporary directory. Every row is 1024 random token ids: 512 prompt + 512 response
tokens, EOS last. A check and four measurements, in one process:

0. Agreement (``check``): log pi(y|x) of B rows routed to all k adapters in one multi-LoRA pass
   against PEFT running the same saved adapters one at a time, in bf16, and both against the
   multi-LoRA model in float32 (max |difference|, nats, next to what the adapters change), so
   the speed below is the speed of a layer that computes the right thing at this scale.
1. EM iteration cost (the paper's Figure 5). `LoRAPolicyScorer` with k = 12 adapters (r = 16,
   alpha 32, all 7 projections) on n synthetic examples of m' responses (m = min(4, m') originals
   ranked, the others generated, in the unranked bottom set), every (example, cluster) pair
   weighted 1/k: all above gamma_min, the M-step's worst case (an early iteration); and, timed
   apart, the M-step of a late iteration, whose posteriors sit on one cluster per example, so that
   it fits k times fewer pairs while the E-step still scores every cluster. Configurations: full computation
   (a = m') and a in {2, 4, 6} anchors (a < m') at m' in {4, 8, 16, 26, 32}, with shared prompts
   (each (example, cluster)'s prompt run once per pass, the scorer's default); and full and the
   largest a < m' with the prompt run for every row, as before that pass existed. Each configuration gets
   a fresh scorer and a warm-up, untimed: fit on one (example, cluster) pair at iteration 0 (the
   M-step's kernels and optimizer) and a full score(iteration 0) (the E-step's, and what it leaves
   for the next M-step). Then fit(iteration 1) (M-step) and score(iteration 1) (E-step) are timed
   separately, CUDA synchronised, and fit(iteration 2) with one-hot weights (the late M-step); peak
   GPU memory (max_memory_allocated) of each step. An
   M-step minibatch is one (example, cluster) pair by default: m' rows (full) or a rows (MoPLEx) per
   backward, the paper's memory-per-response comparison (``--pairs-per-step P``: P pairs per
   optimizer step, run in passes of at most ``score_batch_size`` rows, a pair's rows never split, as
   the pipeline's train.batch_size and train.score_batch_size do). The E-step runs
   ``score_batch_size`` rows (one response under one adapter) per forward (``--score-batch-size``;
   8 on the GPU, the pipeline's default is 32). A configuration that runs out of GPU memory is
   reported as OOM.
2. Anchor-pass throughput over B rows (B a multiple of k): the scorer's own anchor pass
   (moplex_core.estimate.anchor_pass: forward with response-only chunked log-probs + gradient w.r.t.
   inputs_embeds at the response positions) for the plain base model (a separate copy, no adapters);
   moplex_core.lm.multi_lora with the rows routed to all k adapters in turn (LoRA B small and
   random); the same with the backward into the LoRA weights instead (the M-step's pass); PEFT with
   k adapters, one active, as PEFT makes them (float32 adapters on a bf16 model) and with
   ``autocast_adapter_dtype=False`` (bf16 adapters, like ours in their matmuls); PEFT's mixed-batch
   ``adapter_names`` path over all k. Tokens/s = B * 1024 / median time of 5 passes after 2 warm-ups,
   and the ratio to the plain model; peak GPU memory over the timed passes.
3. Where the anchor pass's time goes (``profile``): the plain pass and the mixed multi-LoRA E-step
   pass over the smallest B, timed, then profiled once (torch.profiler): wall time against the
   device's busy time and the kernels launched (a pass that waits on its host is launch-bound), and
   each aten op's self time with the difference the LoRA layer makes. Wall and busy time also of the
   mixed M-step pass and of the mixed E-step pass through the prompt pass (each row its own prompt:
   what the shared-prompt path costs where it saves nothing). The traces are written to OUT.
4. The card's ceilings (``ceilings``): its bf16 matmul rate (an 8192^3 GEMM) and its
   device-to-device copy rate (a 2 GiB tensor: 4 GiB read and written), the two rates a pass's time
   is read against; each after a quarter second of warm-up (the clocks rise from idle), timed over
   20 back-to-back operations per sample.

The sections run in the order ceilings, check, throughput, profile, em (the EM section takes most
of the time), and within the EM section the issue's targets first: with shared prompts, m' = 26
(full, then a = 6, 4, 2) and full at m' = 32, then the same with the prompt per row, then the
other m' from the smallest. A run too long for one time limit can be
split: ``--deadline SECONDS`` starts nothing new after that many seconds and prints and plots what
it has; ``--m-primes`` runs the EM section at some m' only; ``--resume`` starts from an earlier
run's em_gpu.json (same size, n and device), keeping its sections and EM configurations and running
only what it lacks (em_gpu.json is rewritten after every EM configuration, so a run cut off by a
time limit is resumed where it stopped).

Prints markdown tables under one heading (date, device, versions) and writes OUT/em_gpu.json (every
number) and OUT/em_gpu.png (Figure 5's layout: time per example and peak memory vs m', one line per
method, OOM points left out).

``--cpu`` runs it on the CPU at a size where prompts cost something: a Qwen3 of 4 layers, hidden 256
(random weights, float32, torch's default threads), k = 3, rows of 256 + 256 tokens, m' in {4, 8},
a = 2, B = 6 (about 90 s on 2 cores).

``--tiny`` runs the same code on the CPU in float32 on the tests' kind of tiny Qwen3 (2 layers,
hidden 64; random weights): k = 3, rows of 12 + 16 tokens, m' in {4, 6}, a = 2, B = 6, a 256^3
matmul, one thread, no CUDA call (peak memory "-"). tests/test_em_gpu_benchmark.py runs it.
``--smoke`` runs those sizes on the GPU in bf16: every section's CUDA path (synchronisation, memory
statistics, the CUDA profiler, the PEFT bf16 row) in seconds, so a GPU session learns of a problem
before the real run builds and loads the 0.6B-shaped model.

Only moplex_core modules that import neither pydantic nor prefect are used (the GPU machine has
neither): moplex_core.scorers.lora_policy (with estimate, em and pl) and moplex_core.lm.
"""

from __future__ import annotations

import argparse
import functools
import gc
import gzip
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from transformers import AutoConfig, AutoModelForCausalLM

from moplex_core.estimate import AnchorPass, anchor_pass
from moplex_core.lm import logprobs
from moplex_core.lm.device import to_device
from moplex_core.lm.loading import dtype_name, load_model
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA
from moplex_core.lm.tiny import build_qwen3_0_6b_shape, build_tiny_model
from moplex_core.lm.tokenize import TokenizedResponse
from moplex_core.pl import encode_tiers_batch
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, PolicyInputs

TOKENIZER_TEXTS = ("Rank these answers by the criterion you were given.", "0 1 2 3 4 5 6 7 8 9")
LORA = LoRASettings(r=16, alpha=32.0)  # all 7 projections (LoRASettings' default targets)
BETA = 0.1
PAD_ID = 0  # rows of one batch have equal lengths but in the padded-rows passes (_padded_batches)

PLAIN = "plain base model, fwd + grad w.r.t. inputs_embeds"
PLAIN_PADDED = "plain base model, right-padded rows (responses half to full length), no mask (moplex)"
PLAIN_PADDED_MASKED = "plain base model, the same padded rows under a padding mask (moplex until 2026-11-24)"
PLAIN_STOCK = ("plain base model, transformers' RMSNorm and MLP (not moplex's lean ones), fwd + grad w.r.t. "
               "inputs_embeds")
MULTI_E = "multi-LoRA, k adapters mixed, fwd + grad w.r.t. inputs_embeds (E-step)"
MULTI_M = "multi-LoRA, k adapters mixed, fwd + backward into LoRA weights (M-step)"
MULTI_E_PROMPT_PASS = "multi-LoRA, k adapters mixed, E-step through the prompt pass (each row its own prompt)"
PEFT_ONE = "PEFT, 1 active adapter of k, fwd + grad w.r.t. inputs_embeds"
PEFT_ONE_MODEL_DTYPE = "PEFT, 1 active adapter of k, adapters in the model's dtype (autocast_adapter_dtype=False)"
PEFT_MIXED = "PEFT mixed adapter_names, k adapters, fwd + grad w.r.t. inputs_embeds"
PROFILE_TOP = 14  # aten ops the profile table lists by time; the rest are one row
SECTIONS = ("check", "em", "throughput", "profile", "ceilings")
TARGET_M_PRIMES = (26, 32)  # the issue's targets: a = 6 against full computation at m' = 26; full fits at 32


@dataclass(frozen=True)
class Sizes:
    """Everything the GPU run and the ``--tiny`` CPU run differ in."""

    model: Literal["qwen3-0.6b", "small", "tiny"]
    description: str
    device: str
    dtype: torch.dtype
    threads: int | None  # torch CPU threads; None keeps torch's default
    k: int  # clusters = LoRA adapters
    prompt_tokens: int
    response_tokens: int  # EOS included
    originals: int  # m, ranked responses per example (at most m')
    m_primes: tuple[int, ...]
    anchors: tuple[int, ...]  # a values of MoPLEx; each runs where a < m'
    # E-step rows (one response under one adapter) per pass. With anchors each pass keeps its
    # activations for the input-gradient backward, so this, not the a-row M-step, can set MoPLEx's
    # peak memory: 8 rows of 1024 tokens is about 16 GiB on the plain model (DESIGN.md 8).
    score_batch_size: int
    pairs_per_step: int  # (example, cluster) pairs per M-step minibatch (optimizer step)
    batch_rows: tuple[int, ...]  # B of the throughput section: multiples of k, so a batch mixes all k adapters
    warmups: int
    repeats: int
    matmul_n: int

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


GPU = Sizes(model="qwen3-0.6b", description="Qwen3-0.6B shape, random weights, bf16", device="cuda",
            dtype=torch.bfloat16, threads=None, k=12, prompt_tokens=512, response_tokens=512, originals=4,
            m_primes=(4, 8, 16, 26, 32), anchors=(2, 4, 6), score_batch_size=8, pairs_per_step=1, batch_rows=(12, 36),
            warmups=2, repeats=5, matmul_n=8192)
CPU = Sizes(model="small", description="small Qwen3 (4 layers, hidden 256), random weights, float32", device="cpu",
            dtype=torch.float32, threads=None, k=3, prompt_tokens=256, response_tokens=256, originals=4,
            m_primes=(4, 8), anchors=(2,), score_batch_size=8, pairs_per_step=1, batch_rows=(6,), warmups=1, repeats=3,
            matmul_n=1024)
TINY = Sizes(model="tiny", description="tiny Qwen3 (2 layers, hidden 64), random weights, float32", device="cpu",
             dtype=torch.float32, threads=1, k=3, prompt_tokens=12, response_tokens=16, originals=4,
             m_primes=(4, 6), anchors=(2,), score_batch_size=16, pairs_per_step=1, batch_rows=(6,), warmups=1, repeats=3,
             matmul_n=256)
SMOKE = replace(TINY, description="tiny Qwen3 (2 layers, hidden 64), random weights, bf16 (smoke test)", device="cuda",
                dtype=torch.bfloat16, threads=None)


# -- device helpers --------------------------------------------------------------------------


def _sync(sizes: Sizes) -> None:
    if sizes.cuda:
        torch.cuda.synchronize()


def _reset_peak(sizes: Sizes) -> None:
    if sizes.cuda:
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(sizes: Sizes) -> float | None:
    """Peak GPU memory the tensors held since the last reset, GiB; None on the CPU (not measured)."""
    return torch.cuda.max_memory_allocated() / 2**30 if sizes.cuda else None


def _peak_reserved_gib(sizes: Sizes) -> float | None:
    """Peak GPU memory the caching allocator held since the last reset (tensors, fragmentation and
    cached blocks), GiB: what must fit on the card; None on the CPU."""
    return torch.cuda.max_memory_reserved() / 2**30 if sizes.cuda else None


def _out_of_memory(error: RuntimeError) -> bool:
    """A CUDA allocation failure: torch's own, or one inside cuBLAS or another library (a plain
    RuntimeError that says so)."""
    message = str(error)
    return (isinstance(error, torch.cuda.OutOfMemoryError) or "CUBLAS_STATUS_ALLOC_FAILED" in message
            or "out of memory" in message.lower())


def _free(sizes: Sizes) -> None:
    gc.collect()
    if sizes.cuda:
        torch.cuda.empty_cache()


# -- model and data --------------------------------------------------------------------------


def build_model(sizes: Sizes, directory: Path) -> Path:
    if sizes.model == "qwen3-0.6b":
        return build_qwen3_0_6b_shape(directory, TOKENIZER_TEXTS, sizes.dtype)
    if sizes.model == "small":
        return build_tiny_model(directory, [TOKENIZER_TEXTS], hidden_size=256, layers=4, heads=4, kv_heads=2,
                                pretrain_steps=0, seed=0)
    return build_tiny_model(directory, [TOKENIZER_TEXTS], pretrain_steps=0, seed=0)


def random_responses(generator: torch.Generator, count: int, sizes: Sizes, vocab_size: int, eos_id: int
                     ) -> tuple[TokenizedResponse, ...]:
    """``count`` responses to one prompt: random ids (uniform over the vocabulary), EOS last."""
    prompt = torch.randint(vocab_size, (sizes.prompt_tokens,), generator=generator).tolist()
    rows = []
    for _ in range(count):
        response = torch.randint(vocab_size, (sizes.response_tokens - 1,), generator=generator).tolist()
        rows.append(TokenizedResponse(prompt + response + [eos_id], response_start=len(prompt)))
    return tuple(rows)


def synthetic_inputs(sizes: Sizes, m_prime: int, examples: int, vocab_size: int, eos_id: int) -> PolicyInputs:
    """``examples`` examples of m' responses: the first m = min(originals, m') ranked best first in
    singleton tiers, the other m' - m generated (UNRANKED, the bottom set). The reference terms are
    zeros: they cost nothing to read and do not change the scorer's work."""
    generator = torch.Generator().manual_seed(m_prime)
    m = min(sizes.originals, m_prime)
    sequences = tuple(random_responses(generator, m_prime, sizes, vocab_size, eos_id) for _ in range(examples))
    tiers = encode_tiers_batch([[[j] for j in range(m)]] * examples, [m_prime] * examples)  # int64 [n, m']
    return PolicyInputs(
        example_ids=tuple(f"example-{i}" for i in range(examples)),
        sequences=sequences,
        ref_logp=torch.zeros(examples, m_prime, dtype=torch.float64),  # [n, m']
        ref_contraction=torch.zeros(examples, m_prime, m_prime, dtype=torch.float32),  # [n, m', m']
        tiers=tiers,
    )


def _model_vocab(model_dir: Path) -> tuple[int, int]:
    config = AutoConfig.from_pretrained(model_dir)
    return config.vocab_size, config.eos_token_id


# -- 1. EM iteration cost --------------------------------------------------------------------


def em_iteration_costs(model_dir: Callable[[], Path], sizes: Sizes, examples: int, m_primes: tuple[int, ...],
                       measured: list[dict[str, Any]], save: Callable[[list[dict[str, Any]]], None],
                       time_left: Callable[[], bool] = lambda: True) -> list[dict[str, Any]]:
    """One row per (m', method, prompts): methods "full" (anchors None) and "a=<a>" for each a < m',
    with shared prompts (the default); and "full" and the largest a < m' with the prompt run for every
    row, the cost before the shared-prompt pass. Speedups are against full with the same prompts.

    The order is `_run_order`'s: the issue's targets first. Rows already in ``measured`` (an earlier
    run's) are kept, not run again; ``save`` gets every row so far after each configuration, so a run
    stopped by a time limit keeps what it measured; no configuration starts once ``time_left()``
    says no."""
    rows = {(row["m_prime"], row["method"], row["prompts"]): row for row in measured}
    inputs: dict[int, PolicyInputs] = {}
    for m_prime, anchors, share in _run_order(sizes, m_primes):
        row = {"m_prime": m_prime, "method": "full" if anchors is None else f"a={anchors}",
               "anchors": m_prime if anchors is None else anchors, "prompts": "shared" if share else "per row"}
        if (m_prime, row["method"], row["prompts"]) in rows:
            continue
        if not time_left():
            break
        if m_prime not in inputs:
            vocab_size, eos_id = _model_vocab(model_dir())
            inputs[m_prime] = synthetic_inputs(sizes, m_prime, examples, vocab_size, eos_id)
        row.update(_em_iteration(model_dir(), sizes, inputs[m_prime], anchors, share))
        rows[m_prime, row["method"], row["prompts"]] = row
        print(f"em m'={m_prime} {row['method']} ({row['prompts']}): {row['total_s_per_example']} s/example, "
              f"peak {row['peak_gib']} GiB", file=sys.stderr, flush=True)
        save(_em_table(sizes, rows))
    return _em_table(sizes, rows)


def _run_order(sizes: Sizes, m_primes: tuple[int, ...]) -> list[tuple[int, int | None, bool]]:
    """(m', anchors, shared prompts) in the order they run: the shared-prompt configurations at the
    issue's target m' (TARGET_M_PRIMES, in order; at each full computation, then the largest a
    first), then their per-row counterparts, then the other m' from the smallest, each as in the
    table."""
    targets = [m for m in TARGET_M_PRIMES if m in m_primes]

    def at(m_prime: int) -> list[tuple[int, int | None, bool]]:
        by_size = sorted(_em_configurations(sizes, m_prime), key=lambda c: (c[0] is not None, -(c[0] or 0)))
        return [(m_prime, anchors, share) for anchors, share in by_size]

    first = [c for m in targets for c in at(m) if c[2]] + [c for m in targets for c in at(m) if not c[2]]
    return first + [(m, a, share) for m in m_primes if m not in targets for a, share in _em_configurations(sizes, m)]


def _em_configurations(sizes: Sizes, m_prime: int) -> list[tuple[int | None, bool]]:
    """(anchors, shared prompts) at m', in the table's order: full, then each a < m', shared; then
    full and the largest a < m' with the prompt per row."""
    anchor_counts = [a for a in sizes.anchors if a < m_prime]
    return [(None, True), *((a, True) for a in anchor_counts), (None, False), *((a, False) for a in anchor_counts[-1:])]


def _em_table(sizes: Sizes, rows: dict[tuple[int, str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows in the table's order, with speedup and memory ratio against full computation with
    the same prompts (None where either is missing or ran out of memory)."""
    order = [(m, "full" if a is None else f"a={a}", "shared" if share else "per row")
             for m in sizes.m_primes for a, share in _em_configurations(sizes, m)]
    table = [rows[key] for key in order if key in rows]
    for row in table:
        full = rows.get((row["m_prime"], "full", row["prompts"]))
        both = full is not None and not (row["oom"] or full["oom"])
        row["speedup_vs_full"] = full["total_s_per_example"] / row["total_s_per_example"] if both else None
        row["late_speedup_vs_full"] = (full["late_total_s_per_example"] / row["late_total_s_per_example"]
                                       if both and row.get("late_total_s_per_example") else None)
        row["memory_ratio_full_over_this"] = (full["peak_gib"] / row["peak_gib"]
                                              if both and row["peak_gib"] is not None else None)
    return table


def _em_iteration(model_dir: Path, sizes: Sizes, inputs: PolicyInputs, anchors: int | None, share_prompts: bool
                  ) -> dict[str, Any]:
    n = len(inputs)
    rankings = inputs.rankings()
    weights = torch.full((n, sizes.k), 1.0 / sizes.k, dtype=torch.float64)  # [n, k]: every pair fitted
    late = torch.zeros_like(weights)  # [n, k]: a late iteration's posteriors, one cluster per example
    late[torch.arange(n), torch.arange(n) % sizes.k] = 1.0
    one_pair = torch.zeros_like(weights)  # [n, k]: the warm-up M-step's pairs, one per cluster, so that
    one_pair[0, :] = weights[0, :]  # every adapter has its optimizer state and a non-zero B before the timed steps
    scorer = None
    try:
        scorer = LoRAPolicyScorer(model_dir, sizes.k, beta=BETA, anchors=anchors, lora=LORA, lr=1e-4,
                                  batch_size=sizes.pairs_per_step, score_batch_size=sizes.score_batch_size,
                                  share_prompts=share_prompts, seed=0,
                                  dtype=sizes.dtype, device=sizes.device)
        scorer.fit(inputs, rankings, one_pair, 0)
        scorer.score(inputs, 0)
        _sync(sizes)
        _reset_peak(sizes)
        start = time.perf_counter()
        scorer.fit(inputs, rankings, weights, 1)
        _sync(sizes)
        fitted = time.perf_counter()
        m_step_steps = scorer.last_fit["steps"]
        m_step_peak, m_step_reserved = _peak_gib(sizes), _peak_reserved_gib(sizes)
        _reset_peak(sizes)
        scorer.score(inputs, 1)
        _sync(sizes)
        scored = time.perf_counter()
        e_step_peak, e_step_reserved = _peak_gib(sizes), _peak_reserved_gib(sizes)
        scorer.fit(inputs, rankings, late, 2)  # peak memory not read: fewer pairs, the same passes
        _sync(sizes)
        late_fitted = time.perf_counter()
        return {"oom": False, "e_step_s_per_example": (scored - fitted) / n,
                "m_step_s_per_example": (fitted - start) / n, "total_s_per_example": (scored - start) / n,
                "m_step_optimizer_steps": m_step_steps,
                "late_m_step_s_per_example": (late_fitted - scored) / n,
                "late_total_s_per_example": (scored - fitted + late_fitted - scored) / n,
                "m_step_peak_gib": m_step_peak, "e_step_peak_gib": e_step_peak,
                "peak_gib": None if m_step_peak is None else max(m_step_peak, e_step_peak),
                "peak_reserved_gib": None if m_step_reserved is None else max(m_step_reserved, e_step_reserved)}
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError, or cuBLAS failing to allocate
        if not _out_of_memory(error):
            raise
        return {"oom": True, "e_step_s_per_example": None, "m_step_s_per_example": None,
                "m_step_optimizer_steps": None,
                "total_s_per_example": None, "late_m_step_s_per_example": None, "late_total_s_per_example": None,
                "m_step_peak_gib": None, "e_step_peak_gib": None, "peak_gib": None,
                "peak_reserved_gib": None}
    finally:
        del scorer
        _free(sizes)


# -- 2. anchor-pass throughput ---------------------------------------------------------------


def anchor_pass_throughput(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    """A row per pass (PLAIN, PLAIN_PADDED, PLAIN_PADDED_MASKED, PLAIN_STOCK, MULTI_E, MULTI_M, PEFT_ONE,
    PEFT_MIXED, and PEFT_ONE_MODEL_DTYPE in bf16) and B, one model on the device at a time, and the attention
    implementation the model loaded with."""
    batches = _batches(model_dir, sizes)
    attention, rows = _plain_rows(model_dir, sizes, batches)
    _free(sizes)
    rows += _multi_lora_rows(model_dir, sizes, batches)
    _free(sizes)
    rows += _peft_rows(model_dir, sizes, batches)
    _free(sizes)
    for row in rows:
        plain = next(r for r in rows if r["pass"] == PLAIN and r["batch"] == row["batch"])
        both = not (row["oom"] or plain["oom"])
        row["ratio_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"] if both else None
    return {"attention": attention, "rows": rows}


def _batches(model_dir: Path, sizes: Sizes) -> dict[int, list[TokenizedResponse]]:
    """B random rows (prompt + response, equal lengths) per B of ``sizes.batch_rows``, seeded."""
    vocab_size, eos_id = _model_vocab(model_dir)
    generator = torch.Generator().manual_seed(0)
    return {b: [row for _ in range(b) for row in random_responses(generator, 1, sizes, vocab_size, eos_id)]
            for b in sizes.batch_rows}


def _input_grad_pass(model: nn.Module, rows: list[TokenizedResponse], **route: Any) -> AnchorPass:
    """The E-step's anchor pass, as the scorer runs it but for the target terms' gather (m' logits a
    position from the logits the log-probs compute anyway; the EM section's scorer runs it): log
    pi(y|x) of every row and d/d inputs_embeds at the response positions. ``route``: anchor_pass's
    ``groups`` and ``route``."""
    return anchor_pass(model, rows, PAD_ID, input_grads=True, **route)


def _weight_grad_pass(model: nn.Module, rows: list[TokenizedResponse], params: list[nn.Parameter], **route: Any
                      ) -> None:
    """The M-step's pass: log pi(y|x) of every row, backward into ``params`` (then dropped)."""
    anchor_pass(model, rows, PAD_ID, input_grads=False, keep_graph=True, **route).logp.sum().backward()
    for p in params:
        p.grad = None


def _median_seconds(run: Callable[[], Any], sizes: Sizes) -> float:
    """Median wall time of ``repeats`` runs after ``warmups``, the device synchronised around each."""
    for _ in range(sizes.warmups):
        run()
    _sync(sizes)
    _reset_peak(sizes)
    times = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        run()
        _sync(sizes)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sustained_seconds(run: Callable[[], Any], sizes: Sizes, warmup_s: float = 0.25, per_sample: int = 20) -> float:
    """Seconds per ``run`` at a sustained rate: ``run`` repeated for ``warmup_s`` (an idle card's clocks
    rise, the library picks its kernels), then the median over ``repeats`` samples of ``per_sample``
    back-to-back runs (one synchronisation per sample, not per run: a millisecond kernel is not
    timed against the host's overhead)."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        run()
        _sync(sizes)
    samples = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        for _ in range(per_sample):
            run()
        _sync(sizes)
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


def _measure(label: str, run: Callable[[list[TokenizedResponse]], Any], batches: dict[int, list[TokenizedResponse]],
             sizes: Sizes
             ) -> list[dict[str, Any]]:
    rows = []
    for b, batch in batches.items():
        try:
            seconds = _median_seconds(lambda: run(batch), sizes)
            rows.append({"pass": label, "batch": b, "oom": False, "ms": 1000 * seconds,
                         "tokens_per_s": b * sizes.row_tokens / seconds, "peak_gib": _peak_gib(sizes)})
        except RuntimeError as error:
            if not _out_of_memory(error):
                raise
            rows.append({"pass": label, "batch": b, "oom": True, "ms": None, "tokens_per_s": None, "peak_gib": None})
        _free(sizes)
    return rows


def _frozen_model(model_dir: Path, sizes: Sizes) -> nn.Module:
    model = load_model(model_dir, dtype=sizes.dtype, device=sizes.device)
    model.requires_grad_(False)  # only inputs_embeds or LoRA weights get gradients
    return model


def _perturb_lora_b(params: dict[str, nn.Parameter], std: float = 1e-3) -> None:
    """Random LoRA B (it starts at 0) of every ``.lora_B`` parameter, so the adapters are not all the
    base model."""
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith(".lora_B"):
                p.normal_(0.0, std)


def _plain_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> tuple[str, list[dict[str, Any]]]:
    """(the attention implementation the model loaded with, its rows): PLAIN; PLAIN_PADDED against
    PLAIN_PADDED_MASKED, where the pipeline's padded passes differ (tokens/s counts the padded width);
    PLAIN_STOCK, what the lean RMSNorm and MLP cost or gain in time."""
    model = _frozen_model(model_dir, sizes)
    rows = _measure(PLAIN, lambda batch: _input_grad_pass(model, batch), batches, sizes)
    padded = _padded_batches(batches, sizes)
    rows += _measure(PLAIN_PADDED, lambda batch: _input_grad_pass(model, batch), padded, sizes)
    with _padding_mask():
        rows += _measure(PLAIN_PADDED_MASKED, lambda batch: _input_grad_pass(model, batch), padded, sizes)
    del model
    _free(sizes)
    stock = _stock_model(model_dir, sizes)
    rows += _measure(PLAIN_STOCK, lambda batch: _input_grad_pass(stock, batch), batches, sizes)
    return stock.config._attn_implementation, rows


def _stock_model(model_dir: Path, sizes: Sizes) -> nn.Module:
    """The frozen model with transformers' own modules (load_model swaps in moplex's lean ones)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=sizes.dtype).to(sizes.device).eval()
    return model.requires_grad_(False)


def _padded_batches(batches: dict[int, list[TokenizedResponse]], sizes: Sizes) -> dict[int, list[TokenizedResponse]]:
    """The rows of ``batches`` with their responses cut to a random length between half and all of
    theirs (EOS kept), seeded; the first row keeps its length, so a batch keeps its width."""
    generator = torch.Generator().manual_seed(1)
    padded = {}
    for b, batch in batches.items():
        keep = torch.randint(max(1, sizes.response_tokens // 2), sizes.response_tokens + 1, (b,),
                             generator=generator).tolist()
        keep[0] = sizes.response_tokens
        padded[b] = [TokenizedResponse(row.input_ids[: row.response_start + n - 1] + row.input_ids[-1:],
                                       row.response_start) for row, n in zip(batch, keep, strict=True)]
    return padded


@contextmanager
def _padding_mask() -> Iterator[None]:
    """Whole-row passes inside take the padding mask moplex gave them until it ran padded rows
    unmasked (2026-11-24, after the H200 run): for a padded batch, the 2D mask copied to the device
    and the [B, 1, L, L] causal-and-padding boolean mask transformers would build made there from it
    (no read of the device); none without padding. It stands in for `logprobs._whole_rows_mask`
    meanwhile."""

    def padding_mask(model: nn.Module, mask: torch.Tensor, on_device: torch.device | torch.Tensor) -> Any:
        if bool(mask.all()):
            return {"full_attention": None}
        on_device = to_device(mask, on_device) if isinstance(on_device, torch.device) else on_device  # [B, L]
        causal = torch.ones(mask.shape[1], mask.shape[1], dtype=torch.bool, device=on_device.device).tril()  # [L, L]
        return causal[None, None] & on_device.bool()[:, None, None, :]  # [B, 1, L, L]

    saved = logprobs._whole_rows_mask
    logprobs._whole_rows_mask = padding_mask
    try:
        yield
    finally:
        logprobs._whole_rows_mask = saved


def _lora_model(model_dir: Path, sizes: Sizes) -> tuple[nn.Module, MultiLoRA]:
    """The frozen model with k adapters of small random LoRA B."""
    model = _frozen_model(model_dir, sizes)
    lora = MultiLoRA(model, sizes.k, LORA, seed=0)
    _perturb_lora_b(lora.named_parameters())
    return model, lora


def _mixed_pass(model: nn.Module, lora: MultiLoRA, batch: list[TokenizedResponse], sizes: Sizes,
                params: list[nn.Parameter] | None = None, shared_prompts: bool = False) -> None:
    """The anchor pass with row b routed to adapter b mod k: backward into ``params`` (the LoRA
    weights: the M-step's pass), or w.r.t. the inputs when None (the E-step's). ``shared_prompts``:
    through the prompt pass, each row its own prompt (the batches' rows have prompts of their own)."""
    adapters = (torch.arange(len(batch)) % sizes.k).tolist()  # [B]
    route = {"route": lambda rows: lora.route([adapters[r] for r in rows]),
             "groups": list(range(len(batch))) if shared_prompts else None}
    if params is None:
        _input_grad_pass(model, batch, **route)
    else:
        _weight_grad_pass(model, batch, params, **route)


def _multi_lora_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> list[dict[str, Any]]:
    model, lora = _lora_model(model_dir, sizes)
    params = list(lora.named_parameters().values())
    with lora.requires_grad(False):
        rows = _measure(MULTI_E, lambda batch: _mixed_pass(model, lora, batch, sizes), batches, sizes)
    return rows + _measure(MULTI_M, lambda batch: _mixed_pass(model, lora, batch, sizes, params), batches, sizes)


def _peft_model(model_dir: Path, sizes: Sizes, autocast_adapter_dtype: bool = True) -> tuple[nn.Module, list[str]]:
    """The frozen model under PEFT with k adapters of small random LoRA B, adapter c0 active, in eval
    mode; (the model, the adapter names). PEFT's default (``autocast_adapter_dtype``) keeps the
    adapters of a bf16 model in float32 and runs their matmuls in float32."""
    config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
                        target_modules=list(LORA.target_modules), bias="none")
    names = [f"c{c}" for c in range(sizes.k)]
    model = get_peft_model(_frozen_model(model_dir, sizes), config, adapter_name=names[0],
                           autocast_adapter_dtype=autocast_adapter_dtype)
    for name in names[1:]:
        model.add_adapter(name, config, autocast_adapter_dtype=autocast_adapter_dtype)
    model.set_adapter(names[0])
    model.eval()  # PEFT refuses adapter_names in training mode
    lora = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    _perturb_lora_b(lora)
    for p in lora.values():  # after set_adapter, which switches requires_grad on for its adapter
        p.requires_grad_(False)
    return model, names


def _peft_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> list[dict[str, Any]]:
    model, names = _peft_model(model_dir, sizes)

    def mixed(batch: list[TokenizedResponse]) -> None:
        # PeftModel.forward applies `adapter_names` through pre-forward hooks that this private
        # context manager (peft 0.21) registers on every LoRA layer; anchor_pass calls the decoder
        # and lm_head directly, not PeftModel.forward, so it enters the context itself.
        adapter_names = [names[b % sizes.k] for b in range(len(batch))]  # row b -> adapter b mod k
        with model._enable_peft_forward_hooks(adapter_names=adapter_names):
            _input_grad_pass(model, batch)

    rows = _measure(PEFT_ONE, lambda batch: _input_grad_pass(model, batch), batches, sizes)
    rows += _measure(PEFT_MIXED, mixed, batches, sizes)
    del model
    _free(sizes)
    if sizes.dtype in (torch.float32, torch.float64):  # the default already keeps the model's dtype
        return rows
    model, _ = _peft_model(model_dir, sizes, autocast_adapter_dtype=False)
    return rows + _measure(PEFT_ONE_MODEL_DTYPE, lambda batch: _input_grad_pass(model, batch), batches, sizes)


# -- 2b. where an anchor pass's time goes -----------------------------------------------------


def anchor_pass_profile(model_dir: Path, sizes: Sizes, out: Path) -> dict[str, Any]:
    """The plain pass, the mixed multi-LoRA E-step pass, the same through the prompt pass
    (``multi_lora_prompt_pass``) and the mixed M-step pass (``multi_lora_m``) over B =
    min(batch_rows) rows, each timed as in section 2 and then run once under torch.profiler: per aten
    op, its self time on the device (the kernels it launched; on the CPU, its CPU time) and its
    calls; the kernels launched and the device's busy time. Wall time well above busy time is time the
    card waits on the host (kernel launches, Python); busy time is the kernels themselves. Writes each
    pass's trace to OUT/profile_<name>.json.gz (chrome://tracing, Perfetto)."""
    b = min(sizes.batch_rows)
    batch = _batches(model_dir, sizes)[b]
    model = _frozen_model(model_dir, sizes)
    plain = _profile(lambda: _input_grad_pass(model, batch), sizes, out / "profile_plain.json.gz")
    del model
    _free(sizes)
    model, lora = _lora_model(model_dir, sizes)
    with lora.requires_grad(False):
        multi = _profile(lambda: _mixed_pass(model, lora, batch, sizes), sizes,
                         out / "profile_multi_lora.json.gz")
        prompt_pass = _profile(lambda: _mixed_pass(model, lora, batch, sizes, shared_prompts=True), sizes,
                               out / "profile_multi_lora_prompt_pass.json.gz")
    params = list(lora.named_parameters().values())
    m_step = _profile(lambda: _mixed_pass(model, lora, batch, sizes, params), sizes, out / "profile_multi_lora_m.json.gz")
    extra_gb = _lora_extra_bytes(lora, b * sizes.row_tokens, sizes.dtype.itemsize) / 1e9
    del model, lora
    _free(sizes)
    return {"batch": b, "plain": plain, "multi_lora": multi, "multi_lora_prompt_pass": prompt_pass,
            "multi_lora_m": m_step, "lora_extra_gb": extra_gb}


def _lora_extra_bytes(lora: MultiLoRA, tokens: int, element_size: int) -> int:
    """The bytes the LoRA path adds to a forward + input-gradient pass over ``tokens`` tokens, by
    count (every tensor read or written once per kernel). Per projection, d_in -> d_out at rank r:
    the forward's bmm reads x [T, d_in] and writes xa [T, r], its baddbmm reads the base output and
    xa and writes the output; the backward reads grad_out to write grad_xa [T, r], and its baddbmm
    reads the base part of grad_x and grad_xa and writes grad_x: T (3 d_in + 3 d_out + 4 r)
    elements. The adapters' own bytes (B r (d_in + d_out) per projection) are left out, small
    against T."""
    r = lora.settings.r
    per_token = sum(3 * layer.lora_A.shape[1] + 3 * layer.lora_B.shape[2] + 4 * r for layer in lora.layers.values())
    return tokens * per_token * element_size


def _profile(run: Callable[[], Any], sizes: Sizes, trace: Path) -> dict[str, Any]:
    seconds = _median_seconds(run, sizes)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if sizes.cuda else [])]
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        _sync(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        trace.write_bytes(gzip.compress(raw.read_bytes(), mtime=0))
    events = profiler.key_averages()
    if sizes.cuda:
        ops = {e.key: (e.self_device_time_total, e.count) for e in events
               if e.key.startswith("aten::") and e.self_device_time_total > 0}
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy_us, launched = sum(e.self_device_time_total for e in kernels), sum(e.count for e in kernels)
        if not launched:
            print(f"profile of {trace.name}: the profiler recorded no CUDA kernel (CUPTI missing?), so its busy time "
                  "and kernel count read 0 and say nothing", file=sys.stderr, flush=True)
    else:
        ops = {e.key: (e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")}
        busy_us, launched = sum(us for us, _ in ops.values()), None
    ranked = sorted(ops.items(), key=lambda item: (-item[1][0], item[0]))
    return {"wall_ms": 1000 * seconds, "busy_ms": busy_us / 1000, "kernels": launched,
            "ops": {key: {"ms": us / 1000, "calls": calls} for key, (us, calls) in ranked}}


# -- 0. agreement with PEFT at this scale ---------------------------------------------------


def lora_agreement(model_dir: Path, sizes: Sizes, batch: list[TokenizedResponse]) -> dict[str, Any]:
    """log pi(y|x) of B rows routed to all k adapters in one pass, against PEFT running the same
    adapters one at a time (PeftModel.from_pretrained of what MultiLoRA.save_peft wrote), both in the
    run's dtype, and both against MultiLoRA in a wider dtype (float32 for a bf16 run, float64 for a
    float32 one). Max |difference| in nats; "adapter effect" is max |log pi_c - log pi_ref| in the
    wide dtype, so a difference can be read against what the adapters change.

    Also the base model's own gaps, which every delta = log pi_c - log pi_ref starts from when the
    cache's log pi_ref was computed otherwise (the train stage's `reference_gap`): the same rows in
    one pass against one row at a time ("batch shape", run dtype), and the run dtype against the
    wide one (a cache of the other dtype); and the base model's log-probs of the same rows with their
    responses cut to different lengths, run without a mask (as moplex runs padded rows) against
    the padding mask it built until 2026-11-24 (run dtype, another attention kernel), and their input
    gradients' largest gap relative to the largest gradient; the same for the rows through the
    shared-prompt pass (`groups`: the prompt pass, then the continuation) against the rows whole;
    and the E-step's log-probs and input gradients of the base model with moplex's lean RMSNorm and
    MLP (load_model's) against transformers' own modules, next to the same pass with transformers'
    modules run twice (on a GPU attention's backward adds with atomics, so two runs need not agree
    to the bit; 0 and 0 where everything does); and the base model's target terms (the batch's rows
    as each other's alternatives) in this dtype against the wide one, and through the shared-prompt
    pass against the rows whole."""
    from peft import PeftModel

    wide = torch.float64 if sizes.dtype == torch.float32 else torch.float32
    route = torch.arange(len(batch)) % sizes.k  # [B]: row b -> adapter b mod k
    names = [f"c{c}" for c in range(sizes.k)]

    def logp(model: nn.Module, rows: list[TokenizedResponse] = batch) -> torch.Tensor:
        return anchor_pass(model, rows, PAD_ID, input_grads=False).logp.cpu()  # float64 [B]

    def target_terms(model: nn.Module, **shared: Any) -> torch.Tensor:
        """The base model's target terms of every row with the batch's rows as alternatives: [B, B]."""
        return anchor_pass(model, batch, PAD_ID, input_grads=False, alternatives=[batch] * len(batch),
                           **shared).target_terms.cpu()

    with tempfile.TemporaryDirectory() as tmp:
        model = _frozen_model(model_dir, sizes)
        lora = MultiLoRA(model, sizes.k, LORA, seed=0)
        _perturb_lora_b(lora.named_parameters(), std=0.02)
        lora.save_peft(tmp, names, str(model_dir))
        with lora.route(route):
            ours = logp(model)
        base_batched = logp(model)  # outside a route: the base model
        base_alone = torch.cat([logp(model, [row]) for row in batch])
        padded = _padded_batches({len(batch): batch}, sizes)[len(batch)]
        unmasked = anchor_pass(model, padded, PAD_ID, input_grads=True)
        with _padding_mask():
            masked = anchor_pass(model, padded, PAD_ID, input_grads=True)
        padding_gaps = {"padding_mask": float((unmasked.logp - masked.logp).abs().max()),
                        "padding_mask_input_grads": float((unmasked.input_grads - masked.input_grads).abs().max()
                                                          / masked.input_grads.abs().max())}
        lean = anchor_pass(model, batch, PAD_ID, input_grads=True)
        shared = anchor_pass(model, batch, PAD_ID, input_grads=True, groups=list(range(len(batch))))
        padding_gaps.update(shared_prompts=float((shared.logp - lean.logp).abs().max()),
                            shared_prompts_input_grads=float((shared.input_grads - lean.input_grads).abs().max()
                                                             / lean.input_grads.abs().max()))
        targets = target_terms(model)
        padding_gaps["shared_prompts_target_terms"] = float(
            (target_terms(model, groups=list(range(len(batch)))) - targets).abs().max())
        del model, lora, unmasked, masked, shared
        _free(sizes)
        stock_model = _stock_model(model_dir, sizes)
        stock, again = (anchor_pass(stock_model, batch, PAD_ID, input_grads=True) for _ in range(2))
        gaps = {name: max(float((one.logp - other.logp).abs().max()),
                          float((one.input_grads - other.input_grads).abs().max()))
                for name, one, other in (("lean_vs_stock", lean, stock), ("stock_vs_stock", stock, again))}
        del lean, stock, again, stock_model
        _free(sizes)
        peft_model = PeftModel.from_pretrained(_frozen_model(model_dir, sizes), str(Path(tmp) / names[0]),
                                               adapter_name=names[0]).eval()
        for name in names[1:]:
            peft_model.load_adapter(str(Path(tmp) / name), adapter_name=name)
        theirs = torch.zeros_like(ours)
        for c in route.unique().tolist():
            rows = (route == c).nonzero().flatten()
            peft_model.set_adapter(names[c])
            theirs[rows] = logp(peft_model, [batch[i] for i in rows.tolist()])
        del peft_model
        _free(sizes)
        reference_model = load_model(model_dir, dtype=wide, device=sizes.device)
        reference_lora = MultiLoRA(reference_model, sizes.k, LORA, seed=0)
        for c, name in enumerate(names):
            reference_lora.load_peft(c, Path(tmp) / name)
        base = logp(reference_model)
        targets_wide = target_terms(reference_model)
        with reference_lora.route(route):
            reference = logp(reference_model)
        del reference_model, reference_lora
        _free(sizes)
    return {"rows": int(route.shape[0]), "dtype": dtype_name(sizes.dtype),
            "wide_dtype": dtype_name(wide), "mean_abs_logp": float(reference.abs().mean()),
            "ours_vs_peft": float((ours - theirs).abs().max()), "ours_vs_wide": float((ours - reference).abs().max()),
            "peft_vs_wide": float((theirs - reference).abs().max()),
            "adapter_effect": float((reference - base).abs().max()),
            "base_batch_shape": float((base_batched - base_alone).abs().max()),
            "base_vs_wide": float((base_batched - base).abs().max()),
            "target_terms_vs_wide": float((targets - targets_wide).abs().max()),
            "mean_abs_target_term": float(targets_wide.abs().mean()),
            **padding_gaps, **gaps}


def host_waits(model_dir: Path, sizes: Sizes, batch: list[TokenizedResponse]) -> dict[str, list[str]] | None:
    """Every place where the E-step's and the M-step's passes make the host wait for the GPU, on all k
    adapters mixed, rows whole and prompts shared, and a whole M-step (`LoRAPolicyScorer.fit`, a = 2,
    2 examples of m' = 4, every pair weighted, 2 pairs per optimizer step; its reads of the
    objectives once an M-step and for the progress bar are expected): each under torch's CUDA
    synchronisation check (`_waits`; an empty list when it never waits, backward included). None on
    the CPU, which runs each once unchecked (tests/test_estimate.py checks the same passes, and
    tests/test_lora_policy.py the M-step, on the meta device)."""
    model, lora = _lora_model(model_dir, sizes)
    params = list(lora.named_parameters().values())

    def e_pass(shared: bool) -> None:
        with lora.requires_grad(False):
            _mixed_pass(model, lora, batch, sizes, shared_prompts=shared)

    found = _waits_of({"E-step pass, rows whole": lambda: e_pass(False),
                       "E-step pass, prompts shared": lambda: e_pass(True),
                       "M-step pass, rows whole": lambda: _mixed_pass(model, lora, batch, sizes, params),
                       "M-step pass, prompts shared": lambda: _mixed_pass(model, lora, batch, sizes, params, True)},
                      sizes)
    del model, lora
    _free(sizes)
    inputs = synthetic_inputs(sizes, 4, 2, *_model_vocab(model_dir))
    weights = torch.full((2, sizes.k), 1.0 / sizes.k, dtype=torch.float64)
    scorer = LoRAPolicyScorer(model_dir, sizes.k, beta=BETA, anchors=2, lora=LORA, lr=1e-4, batch_size=2,
                              score_batch_size=sizes.score_batch_size, seed=0, dtype=sizes.dtype, device=sizes.device)
    scorer.score(inputs, 0)  # the estimates the M-step holds
    found.update(_waits_of({"M-step (fit), a = 2": lambda: scorer.fit(inputs, inputs.rankings(), weights, 1)}, sizes))
    del scorer
    _free(sizes)
    return found if sizes.cuda else None


def _waits_of(runs: dict[str, Callable[[], Any]], sizes: Sizes) -> dict[str, list[str]]:
    """`_waits` of each run after one run unchecked (a first run may initialise libraries, cuBLAS
    handles, which waits once); on the CPU each runs once, and nothing is checked."""
    found = {}
    for name, run in runs.items():
        run()
        if not sizes.cuda:
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            found[name] = _waits(run)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def _waits(run: Callable[[], Any], where: tuple[str, ...] = ("moplex_core", "transformers")) -> list[str]:
    """The distinct places, in order, where ``run`` raised torch's "synchronizing CUDA operation"
    warning (torch.cuda.set_sync_debug_mode("warn")), each as its innermost three frames in files
    whose path contains one of ``where`` ("logprobs.py:240 <- estimate.py:133 <- ..."). Other warnings
    are left out."""
    sites: dict[str, None] = {}

    def record(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                  if any(part in f.filename for part in where)]
        sites.setdefault(" <- ".join(reversed(frames[-3:])) or f"{Path(filename).name}:{lineno}")

    with warnings.catch_warnings():  # restores showwarning and the filters after
        warnings.simplefilter("always")
        warnings.showwarning = record
        run()
    return list(sites)


# -- 4. the card's ceilings ------------------------------------------------------------------


def ceilings(sizes: Sizes) -> dict[str, Any]:
    """The two rates a pass's time is read against (`_sustained_seconds` each): TFLOP/s of an
    n x n x n matmul in the run's dtype (2 n^3 per product), and TB/s of a device-to-device copy of
    16 n^2 elements (bytes read plus bytes written)."""
    n = sizes.matmul_n
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=sizes.device, dtype=sizes.dtype)  # [n, n]
    b = torch.randn(n, n, generator=generator).to(device=sizes.device, dtype=sizes.dtype)  # [n, n]
    out = torch.empty_like(a)
    matmul_s = _sustained_seconds(lambda: torch.matmul(a, b, out=out), sizes)
    del a, b, out
    source = torch.rand(16 * n, n, device=sizes.device, dtype=sizes.dtype)  # [16n, n], 2 GiB in bf16 at n = 8192
    target = torch.empty_like(source)
    copy_s = _sustained_seconds(lambda: target.copy_(source), sizes)
    moved = 2 * source.numel() * source.element_size()
    return {"n": n, "dtype": dtype_name(sizes.dtype), "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
            "copy_gib": moved / 2**30, "copy_tbs": moved / copy_s / 1e12}


# -- report ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, oom: bool) -> str:
    if oom:
        return "OOM"
    return "-" if value is None else format(value, spec)


def _minibatch(sizes: dict[str, Any]) -> str:
    """The M-step minibatch as the report and em_gpu.json say it, from em_gpu.json's sizes."""
    pairs = sizes.get("pairs_per_step", 1)  # em_gpu.json written before the setting existed: 1
    if pairs == 1:
        return ("1 (example, cluster) pair = m' rows (full) or a rows (a=...) per backward (a = 2: 2-row passes, "
                "which a GPU runs below its throughput)")
    return (f"{pairs} (example, cluster) pairs per optimizer step, in passes of at most {sizes['score_batch_size']} "
            "rows (a pair's m' or a rows never split: a larger pair is a pass of its own)")


def print_report(results: dict[str, Any]) -> None:
    sizes = results["sizes"]
    attention = results.get("throughput", {}).get("attention")
    print(f"## EM iteration cost and anchor-pass throughput on {results['device']}\n")
    print(f"{results['date']}; {sizes['description']}{f', {attention} attention' if attention else ''}; torch "
          f"{results['versions']['torch']}, transformers {results['versions']['transformers']}, peft "
          f"{results['versions']['peft']}; {results['threads']} CPU thread(s). Rows of {sizes['row_tokens']} "
          f"random tokens ({sizes['prompt_tokens']} prompt + {sizes['response_tokens']} response incl. EOS).\n")
    if "em" in results:
        print(f"### One EM iteration, k = {sizes['k']} LoRA adapters (r = {LORA.r}, alpha {LORA.alpha:g}, "
              f"{len(LORA.target_modules)} projections), n = {results['examples']} examples\n")
        print(f"M-step minibatch: {_minibatch(sizes)}; "
              f"E-step: {sizes['score_batch_size']} rows per forward; prompts `shared`: run once per (example, "
              "cluster) and pass (the default), `per row`: with every response; speedup and memory against "
              "full with the same prompts; every pair weighted 1/k (all above "
              "gamma_min, the worst case: an early iteration); late: the M-step of an iteration whose posteriors "
              "sit on one cluster per example (k times fewer pairs), plus the same E-step. Times per example; "
              "peak memory of the tensors (weights included) of each step, and their maximum for the ratio; "
              "reserved: the most the allocator held (what must fit on the card).\n")
        print("| m' | method | prompts | E-step s/ex | M-step s/ex | total s/ex | E-step peak GiB | M-step peak GiB "
              "| reserved GiB | speedup vs full | memory full/this | late M-step s/ex | late total s/ex "
              "| late speedup |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for row in results["em"]:
            oom = row["oom"]
            print(f"| {row['m_prime']} | {row['method']} | {row['prompts']} | "
                  f"{_fmt(row['e_step_s_per_example'], '.3g', oom)} | "
                  f"{_fmt(row['m_step_s_per_example'], '.3g', oom)} | {_fmt(row['total_s_per_example'], '.3g', oom)} | "
                  f"{_fmt(row['e_step_peak_gib'], '.1f', oom)} | {_fmt(row['m_step_peak_gib'], '.1f', oom)} | "
                  f"{_fmt(row.get('peak_reserved_gib'), '.1f', oom)} | {_fmt(row['speedup_vs_full'], '.2f', False)} | "
                  f"{_fmt(row['memory_ratio_full_over_this'], '.2f', False)} | "
                  f"{_fmt(row.get('late_m_step_s_per_example'), '.3g', oom)} | "
                  f"{_fmt(row.get('late_total_s_per_example'), '.3g', oom)} | "
                  f"{_fmt(row.get('late_speedup_vs_full'), '.2f', False)} |")
        print()
    if "throughput" in results:
        print(f"### Anchor pass over B rows, response-only chunked log-probs (k = {sizes['k']}, median of "
              f"{sizes['repeats']} after {sizes['warmups']} warm-up(s))\n")
        print("| pass | B | ms | tokens/s | vs plain | peak GiB |")
        print("|---|---|---|---|---|---|")
        for row in results["throughput"]["rows"]:
            oom = row["oom"]
            print(f"| {row['pass']} | {row['batch']} | {_fmt(row['ms'], '.1f', oom)} | "
                  f"{_fmt(row['tokens_per_s'], ',.0f', oom)} | {_fmt(row['ratio_vs_plain'], '.2f', False)} | "
                  f"{_fmt(row['peak_gib'], '.1f', oom)} |")
        print()
    if "profile" in results:
        _print_profile(results["profile"], results.get("ceilings", {}).get("copy_tbs"))
    if "check" in results:
        check = results["check"]
        print(f"### Agreement: {check['rows']} rows, all k adapters mixed in one pass, against PEFT (one adapter "
              f"at a time) in {check['dtype']} and MultiLoRA in {check['wide_dtype']}; max |difference| of "
              f"log pi(y|x), nats (mean |log pi| {check['mean_abs_logp']:.1f})\n")
        print("| ours vs PEFT | ours vs wide | PEFT vs wide | adapter effect | base: batched vs alone | "
              "base vs wide | base, padded rows: no mask vs padding mask | base, lean modules vs transformers' "
              "(log pi and input gradients) | transformers' run twice |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {check['ours_vs_peft']:.3g} | {check['ours_vs_wide']:.3g} | {check['peft_vs_wide']:.3g} | "
              f"{check['adapter_effect']:.3g} | {check['base_batch_shape']:.3g} | {check['base_vs_wide']:.3g} | "
              f"{_fmt(check.get('padding_mask'), '.3g', False)} | {_fmt(check.get('lean_vs_stock'), '.3g', False)} | "
              f"{_fmt(check.get('stock_vs_stock'), '.3g', False)} |\n")
        if "padding_mask_input_grads" in check:
            print(f"Padded rows' input gradients, no mask against the padding mask: largest gap "
                  f"{check['padding_mask_input_grads']:.3g} of the largest gradient.\n")
        if "shared_prompts" in check:
            print(f"The base model's rows through the shared-prompt pass (each row its own prompt, all of one "
                  f"length: the continuation under a bottom-right causal bias) against the same rows whole: "
                  f"log pi {check['shared_prompts']:.3g} nats, input gradients "
                  f"{check['shared_prompts_input_grads']:.3g} of the largest gradient.\n")
        if "target_terms_vs_wide" in check:
            print(f"The base model's target terms (each row's tokens against the other rows' in its contexts; mean "
                  f"|u| {check['mean_abs_target_term']:.3g} nats): {check['dtype']} against {check['wide_dtype']} "
                  f"{check['target_terms_vs_wide']:.3g}, through the shared-prompt pass against whole rows "
                  f"{check['shared_prompts_target_terms']:.3g}.\n")
        print("Base model's batched-vs-alone and dtype gaps: what every delta starts from when the cache computed "
              "log pi_ref in another pass shape or dtype (the train stage's reference_gap). Padded rows: moplex's "
              "unmasked pass against the padding mask it used before, the same rows.\n")
        if check.get("host_waits"):
            print("Where a pass makes the host wait for the GPU (torch.cuda.set_sync_debug_mode):\n")
            print("| pass | waits |\n|---|---|")
            for name, sites in check["host_waits"].items():
                print(f"| {name} | {'; '.join(sites) or 'none'} |")
            print()
    if "ceilings" in results:
        top = results["ceilings"]
        print(f"{top['dtype']} matmul, {top['n']}^3: {top['matmul_tflops']:.1f} TFLOP/s; device-to-device copy "
              f"moving {top['copy_gib']:.3g} GiB: {top['copy_tbs']:.3g} TB/s")


def _print_profile(profile: dict[str, Any], copy_tbs: float | None) -> None:
    plain, multi = profile["plain"], profile["multi_lora"]
    print(f"### Where the anchor pass's time goes: B = {profile['batch']} rows, wall time as above, then one "
          "profiled pass (torch.profiler; self time of each aten op's kernels, CPU time on the CPU)\n")
    print("| pass | wall ms | busy ms | busy / wall | kernels |")
    print("|---|---|---|---|---|")
    passes = ((PLAIN, plain), (MULTI_E, multi), (MULTI_E_PROMPT_PASS, profile.get("multi_lora_prompt_pass")),
              (MULTI_M, profile.get("multi_lora_m")))
    for label, row in passes:
        if row is not None:  # a run from before these two rows existed (--resume) has only the first two
            print(f"| {label} | {row['wall_ms']:.1f} | {row['busy_ms']:.1f} | {row['busy_ms'] / row['wall_ms']:.2f} | "
                  f"{_fmt(row['kernels'], 'd', False)} |")
    print()
    keys = sorted(plain["ops"].keys() | multi["ops"].keys(),
                  key=lambda key: -max(plain["ops"].get(key, {"ms": 0})["ms"], multi["ops"].get(key, {"ms": 0})["ms"]))
    print("| aten op | plain ms | plain calls | multi-LoRA ms | multi-LoRA calls | difference ms |")
    print("|---|---|---|---|---|---|")
    for key in keys[:PROFILE_TOP]:
        mine, theirs = multi["ops"].get(key, {"ms": 0.0, "calls": 0}), plain["ops"].get(key, {"ms": 0.0, "calls": 0})
        print(f"| {key} | {theirs['ms']:.2f} | {theirs['calls']} | {mine['ms']:.2f} | {mine['calls']} | "
              f"{mine['ms'] - theirs['ms']:+.2f} |")
    rest = [sum(row["ops"][key]["ms"] for key in keys[PROFILE_TOP:] if key in row["ops"]) for row in (plain, multi)]
    if len(keys) > PROFILE_TOP:
        print(f"| {len(keys) - PROFILE_TOP} other ops | {rest[0]:.2f} | | {rest[1]:.2f} | | {rest[1] - rest[0]:+.2f} |")
    print()
    at_copy_rate = "" if copy_tbs is None else f", {profile['lora_extra_gb'] / copy_tbs:.3g} ms at the copy rate below"
    print(f"The LoRA path's extra memory traffic, counted (each tensor read or written once per kernel): "
          f"{profile['lora_extra_gb']:.3g} GB per pass{at_copy_rate}; measured wall-time difference "
          f"{multi['wall_ms'] - plain['wall_ms']:.3g} ms.\n")


def plot_figure5(results: dict[str, Any], path: Path) -> None:
    """Time per example (left) and peak memory (right) vs m', one line per method; OOM left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # only here: the tables need no matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    time_axes, memory_axes = figure.subplots(1, 2)
    lines = dict.fromkeys((row["method"], row["prompts"]) for row in results.get("em", []))
    for method, prompts in lines:
        points = [r for r in results["em"] if (r["method"], r["prompts"]) == (method, prompts) and not r["oom"]]
        m_primes = [r["m_prime"] for r in points]
        style = {"marker": "o", "linestyle": "-" if prompts == "shared" else "--",
                 "label": method if prompts == "shared" else f"{method}, prompt per row"}
        time_axes.plot(m_primes, [r["total_s_per_example"] for r in points], **style)
        if all(r["peak_gib"] is not None for r in points):
            memory_axes.plot(m_primes, [r["peak_gib"] for r in points], **style)
    m_primes = sorted({row["m_prime"] for row in results.get("em", [])})
    time_axes.set(xlabel="m' (responses per example)", ylabel="runtime per example (s)", xticks=m_primes,
                  title="one EM iteration (E-step + M-step)")
    memory_axes.set(xlabel="m' (responses per example)", ylabel="peak memory (GiB)", xticks=m_primes,
                    title="peak GPU memory")
    if not memory_axes.lines:
        memory_axes.text(0.5, 0.5, "measured on CUDA only", ha="center", va="center", transform=memory_axes.transAxes)
    for axes in (time_axes, memory_axes):
        if axes.lines:
            axes.legend()
    figure.suptitle(f"Full computation vs MoPLEx anchors, k = {results['sizes']['k']}: {results['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for em_gpu.json and em_gpu.png")
    parser.add_argument("--examples", type=int, default=2, help="examples n of the EM section")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--m-primes", help="comma-separated m' values of the EM section (default: all of the size's)")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="start no section or EM configuration after this many seconds; print and plot what "
                             "was measured (e.g. 420 under a 600 s limit, then --resume)")
    parser.add_argument("--resume", type=Path, metavar="JSON",
                        help="an em_gpu.json of an earlier run at the same size: its sections and EM "
                             "configurations are kept and not run again")
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (the tests' path)")
    profile.add_argument("--smoke", action="store_true",
                         help="the tiny model on the GPU in bf16: every section's CUDA path in seconds, before "
                              "the real run spends minutes building and loading the 0.6B model")
    profile.add_argument("--cpu", action="store_true",
                         help="a small model on the CPU (4 layers, hidden 256, 256 + 256-token rows, k = 3)")
    parser.add_argument("--score-batch-size", type=int, metavar="ROWS",
                        help="rows per E-step pass and at most per M-step pass (default: the size's, 8 on the GPU)")
    parser.add_argument("--pairs-per-step", type=int, default=1, metavar="P",
                        help="(example, cluster) pairs per M-step minibatch (default 1, the paper's comparison; "
                             "the pipeline's train.batch_size is 16)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS) or args.examples < 1:
        parser.error(f"--sections takes {', '.join(SECTIONS)} (got {args.sections!r}); --examples >= 1")
    sizes = TINY if args.tiny else SMOKE if args.smoke else CPU if args.cpu else GPU
    if args.pairs_per_step < 1 or (args.score_batch_size is not None and args.score_batch_size < 1):
        parser.error("--pairs-per-step and --score-batch-size take whole numbers >= 1")
    sizes = replace(sizes, pairs_per_step=args.pairs_per_step,
                    score_batch_size=args.score_batch_size or sizes.score_batch_size)
    try:
        m_primes = sizes.m_primes if args.m_primes is None else tuple(int(m) for m in args.m_primes.split(","))
    except ValueError:
        m_primes = ()
    if not m_primes or not set(m_primes) <= set(sizes.m_primes):
        parser.error(f"--m-primes takes values of {sizes.m_primes} at this size, got {args.m_primes!r}")
    if args.m_primes is not None and "em" not in sections:
        parser.error("--m-primes chooses the m' values of the em section, which --sections leaves out")
    if sizes.cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or pass --cpu or --tiny for a CPU run")
    if sizes.threads:
        torch.set_num_threads(sizes.threads)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)  # PEFT's LoRA A and the random LoRA B of the throughput section
    args.out.mkdir(parents=True, exist_ok=True)

    recorded_sizes = {"description": sizes.description, "k": sizes.k, "prompt_tokens": sizes.prompt_tokens,
                      "response_tokens": sizes.response_tokens, "row_tokens": sizes.row_tokens,
                      "originals": sizes.originals, "score_batch_size": sizes.score_batch_size,
                      "pairs_per_step": sizes.pairs_per_step,
                      "lora": {"r": LORA.r, "alpha": LORA.alpha, "target_modules": list(LORA.target_modules)},
                      "warmups": sizes.warmups, "repeats": sizes.repeats}
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if sizes.cuda else f"CPU ({platform.processor() or platform.machine()})",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "threads": torch.get_num_threads(),
        "examples": args.examples,
        "sizes": recorded_sizes,
        "protocol": {
            "m_step_minibatch": _minibatch(recorded_sizes),
            "prompts": "shared: one prompt pass per (example, cluster) and pass; per row: the prompt with every row",
            "e_step_batch": f"{sizes.score_batch_size} rows (one response under one adapter) per forward",
            "fit_weights": "1/k for every (example, cluster) pair: all above gamma_min, the worst case",
            "late_fit_weights": "one-hot: each example's posterior on one cluster (cluster = example index mod k)",
            "em_warmup": "fit on one pair at iteration 0, then score(iteration 0); timed: fit and score of "
                         "iteration 1, then fit of iteration 2 with the late weights",
            "throughput": f"median of {sizes.repeats} passes after {sizes.warmups} warm-up(s)",
        },
    }
    previous: dict[str, Any] = json.loads(args.resume.read_text()) if args.resume else {}
    if previous and ({"pairs_per_step": 1, **previous["sizes"]}, previous["examples"], previous["device"]) != \
            (results["sizes"], results["examples"], results["device"]):
        parser.error(f"{args.resume} was measured at another size, n or device; it cannot be resumed here")
    results.update({section: previous[section] for section in SECTIONS if section in previous})
    if previous:
        results["resumed_from"] = previous.get("resumed_from", previous["date"])

    def save(section: str, value: Any) -> None:
        """Keep a section's numbers on disk at once: a run stopped by a time limit keeps what it did
        (written beside, then renamed: a kill mid-write leaves the last whole file)."""
        results[section] = value
        partial = args.out / "em_gpu.json.partial"
        partial.write_text(json.dumps(results, indent=2))
        partial.replace(args.out / "em_gpu.json")

    def finished(section: str, value: Any) -> None:
        save(section, value)
        print(f"{section} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    @functools.cache  # said once
    def deadline_reached() -> None:
        print(f"--deadline {args.deadline:g} s reached: what is left is not started; rerun with --resume "
              f"{args.out / 'em_gpu.json'}", file=sys.stderr, flush=True)

    def time_left() -> bool:
        if args.deadline is None or time.perf_counter() - started < args.deadline:
            return True
        deadline_reached()
        return False

    def wanted(section: str) -> bool:
        return section in sections and section not in previous and time_left()

    started = time.perf_counter()
    # The short sections first, the EM section (most of the time) last; within it the target m'
    # first (em_iteration_costs), so that a run cut short keeps what matters most.
    if wanted("ceilings"):
        finished("ceilings", ceilings(sizes))
        _free(sizes)  # its 4 GiB of tensors would stay cached and count in the next section's reserved memory
    with tempfile.TemporaryDirectory() as tmp:
        @functools.cache  # built on first use: a resumed run with nothing left builds nothing
        def model_dir() -> Path:
            return build_model(sizes, Path(tmp) / "model")

        if wanted("check"):
            batch = _batches(model_dir(), sizes)[min(sizes.batch_rows)]
            finished("check", {**lora_agreement(model_dir(), sizes, batch),
                               "host_waits": host_waits(model_dir(), sizes, batch)})
        if wanted("throughput"):
            finished("throughput", anchor_pass_throughput(model_dir(), sizes))
        if wanted("profile"):
            finished("profile", anchor_pass_profile(model_dir(), sizes, args.out))
        if "em" in sections:
            finished("em", em_iteration_costs(model_dir, sizes, args.examples, m_primes, previous.get("em", []),
                                              lambda rows: save("em", rows), time_left))

    print_report(results)
    plot_figure5(results, args.out / "em_gpu.png")
    print(f"\nwrote {args.out / 'em_gpu.json'} and {args.out / 'em_gpu.png'}")


if __name__ == "__main__":
    main()
