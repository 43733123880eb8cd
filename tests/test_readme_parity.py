"""The README's parity table with ClusterD names a test per row, and each exists.

A row whose test was renamed or removed would claim a guarantee nobody checks.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = "tests/rpc/test_interop.py"  # the table's default, as its heading says


def parity_rows() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Parity with ClusterD, point by point", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def defined(path: str, name: str) -> bool:
    source = (ROOT / path).read_text()
    return re.search(rf"^(async )?def {re.escape(name)}\(", source, re.M) is not None


def test_every_parity_row_names_an_existing_test() -> None:
    rows = parity_rows()
    assert len(rows) >= 20
    for behaviour, _clusterd, _ours, tests in rows:
        references = re.findall(r"`([^`]+)`", tests)
        if not references:
            assert tests == "the same test", behaviour
            continue
        for reference in references:
            path, _, name = reference.partition("::")
            if path.startswith("test_"):
                path, name = DEFAULT_FILE, path
            assert (ROOT / path).exists(), (behaviour, reference)
            if name:
                assert defined(path, name), (behaviour, reference)
