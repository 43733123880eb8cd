"""Every relative link in the README and the docs points at a file that exists.

A link with an anchor into a markdown file must also name one of that file's
headings (GitHub's anchor for it). Links to other sites are not followed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "README.md",
]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at a blank or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(prose)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, blanks to '-'."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = anchor(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_the_link_parser_finds_links_and_headings_their_anchors() -> None:
    text = "See [a](docs/a.md#x-y) and ![img](i.png), not `[b](c.md)`.\n```\n[d](e.md)\n```\n"
    assert links(text) == ["docs/a.md#x-y", "i.png"]
    assert anchor("4. Where the data comes from") == "4-where-the-data-comes-from"
    assert anchor("HTTP/2 connections") == "http2-connections"
    assert anchor("The clients' TLS") == "the-clients-tls"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in links(document.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}: {broken}"
