"""Chaos checks of the pipeline (issue 8): runs killed at seeded points must resume to the artifacts of
an uninterrupted run (`chaos.kills`), and bad inputs must be rejected with an actionable error
(`chaos.bad_inputs`). ``python -m chaos`` (``make chaos``) runs both and prints the counts.
`chaos.mutants` (``make mutants``) puts the bugs of `chaos.mutant_catalogue` into a copy of the code,
one at a time, and checks that the tests catch each."""

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns aligned with two spaces, a dashed rule under the header."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)
