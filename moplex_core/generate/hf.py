"""The ``hf`` backend: sampling with transformers `generate`, batched, reproducible per sample.

transformers samples every row of a batch from the one global RNG, so a text would depend on which
other prompts share its batch. Here each row carries its own `torch.Generator`, seeded by
`moplex_core.generate.base.sample_seed`, and sampling is done with the Gumbel-max trick: the
logits go through the temperature and top-p warpers, each row adds Gumbel noise drawn from its own
generator, and `generate` picks the argmax (greedy mode). argmax(l + G), G ~ Gumbel(0, 1) i.i.d.,
is an exact draw from softmax(l), so this is ordinary temperature / nucleus sampling; only the
source of randomness differs. A rerun on the same hardware, dtype and batch size gives the same
text. Another batch size pads a prompt on the left to another length, which moves its logits by
float rounding (about 1e-6 in float32 on the CPU; more in bfloat16 on a GPU), so a near-tie can go
the other way: rare in float32 (the tests' batch sizes 1 and 8 give the same texts), not excluded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from moplex_core.generate.base import Sample, SampleRequest, request_prompt_ids, sample_seed, stop_token_ids
from moplex_core.lm.checks import beyond_the_context, context_length
from moplex_core.lm.loading import load_model, load_tokenizer, resolve_device, resolve_dtype


class GumbelNoise(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to row b's scores from ``generators[b]`` (see the module docstring)."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.generators = list(generators)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        uniform = torch.stack([
            torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators
        ])  # [B, V] in [0, 1)
        tiny = torch.finfo(torch.float32).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp_min(tiny)))
        return scores.float() + gumbel  # -inf (masked by top-p) stays -inf


def sampling_processors(temperature: float, top_p: float, generators: Sequence[torch.Generator]) -> LogitsProcessorList:
    """The processors that turn `generate`'s greedy argmax into a seeded temperature / top-p draw."""
    processors: list[LogitsProcessor] = [TemperatureLogitsWarper(temperature)]
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    processors.append(GumbelNoise(generators))
    return LogitsProcessorList(processors)


def refuse_prompts_beyond_the_context(lengths: Sequence[tuple[str, int]], context: int | None,
                                      max_new_tokens: int) -> None:
    """Refuse (ValueError, naming how many and the first) prompts of these (key, prompt tokens as
    generated, after augment.max_prompt_tokens) pairs that ``max_new_tokens`` would carry past the
    model's ``context`` positions; `augment.check_prompts` asks it of every prompt before a shard."""
    if context is not None and max_new_tokens >= context:
        raise ValueError(f"augment.max_new_tokens = {max_new_tokens} leaves no position for a prompt in the "
                         f"{context} positions the model reads (its context): lower it below "
                         f"{context}, with room for the prompts")
    beyond = beyond_the_context([(key, n + max_new_tokens) for key, n in lengths], context)
    if beyond is not None:
        count, key, tokens = beyond
        raise ValueError(f"{count} prompt(s) with max_new_tokens = {max_new_tokens} would run past the "
                         f"{context} positions the model reads (its context; e.g. {key!r}: "
                         f"{tokens - max_new_tokens} prompt tokens); set augment.max_prompt_tokens (e.g. "
                         f"{max(1, context - max_new_tokens)}) to keep their last tokens, or lower "
                         "augment.max_new_tokens")


class HFGenerator:
    """Samples continuations of each request's prompt from a causal LM with transformers."""

    backend = "hf"

    def __init__(
        self,
        model: str,
        *,
        temperature: float = 2.0,
        top_p: float = 1.0,
        max_new_tokens: int = 512,
        batch_size: int = 16,
        dtype: str = "auto",
        device: str = "auto",
        use_chat_template: bool = True,
        max_prompt_tokens: int | None = None,
        progress: bool = True,
    ):
        if temperature <= 0 or not 0 < top_p <= 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"need temperature > 0, 0 < top_p <= 1, max_new_tokens >= 1 and batch_size >= 1; got "
                f"{temperature}, {top_p}, {max_new_tokens}, {batch_size}"
            )
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.batch_size = batch_size
        self.use_chat_template = use_chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.device = torch.device(resolve_device(device))
        self._model = load_model(model, dtype=resolve_dtype(dtype, self.device), device=self.device,
                                 progress=progress)
        self._tokenizer = load_tokenizer(model)
        self._eos_ids = set(stop_token_ids(self._tokenizer, self._model.generation_config.eos_token_id))
        if not self._eos_ids:
            raise ValueError(f"{model} names no end-of-sequence token (neither its generation_config's "
                             "eos_token_id nor its tokenizer's eos_token): a sample could never end, and the cache "
                             "could not close a response; set eos_token_id in the model's generation_config.json")
        # transformers fills what a generate() call leaves unset from the model's generation_config: a
        # bare one leaves nothing of the model's (Qwen3's do_sample=True, top_k=20, ..., or a
        # min_new_tokens, bad_words_ids, forced_eos_token_id that would act even in greedy mode), so the
        # draw is exactly the one in the module docstring.
        self._model.generation_config = GenerationConfig(eos_token_id=sorted(self._eos_ids),
                                                         pad_token_id=self._tokenizer.pad_token_id)
        self._generation_config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=sorted(self._eos_ids),
            pad_token_id=self._tokenizer.pad_token_id,
        )

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        prompt_ids = [
            request_prompt_ids(self._tokenizer, r, use_chat_template=self.use_chat_template,
                               max_prompt_tokens=self.max_prompt_tokens)
            for r in requests
        ]
        refuse_prompts_beyond_the_context([(r.key, len(ids)) for r, ids in zip(requests, prompt_ids, strict=True)],
                                          context_length(self._model.config), self.max_new_tokens)
        rows = [(r, j) for r, request in enumerate(requests) for j in range(request.n)]
        # Longest prompts first: similar lengths share a batch and waste less padding.
        rows.sort(key=lambda rj: (-len(prompt_ids[rj[0]]), rj))
        samples: list[list[Sample | None]] = [[None] * request.n for request in requests]
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            seeds = [sample_seed(requests[r].seed, j) for r, j in batch]
            for (r, j), sample in zip(batch, self._generate([prompt_ids[r] for r, _ in batch], seeds), strict=True):
                samples[r][j] = sample
        return [[s for s in row if s is not None] for row in samples]

    def close(self, failed: bool = False) -> None:
        self.__dict__.pop("_model", None)  # closing twice is harmless
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Sample]:
        # Left padding: every row's next token is predicted at the same (last) position.
        length = max(len(p) for p in prompts)
        pad = self._tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts], device=self.device)  # [B, L]
        attention_mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts],
                                      device=self.device)  # [B, L]
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        out = self._model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config,
            logits_processor=sampling_processors(self.temperature, self.top_p, generators),
        )
        samples = []
        for row in out[:, length:].tolist():  # [B, T] new tokens; finished rows are padded after EOS
            end = next((i for i, token in enumerate(row) if token in self._eos_ids), None)
            kept = row if end is None else row[:end]
            text = self._tokenizer.decode(kept, skip_special_tokens=True)
            samples.append(Sample(text, len(row) if end is None else end + 1, finished=end is not None))
        return samples
