"""The cache stage's settings: tokenised responses and their reference terms (DESIGN 3, 5.4)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from moplex_core.config.base import Device, SharePrompts, StageConfig, local_model_absolute, prompts_shared

# No float16 for the cache and train: their input and LoRA gradients would need loss scaling, which
# this code does not do ("auto" on a GPU without bfloat16 is float32).
ModelDtype = Literal["auto", "float32", "bfloat16", "float64"]


class CacheConfig(StageConfig):
    """How the cache stage tokenises every response and computes its reference terms (DESIGN 3, 5.4).

    For every response (originals, then generated ones): token ids (prompt + response + EOS), the
    response start, ``ref_logp`` = log pi_ref(y|x) in float64, and the m' x m' reference
    contraction s_ref. ``model`` is pi_ref, the base model the train stage puts adapters on.

    Left out of the version (`identity`): ``model`` (its directory's content is an input of the
    version instead), ``score_batch_size``, ``device``, ``chunk_size``, ``share_prompts`` and
    ``gradient_checkpointing`` (how fast,
    not what: other pass and chunk shapes round differently, moving the floats in their last digits,
    and a resume under other values says so), and ``contractions`` while it is true (versions built
    before it existed stay valid).
    """

    model: str
    """A local model directory (save_pretrained output; made absolute) or a cached hub name."""

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, v: str) -> str:
        return local_model_absolute(v)
    use_chat_template: bool = True
    max_prompt_tokens: int | None = Field(512, ge=1)
    """Longer prompts lose their start."""
    max_response_tokens: int | None = Field(512, ge=1)
    """Longer responses lose their end (and their EOS), never their start."""
    score_batch_size: int = Field(32, ge=1)
    """Responses per forward + input-gradient pass, as the train and evaluate stages count their
    passes (the pass's memory grows with it, not with m'). An example's responses share a pass, and
    its prompt's, where they fit; an example with more responses than this is split over passes."""
    shard_rows: int = Field(1000, ge=1)
    """Examples per part-*.parquet shard: the unit of resumption after a kill."""
    dtype: ModelDtype = "auto"
    """``auto`` is bfloat16 on a GPU and float32 on the CPU (the version holds the dtype it resolves to,
    `identity_on_this_machine`); log-probs accumulate in float32/64."""
    device: Device = "auto"
    chunk_size: int = Field(1024, ge=1)
    """Response positions projected to the vocabulary at a time."""
    contractions: bool = True
    """False: forward passes only, no s_ref (``ref_contraction`` null), for a cache that is only ever
    scored exactly: `moplex assign`'s, or a train stage with ``train.anchors = null``. Train refuses
    anchors on it."""

    share_prompts: SharePrompts = "auto"
    """Run an example's prompt once per pass for all its responses there (pi_ref has no dropout: the
    same terms up to float rounding, for fewer tokens). ``auto`` (the default): on the CPU, and on a
    GPU with ``contractions``: on an H200 (2026-11-26, docs/gpu-efficiency.md) an example's 26
    responses took 0.290 s and 20.6 GiB with its prompt shared, 0.319 s and 27.9 GiB with the prompt
    per row; forward only (``contractions = false``) 0.127 s and 4.4 GiB shared, 0.126 s and 2.4 GiB
    per row, so the prompt per row there, as `TrainConfig.share_prompts` on a GPU. The manifest
    records what it resolved to (``resolved_share_prompts``)."""

    gradient_checkpointing: bool = False
    """Checkpoint every decoder layer of the input-gradient passes (moplex_core.lm.checkpointing, as
    `TrainConfig.gradient_checkpointing`): about one layer's activations a pass instead of every
    layer's, for one forward more and about twice the host time; the same terms, bit for bit on the CPU."""

    def shares_prompts(self, device: str) -> bool:
        """Whether this cache's passes on ``device`` (resolved: cpu, cuda:0, ...) share prompts:
        ``share_prompts``, with ``auto`` resolved as its docstring says."""
        return prompts_shared(self.share_prompts, device, elsewhere=self.contractions)

    def identity(self) -> dict[str, Any]:
        exclude = {"model", "score_batch_size", "device", "chunk_size", "share_prompts", "gradient_checkpointing"}
        if self.contractions:
            exclude.add("contractions")
        return self.model_dump(mode="json", exclude=exclude)


def no_contractions_message(anchors: int | None, where: str) -> str:
    """Why a = ``anchors`` estimated scores cannot use ``where`` (a cache built with
    ``cache.contractions = false``), and what to do: one wording for every place that refuses it."""
    return (f"train.anchors a = {anchors} estimates scores from the reference contractions s_ref, and {where} has "
            "none (cache.contractions = false: forward passes only). Set train.anchors to null to compute every "
            "response exactly, or build the cache with cache.contractions = true.")
