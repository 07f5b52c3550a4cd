"""Chaos checks of the pipeline (issue 8): runs killed at seeded points must resume to the artifacts of
an uninterrupted run (`chaos.kills`), and bad inputs must be rejected with an actionable error
(`chaos.bad_inputs`). ``python -m chaos`` (``make chaos``) runs both and prints the counts."""
