"""The tiny offline model's settings (built by the pipeline when a preset's model is TINY_MODEL)."""

from __future__ import annotations

from pydantic import Field, model_validator

from moplex_core.config.base import StageConfig


class TinyModelConfig(StageConfig):
    """moplex_core.lm.tiny.build_tiny_model settings. The model is pre-trained on every (prompt,
    response) pair of the train split, at most ``max_pairs`` of them (the first, in table order)."""

    hidden_size: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    vocab_size: int = Field(320, ge=261)
    """256 byte symbols + 4 special tokens + at least one merge."""
    max_positions: int = Field(1024, ge=64)
    pretrain_steps: int = Field(150, ge=0)
    max_pairs: int = Field(4000, ge=1)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _heads_fit(self) -> TinyModelConfig:
        head, rest = divmod(self.hidden_size, self.heads)
        if rest or self.heads % self.kv_heads or head % 2:
            raise ValueError(f"tiny_model.hidden_size {self.hidden_size} / tiny_model.heads {self.heads} must be a "
                             f"whole, even head size (rotary embeddings) and heads a multiple of kv_heads {self.kv_heads}")
        return self
