"""Text from the data, shown as the text it is: in a terminal (no control or bidi characters) and
in a markdown table (no markup). Labels, example ids and texts are whatever a dataset holds."""

from __future__ import annotations

import re

_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

# A label's own backslash is escaped too: it would otherwise undo the escape of the character after it.
_AS_TEXT = str.maketrans({"\\": "\\\\", "|": "\\|", "[": "\\[", "]": "\\]", "<": "\\<", ">": "\\>",
                          "\n": " ", "\r": " "})


def printable(text: str) -> str:
    """``text`` with control and bidi characters as ``\\xNN`` / ``\\uNNNN`` (newlines and tabs kept)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def markdown_cell(value: object) -> str:
    """Text for a cell of a markdown table, shown as the text it is: a label's own "|" (PERSONA's
    ``age=18-44|sex=Female``) would split the row, and a line break end it; a label is whatever a
    dataset holds, and its links, images, HTML and terminal escape sequences must not reach the report's
    readers as such (the Prefect UI renders report.md, javascript: links included; `make demo` prints it)."""
    return printable(str(value).translate(_AS_TEXT))
