"""Scorer implementations for moplex_core.em: `item`, `linear` (CPU, convex M-step) and, for the LM,
`lora_policy`."""
