"""The README's contents list names every section, in order, with the anchor GitHub gives it."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_contents_list_every_section_in_order() -> None:
    text = README.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    listed = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", text.split("## ", 1)[0], re.MULTILINE)
    assert listed == [(h, anchor(h)) for h in headings]
