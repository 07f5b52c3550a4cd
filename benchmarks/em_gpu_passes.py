"""The sections of benchmarks/em_gpu.py about one anchor pass (its docstring says what each measures):
``check``, the multi-LoRA pass against PEFT and the base model's own gaps at this scale, and where a
pass makes the host wait for the GPU; ``throughput``, its tokens/s against the plain model and PEFT;
``profile``, where its time goes; ``cache``, the cache stage's passes with shared prompts and per row."""

from __future__ import annotations

import gzip
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from em_gpu_rig import (
    BETA,
    LORA,
    PAD_ID,
    TARGET_M_PRIMES,
    Sizes,
    free,
    input_grad_pass,
    load_frozen_model,
    load_lora_model,
    load_stock_model,
    measure,
    median_seconds,
    mixed_pass,
    model_vocab,
    out_of_memory,
    peak_gib,
    perturb_lora_b,
    random_batches,
    sync,
    synthetic_inputs,
    weight_grad_pass,
)
from moplex_core.estimate import anchor_pass, reference_terms_batch
from moplex_core.lm import logprobs
from moplex_core.lm.device import to_device
from moplex_core.lm.loading import dtype_name, load_model
from moplex_core.lm.multi_lora import MultiLoRA
from moplex_core.lm.tokenize import TokenizedResponse
from moplex_core.scorers.lora_policy import LoRAPolicyScorer

PLAIN = "plain base model, fwd + grad w.r.t. inputs_embeds"
PLAIN_PADDED = "plain base model, right-padded rows (responses half to full length), no mask (moplex)"
PLAIN_PADDED_MASKED = "plain base model, the same padded rows under a padding mask (moplex until 2026-11-24)"
PLAIN_STOCK = ("plain base model, transformers' RMSNorm and MLP (not moplex's lean ones), fwd + grad w.r.t. "
               "inputs_embeds")
MULTI_E = "multi-LoRA, k adapters mixed, fwd + grad w.r.t. inputs_embeds (E-step)"
MULTI_M = "multi-LoRA, k adapters mixed, fwd + backward into LoRA weights (M-step)"
MULTI_E_PROMPT_PASS = "multi-LoRA, k adapters mixed, E-step through the prompt pass (each row its own prompt)"
MULTI_M_ONE_PAIR = "multi-LoRA, one pair (one adapter, the prompt per row), fwd + backward into LoRA weights (M-step)"
MULTI_M_PROMPT_PASS = ("multi-LoRA, M-step through the prompt pass (two pairs: half the rows share one prompt "
                       "and adapter, half another)")
PEFT_ONE = "PEFT, 1 active adapter of k, fwd + grad w.r.t. inputs_embeds"
PEFT_ONE_MODEL_DTYPE = "PEFT, 1 active adapter of k, adapters in the model's dtype (autocast_adapter_dtype=False)"
PEFT_MIXED = "PEFT mixed adapter_names, k adapters, fwd + grad w.r.t. inputs_embeds"


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


def _peft_model(model_dir: Path, sizes: Sizes, autocast_adapter_dtype: bool = True) -> tuple[nn.Module, list[str]]:
    """The frozen model under PEFT with k adapters of small random LoRA B, adapter c0 active, in eval
    mode; (the model, the adapter names). PEFT's default (``autocast_adapter_dtype``) keeps the
    adapters of a bf16 model in float32 and runs their matmuls in float32."""
    config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
                        target_modules=list(LORA.target_modules), bias="none")
    names = [f"c{c}" for c in range(sizes.k)]
    model = get_peft_model(load_frozen_model(model_dir, sizes), config, adapter_name=names[0],
                           autocast_adapter_dtype=autocast_adapter_dtype)
    for name in names[1:]:
        model.add_adapter(name, config, autocast_adapter_dtype=autocast_adapter_dtype)
    model.set_adapter(names[0])
    model.eval()  # PEFT refuses adapter_names in training mode
    lora = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    perturb_lora_b(lora)
    for p in lora.values():  # after set_adapter, which switches requires_grad on for its adapter
        p.requires_grad_(False)
    return model, names


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
        model = load_frozen_model(model_dir, sizes)
        lora = MultiLoRA(model, sizes.k, LORA, seed=0)
        perturb_lora_b(lora.named_parameters(), std=0.02)
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
        free(sizes)
        stock_model = load_stock_model(model_dir, sizes)
        stock, again = (anchor_pass(stock_model, batch, PAD_ID, input_grads=True) for _ in range(2))
        gaps = {name: max(float((one.logp - other.logp).abs().max()),
                          float((one.input_grads - other.input_grads).abs().max()))
                for name, one, other in (("lean_vs_stock", lean, stock), ("stock_vs_stock", stock, again))}
        del lean, stock, again, stock_model
        free(sizes)
        peft_model = PeftModel.from_pretrained(load_frozen_model(model_dir, sizes), str(Path(tmp) / names[0]),
                                               adapter_name=names[0]).eval()
        for name in names[1:]:
            peft_model.load_adapter(str(Path(tmp) / name), adapter_name=name)
        theirs = torch.zeros_like(ours)
        for c in route.unique().tolist():
            rows = (route == c).nonzero().flatten()
            peft_model.set_adapter(names[c])
            theirs[rows] = logp(peft_model, [batch[i] for i in rows.tolist()])
        del peft_model
        free(sizes)
        reference_model = load_model(model_dir, dtype=wide, device=sizes.device)
        reference_lora = MultiLoRA(reference_model, sizes.k, LORA, seed=0)
        for c, name in enumerate(names):
            reference_lora.load_peft(c, Path(tmp) / name)
        base = logp(reference_model)
        targets_wide = target_terms(reference_model)
        with reference_lora.route(route):
            reference = logp(reference_model)
        del reference_model, reference_lora
        free(sizes)
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
    synchronisation check (`waits`; an empty list when it never waits, backward included). None on
    the CPU, which runs each once unchecked (tests/test_estimate.py checks the same passes, and
    tests/test_lora_policy.py the M-step, on the meta device)."""
    model, lora = load_lora_model(model_dir, sizes)
    params = list(lora.named_parameters().values())

    def e_pass(shared: bool) -> None:
        with lora.requires_grad(False):
            mixed_pass(model, lora, batch, sizes, shared_prompts=shared)

    found = _waits_of({"E-step pass, rows whole": lambda: e_pass(False),
                       "E-step pass, prompts shared": lambda: e_pass(True),
                       "M-step pass, rows whole": lambda: mixed_pass(model, lora, batch, sizes, params),
                       "M-step pass, prompts shared": lambda: mixed_pass(model, lora, batch, sizes, params, True)},
                      sizes)
    del model, lora
    free(sizes)
    inputs = synthetic_inputs(sizes, 4, 2, *model_vocab(model_dir))
    weights = torch.full((2, sizes.k), 1.0 / sizes.k, dtype=torch.float64)
    scorer = LoRAPolicyScorer(model_dir, sizes.k, beta=BETA, anchors=2, lora=LORA, lr=1e-4, batch_size=2,
                              score_batch_size=sizes.score_batch_size, seed=0, dtype=sizes.dtype, device=sizes.device)
    scorer.score(inputs, 0)  # the estimates the M-step holds
    found.update(_waits_of({"M-step (fit), a = 2": lambda: scorer.fit(inputs, inputs.rankings(), weights, 1)}, sizes))
    del scorer
    free(sizes)
    return found if sizes.cuda else None


def _waits_of(runs: dict[str, Callable[[], Any]], sizes: Sizes) -> dict[str, list[str]]:
    """`waits` of each run after one run unchecked (a first run may initialise libraries, cuBLAS
    handles, which waits once); on the CPU each runs once, and nothing is checked."""
    found = {}
    for name, run in runs.items():
        run()
        if not sizes.cuda:
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            found[name] = waits(run)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def waits(run: Callable[[], Any], where: tuple[str, ...] = ("moplex_core", "transformers")) -> list[str]:
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


def anchor_pass_throughput(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    """A row per pass (PLAIN, PLAIN_PADDED, PLAIN_PADDED_MASKED, PLAIN_STOCK, MULTI_E, MULTI_M, PEFT_ONE,
    PEFT_MIXED, and PEFT_ONE_MODEL_DTYPE in bf16) and B, one model on the device at a time, and the attention
    implementation the model loaded with."""
    batches = random_batches(model_dir, sizes)
    attention, rows = _plain_rows(model_dir, sizes, batches)
    free(sizes)
    rows += _multi_lora_rows(model_dir, sizes, batches)
    free(sizes)
    rows += _peft_rows(model_dir, sizes, batches)
    free(sizes)
    for row in rows:
        plain = next(r for r in rows if r["pass"] == PLAIN and r["batch"] == row["batch"])
        both = not (row["oom"] or plain["oom"])
        row["ratio_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"] if both else None
    return {"attention": attention, "rows": rows}


CACHE_ROWS_PER_PASS = 32  # cache.score_batch_size's default


def cache_pass_costs(model_dir: Path, sizes: Sizes, examples: int) -> dict[str, Any]:
    """The cache stage's terms (`reference_terms_batch`, one call per example as `cache_rows` makes
    them when m' responses fill most of a 32-row pass) of ``examples`` synthetic examples at the
    size's largest m' up to 26, with the reference contractions (forward + input-gradient passes)
    and without (forwards only), each with every example's prompt shared (one prompt pass per pass)
    and per row: seconds per example (median of the size's repeats after its warm-ups), peak memory,
    the largest log pi_ref difference between the two prompt modes, nats, and the first example's
    call once under torch.profiler (``profile``: the device's busy time, kernels and aten ops, no trace
    kept), which says where a shared prompt's pass spends what its half of the tokens should save."""
    m_prime = max(m for m in sizes.m_primes if m <= 26)
    vocab_size, eos_id = model_vocab(model_dir)
    inputs = synthetic_inputs(sizes, m_prime, examples, vocab_size, eos_id).sequences
    model = load_frozen_model(model_dir, sizes)
    rows = []
    for contractions in (True, False):
        logp = {}
        for shared in (True, False):
            last: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # the terms of the last timed run

            def call(sequences: tuple[TokenizedResponse, ...]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
                return reference_terms_batch(model, [sequences], PAD_ID, rows_per_pass=CACHE_ROWS_PER_PASS,
                                             contractions=contractions, share_prompts=shared)

            def run() -> None:
                last[:] = [term for sequences in inputs for term in call(sequences)]
            row = {"m_prime": m_prime, "contractions": contractions, "prompts": "shared" if shared else "per row",
                   "oom": False, "s_per_example": None, "peak_gib": None, "profile": None}
            try:
                seconds = median_seconds(run, sizes)
                row.update(s_per_example=seconds / examples, peak_gib=peak_gib(sizes))
                logp[shared] = torch.cat([ref_logp for ref_logp, _ in last])
                row["profile"] = _device_profile(lambda: call(inputs[0]), sizes)
            except RuntimeError as error:
                if not out_of_memory(error):
                    raise
                row["oom"] = True
            free(sizes)
            rows.append(row)
        both = len(logp) == 2
        for row in rows[-2:]:
            row["logp_gap"] = (logp[True] - logp[False]).abs().max().item() if both else None
    for row in rows:
        shared = next(r for r in rows if r["contractions"] == row["contractions"] and r["prompts"] == "shared")
        both = not (row["oom"] or shared["oom"])
        row["speedup_vs_shared"] = shared["s_per_example"] / row["s_per_example"] if both else None
    return {"rows_per_pass": CACHE_ROWS_PER_PASS, "rows": rows}


def _plain_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> tuple[str, list[dict[str, Any]]]:
    """(the attention implementation the model loaded with, its rows): PLAIN; PLAIN_PADDED against
    PLAIN_PADDED_MASKED, where the pipeline's padded passes differ (tokens/s counts the padded width);
    PLAIN_STOCK, what the lean RMSNorm and MLP cost or gain in time (on a GPU the lean norm is torch's
    fused rms_norm: its gain; on the CPU transformers' ops)."""
    model = load_frozen_model(model_dir, sizes)
    rows = measure(PLAIN, lambda batch: input_grad_pass(model, batch), batches, sizes)
    padded = _padded_batches(batches, sizes)
    rows += measure(PLAIN_PADDED, lambda batch: input_grad_pass(model, batch), padded, sizes)
    with _padding_mask():
        rows += measure(PLAIN_PADDED_MASKED, lambda batch: input_grad_pass(model, batch), padded, sizes)
    del model
    free(sizes)
    stock = load_stock_model(model_dir, sizes)
    rows += measure(PLAIN_STOCK, lambda batch: input_grad_pass(stock, batch), batches, sizes)
    return stock.config._attn_implementation, rows


def _multi_lora_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> list[dict[str, Any]]:
    model, lora = load_lora_model(model_dir, sizes)
    params = list(lora.named_parameters().values())
    with lora.requires_grad(False):
        rows = measure(MULTI_E, lambda batch: mixed_pass(model, lora, batch, sizes), batches, sizes)
    return rows + measure(MULTI_M, lambda batch: mixed_pass(model, lora, batch, sizes, params), batches, sizes)


def _peft_rows(model_dir: Path, sizes: Sizes, batches: dict[int, list[TokenizedResponse]]) -> list[dict[str, Any]]:
    model, names = _peft_model(model_dir, sizes)

    def mixed(batch: list[TokenizedResponse]) -> None:
        # PeftModel.forward applies `adapter_names` through pre-forward hooks that this private
        # context manager (peft 0.21) registers on every LoRA layer; anchor_pass calls the decoder
        # and lm_head directly, not PeftModel.forward, so it enters the context itself.
        adapter_names = [names[b % sizes.k] for b in range(len(batch))]  # row b -> adapter b mod k
        with model._enable_peft_forward_hooks(adapter_names=adapter_names):
            input_grad_pass(model, batch)

    rows = measure(PEFT_ONE, lambda batch: input_grad_pass(model, batch), batches, sizes)
    rows += measure(PEFT_MIXED, mixed, batches, sizes)
    del model
    free(sizes)
    if sizes.dtype in (torch.float32, torch.float64):  # the default already keeps the model's dtype
        return rows
    model, _ = _peft_model(model_dir, sizes, autocast_adapter_dtype=False)
    return rows + measure(PEFT_ONE_MODEL_DTYPE, lambda batch: input_grad_pass(model, batch), batches, sizes)


def anchor_pass_profile(model_dir: Path, sizes: Sizes, out: Path) -> dict[str, Any]:
    """The plain pass, the mixed multi-LoRA E-step pass, the same through the prompt pass
    (``multi_lora_prompt_pass``), the mixed M-step pass (``multi_lora_m``) and an M-step pass of two
    pairs through the prompt pass, as the scorer runs one with shared prompts (``multi_lora_m_prompt_pass``) over B =
    min(batch_rows) rows, each timed as in the throughput section and then run once under torch.profiler: per aten
    op, its self time on the device (the kernels it launched; on the CPU, its CPU time) and its
    calls; the kernels launched and the device's busy time. Wall time well above busy time is time the
    card waits on the host (kernel launches, Python); busy time is the kernels themselves. Writes each
    pass's trace to OUT/profile_<name>.json.gz (chrome://tracing, Perfetto). Then, without traces
    (``m_step_pairs``), the M-step pass of one pair as the EM section runs it with one pair a step (one
    adapter, the prompt per row) at the largest a's rows and at the first target m' (capped by the
    size's m'): on the card a = 6 and m' = 26 rows, one pass of MoPLEx's M-step and one of full
    computation's, the same decoder matmuls over other row counts (the log-probs take one vocabulary
    chunk per ``chunk_size`` response positions), so that their busy / wall says whether the small one
    waits on its host."""
    b = min(sizes.batch_rows)
    batch = random_batches(model_dir, sizes)[b]
    model = load_frozen_model(model_dir, sizes)
    plain = _profile(lambda: input_grad_pass(model, batch), sizes, out / "profile_plain.json.gz")
    del model
    free(sizes)
    model, lora = load_lora_model(model_dir, sizes)
    with lora.requires_grad(False):
        multi = _profile(lambda: mixed_pass(model, lora, batch, sizes), sizes,
                         out / "profile_multi_lora.json.gz")
        prompt_pass = _profile(lambda: mixed_pass(model, lora, batch, sizes, shared_prompts=True), sizes,
                               out / "profile_multi_lora_prompt_pass.json.gz")
    params = list(lora.named_parameters().values())
    m_step = _profile(lambda: mixed_pass(model, lora, batch, sizes, params), sizes, out / "profile_multi_lora_m.json.gz")
    pairs, pair_of = _two_pairs(batch)
    m_prompt_pass = _profile(
        lambda: weight_grad_pass(model, pairs, params, groups=pair_of, route=lambda rows: lora.route(
            [pair_of[r] for r in rows])), sizes, out / "profile_multi_lora_m_prompt_pass.json.gz")
    pair_rows = (max(sizes.anchors), min(TARGET_M_PRIMES[0], max(sizes.m_primes)))  # a = 6, m' = 26 on the card
    pair_batches = random_batches(model_dir, replace(sizes, batch_rows=pair_rows))
    m_step_pairs = [{"rows": rows, **_profile(lambda rows=rows: weight_grad_pass(
        model, pair_batches[rows], params, route=lambda sub: lora.route([0] * len(sub))), sizes)} for rows in pair_rows]
    extra_gb = _lora_extra_bytes(lora, b * sizes.row_tokens, sizes.dtype.itemsize) / 1e9
    del model, lora
    free(sizes)
    return {"batch": b, "plain": plain, "multi_lora": multi, "multi_lora_prompt_pass": prompt_pass,
            "multi_lora_m": m_step, "multi_lora_m_prompt_pass": m_prompt_pass, "m_step_pairs": m_step_pairs,
            "lora_extra_gb": extra_gb}


def _two_pairs(batch: list[TokenizedResponse]) -> tuple[list[TokenizedResponse], list[int]]:
    """``batch``'s rows as two (example, cluster) pairs of an M-step pass: the first half continues the
    first row's prompt, the second half the middle row's, each half one run of rows; and each row's
    pair (0 or 1: its group and its adapter)."""
    half = len(batch) // 2
    pair_of = [0 if b < half else 1 for b in range(len(batch))]
    heads = [batch[0], batch[half]]
    rows = [TokenizedResponse(heads[g].input_ids[: heads[g].response_start] + row.input_ids[row.response_start :],
                              response_start=heads[g].response_start) for row, g in zip(batch, pair_of, strict=True)]
    return rows, pair_of


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


def _profile(run: Callable[[], Any], sizes: Sizes, trace: Path | None = None) -> dict[str, Any]:
    """``run`` timed (median of the size's repeats after its warm-ups), then once under the profiler
    (its trace to ``trace``; None keeps none)."""
    return {"wall_ms": 1000 * median_seconds(run, sizes), **_device_profile(run, sizes, trace)}


def _device_profile(run: Callable[[], Any], sizes: Sizes, trace: Path | None = None) -> dict[str, Any]:
    """One ``run`` under torch.profiler: the device's busy time and the kernels launched (on the CPU,
    the aten ops' CPU time and None), and per aten op its self time and calls, longest first; the
    trace written to ``trace`` (gzipped; None keeps none)."""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if sizes.cuda else [])]
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        sync(sizes)
    if trace is not None:
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
            where = f" of {trace.name}" if trace is not None else ""
            print(f"profile{where}: the profiler recorded no CUDA kernel (CUPTI missing?), so its busy time and kernel "
                  "count read 0 and say nothing", file=sys.stderr, flush=True)
    else:
        ops = {e.key: (e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")}
        busy_us, launched = sum(us for us, _ in ops.values()), None
    ranked = sorted(ops.items(), key=lambda item: (-item[1][0], item[0]))
    return {"busy_ms": busy_us / 1000, "kernels": launched,
            "ops": {key: {"ms": us / 1000, "calls": calls} for key, (us, calls) in ranked}}
