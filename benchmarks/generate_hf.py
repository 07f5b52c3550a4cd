"""Throughput of the hf generation backend (moplex_core.generate.hf), side by side with plain sampling.

    python benchmarks/generate_hf.py [--prompts 32] [--n 3] [--max-new-tokens 64] [--batch-sizes 1 8 32]
    python benchmarks/generate_hf.py --qwen3-0.6b --device cuda --batch-sizes 8 32 128

By default the model is the tiny offline Qwen3 of the tests (moplex_core.lm.tiny, pre-trained 40
steps) on the CPU. ``--qwen3-0.6b`` builds a model of Qwen3-0.6B's shape from its config with random
weights instead (28 layers, hidden 1024, 16 query / 8 key-value heads of 128, vocabulary 151,936;
no download), with the tiny tokenizer for the prompts: random weights rarely emit EOS, so nearly
every sample runs to ``--max-new-tokens``. Only torch and transformers are needed.

Prints one markdown table: per batch size, prompts/s and generated tokens/s of `HFGenerator.sample`
(seeded per-row Gumbel-max sampling), and tokens/s of plain `generate(do_sample=True)` on the same
batches (one global RNG: the same draw distribution without per-sample seeds), for the overhead.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from moplex_core.generate.base import SampleRequest, request_seed
from moplex_core.generate.hf import HFGenerator
from moplex_core.lm.loading import load_model, load_tokenizer, resolve_dtype
from moplex_core.lm.tiny import tiny_pairs
from moplex_core.lm.tokenize import encode_prompt

from bench_models import add_model_options, bench_model


def plain_sampling_tokens_per_s(model_dir: Path, device: torch.device, dtype: str, prompts: list[str], n: int,
                                batch_size: int, max_new_tokens: int, temperature: float) -> float:
    """transformers' own sampling (global RNG) over the same rows, for comparison."""
    model = load_model(model_dir, dtype=resolve_dtype(dtype, device), device=device)
    tokenizer = load_tokenizer(model_dir)
    ids = [encode_prompt(tokenizer, p) for p in prompts for _ in range(n)]
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(ids), batch_size):
        batch = ids[i : i + batch_size]
        length = max(map(len, batch))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (length - len(b)) + b for b in batch], device=device)
        mask = torch.tensor([[0] * (length - len(b)) + [1] * len(b) for b in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        new = out[:, length:]
        tokens += int((new != tokenizer.pad_token_id).sum())
    _sync(device)
    return tokens / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=3, help="samples per prompt (m' - m)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    add_model_options(parser)
    args = parser.parse_args()
    prompts = [pair[0] + f" (item {i})" for i, pair in enumerate(tiny_pairs(args.prompts))]
    requests = [SampleRequest(f"p{i}", p, None, args.n, request_seed(0, f"p{i}", 0)) for i, p in enumerate(prompts)]

    with tempfile.TemporaryDirectory() as tmp:
        device = torch.device(args.device)
        model_dir, name = bench_model(args, Path(tmp), torch.bfloat16 if device.type == "cuda" else torch.float32)
        rows = []
        for batch_size in args.batch_sizes:
            generator = HFGenerator(str(model_dir), temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                    batch_size=batch_size, dtype=args.dtype, device=args.device)
            generator.sample(requests[:1])  # warm-up: kernels, allocator
            _sync(generator.device)
            start = time.perf_counter()
            samples = generator.sample(requests)
            _sync(generator.device)
            seconds = time.perf_counter() - start
            tokens = sum(s.tokens for row in samples for s in row)
            generator.close()
            plain = plain_sampling_tokens_per_s(model_dir, generator.device, args.dtype, prompts, args.n, batch_size,
                                                args.max_new_tokens, args.temperature)
            rows.append((batch_size, tokens, seconds, len(prompts) / seconds, tokens / seconds, plain))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"hf backend, {name}; {device_name}, {torch.get_num_threads()} CPU thread(s); torch {torch.__version__}; "
          f"{len(prompts)} prompts x {args.n} samples, max_new_tokens {args.max_new_tokens}, "
          f"temperature {args.temperature}\n")
    print("| batch (sequences) | tokens | seconds | prompts/s | tokens/s | plain do_sample tokens/s |")
    print("|---|---|---|---|---|---|")
    for batch_size, tokens, seconds, prompts_per_s, tokens_per_s, plain in rows:
        print(f"| {batch_size} | {tokens:,} | {seconds:.2f} | {prompts_per_s:.1f} | {tokens_per_s:,.0f} | {plain:,.0f} |")


if __name__ == "__main__":
    main()
