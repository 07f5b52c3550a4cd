"""What every section of benchmarks/em_gpu.py runs on, and benchmarks/host_ops.py reuses: the sizes of
a run (the GPU's; ``--cpu``'s, ``--tiny``'s and ``--smoke``'s), the synthetic model and rows, the
E-step's and the M-step's anchor passes over mixed adapters, and their time and peak memory on either
device (synchronised, None for memory on the CPU)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from moplex_core.estimate import AnchorPass, anchor_pass
from moplex_core.lm.loading import load_model
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA
from moplex_core.lm.tiny import build_qwen3_0_6b_shape, build_tiny_model
from moplex_core.lm.tokenize import TokenizedResponse
from moplex_core.pl import encode_tiers_batch
from moplex_core.scorers.lora_policy import PolicyInputs

TOKENIZER_TEXTS = ("Rank these answers by the criterion you were given.", "0 1 2 3 4 5 6 7 8 9")
LORA = LoRASettings(r=16, alpha=32.0)  # all 7 projections (LoRASettings' default targets)
BETA = 0.1
PAD_ID = 0  # rows of one batch have equal lengths but in the padded-rows passes (em_gpu_passes)


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
    gradient_checkpointing: bool = False  # the EM section's train.gradient_checkpointing

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
TARGET_M_PRIMES = (26, 32)  # the issue's targets: a = 6 against full computation at m' = 26; full fits at 32


def sync(sizes: Sizes) -> None:
    if sizes.cuda:
        torch.cuda.synchronize()


def reset_peak(sizes: Sizes) -> None:
    if sizes.cuda:
        torch.cuda.reset_peak_memory_stats()


def peak_gib(sizes: Sizes) -> float | None:
    """Peak GPU memory the tensors held since the last reset, GiB; None on the CPU (not measured)."""
    return torch.cuda.max_memory_allocated() / 2**30 if sizes.cuda else None


def peak_reserved_gib(sizes: Sizes) -> float | None:
    """Peak GPU memory the caching allocator held since the last reset (tensors, fragmentation and
    cached blocks), GiB: what must fit on the card; None on the CPU."""
    return torch.cuda.max_memory_reserved() / 2**30 if sizes.cuda else None


def out_of_memory(error: RuntimeError) -> bool:
    """A CUDA allocation failure: torch's own, or one inside cuBLAS or another library (a plain
    RuntimeError that says so)."""
    message = str(error)
    return (isinstance(error, torch.cuda.OutOfMemoryError) or "CUBLAS_STATUS_ALLOC_FAILED" in message
            or "out of memory" in message.lower())


def free(sizes: Sizes) -> None:
    gc.collect()
    if sizes.cuda:
        torch.cuda.empty_cache()


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


def model_vocab(model_dir: Path) -> tuple[int, int]:
    config = AutoConfig.from_pretrained(model_dir)
    return config.vocab_size, config.eos_token_id


def random_batches(model_dir: Path, sizes: Sizes) -> dict[int, list[TokenizedResponse]]:
    """B random rows (prompt + response, equal lengths) per B of ``sizes.batch_rows``, seeded."""
    vocab_size, eos_id = model_vocab(model_dir)
    generator = torch.Generator().manual_seed(0)
    return {b: [row for _ in range(b) for row in random_responses(generator, 1, sizes, vocab_size, eos_id)]
            for b in sizes.batch_rows}


def input_grad_pass(model: nn.Module, rows: list[TokenizedResponse], **route: Any) -> AnchorPass:
    """The E-step's anchor pass, as the scorer runs it but for the target terms' gather (m' logits a
    position from the logits the log-probs compute anyway; the EM section's scorer runs it): log
    pi(y|x) of every row and d/d inputs_embeds at the response positions. ``route``: anchor_pass's
    ``groups`` and ``route``."""
    return anchor_pass(model, rows, PAD_ID, input_grads=True, **route)


def weight_grad_pass(model: nn.Module, rows: list[TokenizedResponse], params: list[nn.Parameter], **route: Any
                      ) -> None:
    """The M-step's pass: log pi(y|x) of every row, backward into ``params`` (then dropped)."""
    anchor_pass(model, rows, PAD_ID, input_grads=False, keep_graph=True, **route).logp.sum().backward()
    for p in params:
        p.grad = None


def median_seconds(run: Callable[[], Any], sizes: Sizes) -> float:
    """Median wall time of ``repeats`` runs after ``warmups``, the device synchronised around each."""
    for _ in range(sizes.warmups):
        run()
    sync(sizes)
    reset_peak(sizes)
    times = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        run()
        sync(sizes)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sustained_seconds(run: Callable[[], Any], sizes: Sizes, warmup_s: float = 0.25, per_sample: int = 20) -> float:
    """Seconds per ``run`` at a sustained rate: ``run`` repeated for ``warmup_s`` (an idle card's clocks
    rise, the library picks its kernels), then the median over ``repeats`` samples of ``per_sample``
    back-to-back runs (one synchronisation per sample, not per run: a millisecond kernel is not
    timed against the host's overhead)."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        run()
        sync(sizes)
    samples = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        for _ in range(per_sample):
            run()
        sync(sizes)
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


def measure(label: str, run: Callable[[list[TokenizedResponse]], Any], batches: dict[int, list[TokenizedResponse]],
             sizes: Sizes
             ) -> list[dict[str, Any]]:
    rows = []
    for b, batch in batches.items():
        try:
            seconds = median_seconds(lambda: run(batch), sizes)
            rows.append({"pass": label, "batch": b, "oom": False, "ms": 1000 * seconds,
                         "tokens_per_s": b * sizes.row_tokens / seconds, "peak_gib": peak_gib(sizes)})
        except RuntimeError as error:
            if not out_of_memory(error):
                raise
            rows.append({"pass": label, "batch": b, "oom": True, "ms": None, "tokens_per_s": None, "peak_gib": None})
        free(sizes)
    return rows


def load_frozen_model(model_dir: Path, sizes: Sizes) -> nn.Module:
    model = load_model(model_dir, dtype=sizes.dtype, device=sizes.device)
    model.requires_grad_(False)  # only inputs_embeds or LoRA weights get gradients
    return model


def perturb_lora_b(params: dict[str, nn.Parameter], std: float = 1e-3) -> None:
    """Random LoRA B (it starts at 0) of every ``.lora_B`` parameter, so the adapters are not all the
    base model."""
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith(".lora_B"):
                p.normal_(0.0, std)


def load_stock_model(model_dir: Path, sizes: Sizes) -> nn.Module:
    """The frozen model with transformers' own modules (load_model swaps in moplex's lean ones)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=sizes.dtype).to(sizes.device).eval()
    return model.requires_grad_(False)


def load_lora_model(model_dir: Path, sizes: Sizes) -> tuple[nn.Module, MultiLoRA]:
    """The frozen model with k adapters of small random LoRA B."""
    model = load_frozen_model(model_dir, sizes)
    lora = MultiLoRA(model, sizes.k, LORA, seed=0)
    perturb_lora_b(lora.named_parameters())
    return model, lora


def mixed_pass(model: nn.Module, lora: MultiLoRA, batch: list[TokenizedResponse], sizes: Sizes,
                params: list[nn.Parameter] | None = None, shared_prompts: bool = False) -> None:
    """The anchor pass with row b routed to adapter b mod k: backward into ``params`` (the LoRA
    weights: the M-step's pass), or w.r.t. the inputs when None (the E-step's). ``shared_prompts``:
    through the prompt pass, each row its own prompt (the batches' rows have prompts of their own)."""
    adapters = (torch.arange(len(batch)) % sizes.k).tolist()  # [B]
    route = {"route": lambda rows: lora.route([adapters[r] for r in rows]),
             "groups": list(range(len(batch))) if shared_prompts else None}
    if params is None:
        input_grad_pass(model, batch, **route)
    else:
        weight_grad_pass(model, batch, params, **route)
