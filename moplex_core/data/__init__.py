"""Dataset adapters, each turning a source into the canonical `rankings` rows (DESIGN.md 3, 6):
`ultrafeedback`, `persona`, `helpsteer2`, `prism`, `generic` (a file already in the canonical
fields) and `synthetic` (generated); `sources` reads local files and the hub, `splits` assigns the
train/validation/test split by prompt."""
