"""Dataset adapters: each turns a source into the canonical `rankings` rows (DESIGN.md 3, 6)."""
