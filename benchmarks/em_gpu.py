"""Cost of one EM iteration over k LoRA adapters, full computation vs MoPLEx anchors (issue 9).

    PYTHONPATH=. python3 benchmarks/em_gpu.py --out DIR [--examples 2] [--sections check,em,throughput,profile,cache,ceilings]
                                              [--m-primes 26,32] [--resume EARLIER/em_gpu.json]
                                              [--pairs-per-step 16] [--score-batch-size 32]
    PYTHONPATH=. python3 benchmarks/em_gpu.py --cpu --out DIR       # a small model on the CPU
    PYTHONPATH=. python3 benchmarks/em_gpu.py --tiny --out DIR      # the CPU path the tests run
    PYTHONPATH=. python3 benchmarks/em_gpu.py --smoke --out DIR     # the tiny sizes on the GPU in bf16 (seconds)

The model is Qwen3-0.6B-shaped with seeded random weights (moplex_core.lm.tiny.build_qwen3_0_6b_shape:
28 layers, hidden 1024, 16 / 8 heads of 128, vocabulary 151,936) in bf16 with SDPA attention,
built into a temporary directory. Every row is 1024 random token ids: 512 prompt + 512 response
tokens, EOS last. A check and five measurements, in one process:

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
   what the shared-prompt path costs where it saves nothing), and of the M-step pass of one pair
   (one adapter, the prompt per row) as the EM section runs it with one pair a step: a = 6 rows
   (MoPLEx) and m' = 26 rows (full computation), the same decoder matmuls over 4.3 times the rows
   (the log-probs: one vocabulary chunk per 1024 response positions, 3 against 13). The
   traces are written to OUT (none for the two one-pair passes).
4. The cache stage's passes (``cache``): `moplex_core.estimate.reference_terms_batch` over the n
   examples at m' = 26 (the largest m' of a CPU size), as the cache stage runs it (one call per
   example, at most 32 rows a pass), with and without the reference contractions, each example's
   prompt shared and per row (`cache.share_prompts`): seconds per example, peak memory, the speedup
   of the prompt per row and the largest log pi_ref gap between the two modes; one example's call
   of each under torch.profiler (busy time, kernels, and each aten op's time per row against shared:
   where a shared prompt's pass spends what its half of the tokens should save; no trace kept).
5. The card's ceilings (``ceilings``): its bf16 matmul rate (an 8192^3 GEMM) and its
   device-to-device copy rate (a 2 GiB tensor: 4 GiB read and written), the two rates a pass's time
   is read against; each after a quarter second of warm-up (the clocks rise from idle), timed over
   20 back-to-back operations per sample.

The sections run in the order ceilings, check, throughput, profile, cache, em (the EM section takes most
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
a = 2, B = 6 (76 s on 2 idle cores, 158 s on one busy one).

``--tiny`` runs the same code on the CPU in float32 on the tests' kind of tiny Qwen3 (2 layers,
hidden 64; random weights): k = 3, rows of 12 + 16 tokens, m' in {4, 6}, a = 2, B = 6, a 256^3
matmul, one thread, no CUDA call (peak memory "-"). tests/test_em_gpu_benchmark.py runs it.
``--smoke`` runs those sizes on the GPU in bf16: every section's CUDA path (synchronisation, memory
statistics, the CUDA profiler, the PEFT bf16 row) in seconds, so a GPU session learns of a problem
before the real run builds and loads the 0.6B-shaped model.

Only moplex_core modules that import neither pydantic nor prefect are used (the GPU machine has
neither): moplex_core.scorers.lora_policy (with estimate, em and pl) and moplex_core.lm.

The code: this file (the EM section, the ceilings and the command line); em_gpu_rig.py (the sizes,
the synthetic model and rows, the passes, timing and memory); em_gpu_passes.py (check, throughput,
profile); em_gpu_report.py (the tables and the figure).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from em_gpu_passes import anchor_pass_profile, anchor_pass_throughput, cache_pass_costs, host_waits, lora_agreement
from em_gpu_report import minibatch_note, plot_figure5, print_report
from em_gpu_rig import (
    BETA,
    CPU,
    GPU,
    LORA,
    SMOKE,
    TARGET_M_PRIMES,
    TINY,
    Sizes,
    build_model,
    free,
    model_vocab,
    out_of_memory,
    peak_gib,
    peak_reserved_gib,
    random_batches,
    reset_peak,
    sustained_seconds,
    sync,
    synthetic_inputs,
)
from moplex_core.lm.loading import dtype_name
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, PolicyInputs

SECTIONS = ("check", "em", "throughput", "profile", "cache", "ceilings")

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
            vocab_size, eos_id = model_vocab(model_dir())
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
                                  share_prompts=share_prompts, gradient_checkpointing=sizes.gradient_checkpointing,
                                  seed=0, dtype=sizes.dtype, device=sizes.device)
        scorer.fit(inputs, rankings, one_pair, 0)
        scorer.score(inputs, 0)
        sync(sizes)
        reset_peak(sizes)
        start = time.perf_counter()
        scorer.fit(inputs, rankings, weights, 1)
        sync(sizes)
        fitted = time.perf_counter()
        m_step_steps = scorer.last_fit["steps"]
        m_step_peak, m_step_reserved = peak_gib(sizes), peak_reserved_gib(sizes)
        reset_peak(sizes)
        scorer.score(inputs, 1)
        sync(sizes)
        scored = time.perf_counter()
        e_step_peak, e_step_reserved = peak_gib(sizes), peak_reserved_gib(sizes)
        scorer.fit(inputs, rankings, late, 2)  # peak memory not read: fewer pairs, the same passes
        sync(sizes)
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
        if not out_of_memory(error):
            raise
        return {"oom": True, "e_step_s_per_example": None, "m_step_s_per_example": None,
                "m_step_optimizer_steps": None,
                "total_s_per_example": None, "late_m_step_s_per_example": None, "late_total_s_per_example": None,
                "m_step_peak_gib": None, "e_step_peak_gib": None, "peak_gib": None,
                "peak_reserved_gib": None}
    finally:
        del scorer
        free(sizes)


# -- 4. the card's ceilings ------------------------------------------------------------------


def ceilings(sizes: Sizes) -> dict[str, Any]:
    """The two rates a pass's time is read against (`sustained_seconds` each): TFLOP/s of an
    n x n x n matmul in the run's dtype (2 n^3 per product), and TB/s of a device-to-device copy of
    16 n^2 elements (bytes read plus bytes written)."""
    n = sizes.matmul_n
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=sizes.device, dtype=sizes.dtype)  # [n, n]
    b = torch.randn(n, n, generator=generator).to(device=sizes.device, dtype=sizes.dtype)  # [n, n]
    out = torch.empty_like(a)
    matmul_s = sustained_seconds(lambda: torch.matmul(a, b, out=out), sizes)
    del a, b, out
    source = torch.rand(16 * n, n, device=sizes.device, dtype=sizes.dtype)  # [16n, n], 2 GiB in bf16 at n = 8192
    target = torch.empty_like(source)
    copy_s = sustained_seconds(lambda: target.copy_(source), sizes)
    moved = 2 * source.numel() * source.element_size()
    return {"n": n, "dtype": dtype_name(sizes.dtype), "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
            "copy_gib": moved / 2**30, "copy_tbs": moved / copy_s / 1e12}


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
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="measure nothing: print the table of an earlier em_gpu.json and draw its em_gpu.png "
                             "in --out (no device needed; docs/em_gpu.png is docs/em_gpu_h200.json's)")
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
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the EM section with every decoder layer checkpointed (train.gradient_checkpointing)")
    args = parser.parse_args()
    if args.report is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        earlier = json.loads(args.report.read_text())
        print_report(earlier)
        plot_figure5(earlier, args.out / "em_gpu.png")
        print(f"\nwrote {args.out / 'em_gpu.png'}")
        return
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS) or args.examples < 1:
        parser.error(f"--sections takes {', '.join(SECTIONS)} (got {args.sections!r}); --examples >= 1")
    sizes = TINY if args.tiny else SMOKE if args.smoke else CPU if args.cpu else GPU
    if args.pairs_per_step < 1 or (args.score_batch_size is not None and args.score_batch_size < 1):
        parser.error("--pairs-per-step and --score-batch-size take whole numbers >= 1")
    sizes = replace(sizes, pairs_per_step=args.pairs_per_step,
                    score_batch_size=args.score_batch_size or sizes.score_batch_size,
                    gradient_checkpointing=args.gradient_checkpointing)
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
                      "pairs_per_step": sizes.pairs_per_step, "gradient_checkpointing": sizes.gradient_checkpointing,
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
            "m_step_minibatch": minibatch_note(recorded_sizes),
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
    earlier_sizes = {"pairs_per_step": 1, "gradient_checkpointing": False, **previous.get("sizes", {})}  # older files
    if previous and (earlier_sizes, previous["examples"], previous["device"]) != \
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
        free(sizes)  # its 4 GiB of tensors would stay cached and count in the next section's reserved memory
    with tempfile.TemporaryDirectory() as tmp:
        @functools.cache  # built on first use: a resumed run with nothing left builds nothing
        def model_dir() -> Path:
            return build_model(sizes, Path(tmp) / "model")

        if wanted("check"):
            batch = random_batches(model_dir(), sizes)[min(sizes.batch_rows)]
            finished("check", {**lora_agreement(model_dir(), sizes, batch),
                               "host_waits": host_waits(model_dir(), sizes, batch)})
        if wanted("throughput"):
            finished("throughput", anchor_pass_throughput(model_dir(), sizes))
        if wanted("profile"):
            finished("profile", anchor_pass_profile(model_dir(), sizes, args.out))
        if wanted("cache"):
            finished("cache", cache_pass_costs(model_dir(), sizes, args.examples))
        if "em" in sections:
            finished("em", em_iteration_costs(model_dir, sizes, args.examples, m_primes, previous.get("em", []),
                                              lambda rows: save("em", rows), time_left))

    print_report(results)
    plot_figure5(results, args.out / "em_gpu.png")
    print(f"\nwrote {args.out / 'em_gpu.json'} and {args.out / 'em_gpu.png'}")


if __name__ == "__main__":
    main()
