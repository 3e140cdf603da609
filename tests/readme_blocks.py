"""The README's code, for tests that run it as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_python_blocks(heading: str) -> list[str]:
    """The ```` ```python ```` blocks of the README section whose heading (any level) is
    ``heading``, up to the next heading of the same or a higher level, in order.

    Raises:
        LookupError: no such heading.
    """
    return readme_blocks(heading, "python")


def readme_blocks(heading: str, language: str) -> list[str]:
    """The fenced blocks of ``language`` (```` ```bash ````, ...) of the README section whose
    heading (any level) is ``heading``, as :func:`readme_python_blocks` finds them.

    Raises:
        LookupError: no such heading.
    """
    lines = README.read_text(encoding="utf-8").splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = re.match(r"(#+) (.*)$", line)
        if m and m.group(2).strip() == heading:
            start, level = i + 1, len(m.group(1))
            break
    if start is None or level is None:
        raise LookupError(f"README.md has no heading {heading!r}")
    blocks: list[str] = []
    fence: str | None = None  # the language of the fenced block we are in ("" for none given)
    current: list[str] = []
    for line in lines[start:]:
        if fence is None:
            m = re.match(r"(#+) ", line)
            if m and len(m.group(1)) <= level:
                break
            if line.startswith("```"):
                fence, current = line[3:].strip(), []
        elif line.strip() == "```":
            if fence == language:
                blocks.append("\n".join(current) + "\n")
            fence = None
        else:
            current.append(line)
    return blocks
