"""The augment stage's settings: generated responses (paper section 4.1)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moplex_core.config.base import Device, StageConfig, local_model_absolute

GeneratorBackend = Literal["hf", "vllm", "borrow"]
_SAMPLING_FIELDS = ("temperature", "top_p", "max_new_tokens", "dtype", "use_chat_template", "max_prompt_tokens")


VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's SamplingParams refuse higher temperatures (vllm-project/vllm PR 44965, in 0.33.0)."""


class AugmentConfig(StageConfig):
    """How the augment stage adds m' - m generated responses to every ranking (paper section 4.1).

    ``backend``: ``hf`` samples from ``model`` with transformers in this process, ``vllm`` with vLLM
    in a subprocess under ``vllm_python`` (an interpreter of an environment where vllm and pyarrow
    are installed; vLLM never shares Prefect's), ``borrow`` takes other rankings' responses to the
    same prompt (PERSONA: other profiles' revisions of the same instruction) and needs no model.
    Model backends generate once per prompt; every ranking of that prompt gets the same texts.

    A generated text equal to an original or to another generated text of the same prompt (after
    trimming, collapsing whitespace and case-folding) is dropped, and the missing ones are drawn
    again, ``max_attempts`` rounds in all. Prompts still short are written to ``shortfall.parquet``;
    ``on_shortfall="fail"`` stops the stage there, ``"keep_fewer"`` keeps those rankings with fewer
    generated responses.

    Sampling is seeded per prompt and attempt, so the seeds do not depend on sharding or batching,
    and with ``hf`` neither do the texts, up to float rounding: another ``batch_size`` pads a prompt
    to another length, which can flip a near-tie (moplex_core.generate.hf). vLLM's texts can move
    more: its kernels are not batch-invariant by default (its reproducibility docs), so a resumed
    shard may sample other texts than a clean run; the seeds still fix the draws, and the version
    is the same. What is left out of the version
    (`identity`): ``batch_size``, ``device``, ``vllm_python``, ``vllm_gpu_memory_utilization`` and
    ``vllm_timeout_s`` (where and how fast, not what; ``vllm_max_model_len`` is in, as it can cut a
    generation short), ``on_shortfall`` (what to accept, not what is generated), and
    ``model`` itself: a local model directory's content is an input of the version (moving it keeps
    the version, retraining it does not).
    """

    backend: GeneratorBackend = "hf"
    model: str | None = None
    """A local model directory (save_pretrained output; made absolute) or a hub name; none for ``borrow``."""

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, v: str | None) -> str | None:
        return local_model_absolute(v)
    n_generated: int = Field(3, ge=1)
    """m' - m: responses added to every ranking."""
    temperature: float = Field(2.0, gt=0.0)
    """The paper's best (appendix, temperature ablation: 0.5 / 1 / 2 / 4); at most 2 with vLLM."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(512, ge=1)
    seed: int = Field(0, ge=0)
    max_attempts: int = Field(4, ge=1)
    on_shortfall: Literal["fail", "keep_fewer"] = "fail"
    shard_prompts: int = Field(256, ge=1)
    """Prompts per part-*.parquet shard: the unit of resumption after a kill."""
    batch_size: int = Field(16, ge=1)
    """Sequences per transformers `generate` call (hf); vLLM schedules its own batches."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations; ``auto``: with hf bfloat16 on a GPU and float32 on the CPU (the version
    holds the dtype it resolves to, `identity_on_this_machine`), with vllm the model's own dtype."""
    device: Device = "auto"
    """hf only: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``, ``cuda:1``, ..."""
    use_chat_template: bool = True
    max_prompt_tokens: int | None = Field(None, ge=1)
    vllm_python: str | None = None
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    vllm_max_model_len: int | None = Field(None, ge=1)
    """vLLM's max_model_len: the positions its KV cache is sized for (None: the model's context, which for
    a long-context model may not fit the card's memory). A prompt must be shorter (it is refused before
    any shard otherwise), and vLLM ends a generation that reaches it, so it is in the version."""
    vllm_timeout_s: float | None = Field(None, gt=0.0)
    """How long the vLLM worker may take to load the model, and then to answer each call (one round of
    one shard's prompts: a shard makes up to ``max_attempts`` calls), before it is ended and the stage
    fails naming its log (an engine stuck in its start-up holds the GPU otherwise). The worker sends
    nothing during a call, so set it above the longest healthy call: one that always takes longer
    fails on every resume. None waits as long as it runs."""

    @model_validator(mode="after")
    def _backend_is_complete(self) -> AugmentConfig:
        if self.backend in ("hf", "vllm") and not self.model:
            raise ValueError(f"backend {self.backend!r} samples from a model; set model to a local model "
                             "directory or a hub name")
        if self.backend == "borrow" and self.model is not None:
            raise ValueError("backend 'borrow' takes other rankings' responses and uses no model; unset model")
        if self.backend == "vllm" and not self.vllm_python:
            raise ValueError("backend 'vllm' runs vLLM under another interpreter (it cannot share Prefect's "
                             "environment); set vllm_python to that environment's python, e.g. "
                             "/opt/vllm-env/bin/python")
        if self.backend == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(f"temperature = {self.temperature}: vLLM's SamplingParams refuse a temperature above "
                             f"{VLLM_MAX_TEMPERATURE:g} (since 2026-06, after the model has loaded); use backend "
                             "'hf' for a higher temperature (the paper's is 2.0, which vLLM takes)")
        return self

    def identity(self) -> dict[str, Any]:
        excluded = {"model", "batch_size", "device", "vllm_python", "vllm_gpu_memory_utilization", "vllm_timeout_s",
                    "on_shortfall"}
        if self.vllm_max_model_len is None or self.backend != "vllm":  # as every version before the setting
            excluded.add("vllm_max_model_len")
        if self.backend == "borrow":
            excluded |= set(_SAMPLING_FIELDS)
        return self.model_dump(mode="json", exclude=excluded)
