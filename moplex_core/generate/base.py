"""What a response generator is: requests in, sampled texts out.

A `SampleRequest` asks for ``n`` texts for one key (a prompt_id; an example_id for ``borrow``) under
one seed. The augment stage derives that seed from (its seed, the key, the attempt) with
`request_seed`, and a sampling backend seeds sample ``j`` of a request with `sample_seed`, so a
sample's seed depends on neither the other requests in its batch nor the shard it lands in (the hf
backend's; its texts can still move by float rounding with another batch size, see
moplex_core.generate.hf; vLLM seeds a request's samples seed, seed + 1, ..., and its kernels are not
batch-invariant by default).
Deduplication and resampling are the augment stage's (moplex_core.augment); `normalise` is the equality it uses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from moplex_core.hashing import seed_from

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SEED_BITS = 63  # non-negative int64: what torch.Generator.manual_seed and vLLM accept everywhere
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class SampleRequest:
    key: str
    prompt: str
    prompt_messages: str | None
    """The rankings column: chat messages as JSON, used instead of ``prompt`` when present."""
    n: int
    seed: int
    avoid: frozenset[str] = frozenset()
    """Normalised texts already held (originals, accepted samples). A backend that chooses among
    known texts (borrow) skips them; a sampling backend cannot, and the augment stage filters."""


@dataclass(frozen=True)
class Sample:
    text: str
    tokens: int
    """Generated tokens, EOS included when it was produced; 0 for a borrowed text."""
    finished: bool = True
    """The model ended the text itself (EOS, a stop); False when ``max_new_tokens`` cut it short."""


class Generator(Protocol):
    backend: str
    model: str | None

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        """For each request, in order, at most ``n`` samples; fewer means the backend has nothing
        more to give for that request (asking again would not help)."""
        ...

    def close(self, failed: bool = False) -> None:
        """Release what the generator holds (a worker process, GPU memory). ``failed``: the stage is
        ending on an error or an interrupt, so release at once rather than finish work in hand."""
        ...


def request_seed(seed: int, key: str, attempt: int) -> int:
    return _hash_int(f"request\x1f{seed}\x1f{key}\x1f{attempt}")


def sample_seed(request_seed: int, index: int) -> int:
    return _hash_int(f"sample\x1f{request_seed}\x1f{index}")


def normalise(text: str) -> str:
    """The form two texts are compared in: trimmed, runs of whitespace as one space, case-folded."""
    return _SPACES.sub(" ", text).strip().casefold()


def request_prompt_ids(tokenizer: PreTrainedTokenizerBase, request: SampleRequest, *, use_chat_template: bool,
                       max_prompt_tokens: int | None) -> list[int]:
    """`encode_prompt` of a request's chat messages if any, else its text; a prompt that cannot be
    rendered is a ValueError naming the request's key (the prompt_id of its rankings)."""
    from moplex_core.lm.tokenize import encode_prompt  # transformers: only backends that render prompts need it

    prompt = json.loads(request.prompt_messages) if request.prompt_messages else request.prompt
    try:
        return encode_prompt(tokenizer, prompt, use_chat_template=use_chat_template, max_prompt_tokens=max_prompt_tokens)
    except ValueError as err:
        raise ValueError(f"prompt_id {request.key!r}: {err}") from err


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list[int] | None) -> list[int]:
    """The tokens a sample ends at, for every model backend alike: the tokenizer's EOS (the one the
    cache closes a response with) and the generation config's ``eos_token_id`` (Qwen3: <|im_end|>
    and <|endoftext|>), which vLLM merges into every request's stop tokens."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    ids |= set(generation_eos) if isinstance(generation_eos, list) else set() if generation_eos is None else {generation_eos}
    return sorted(ids)


def _hash_int(text: str) -> int:
    return seed_from(text, "big") >> (64 - _SEED_BITS)
