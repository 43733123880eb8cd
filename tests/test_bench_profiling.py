"""The benchmark's profile summaries read the same every time they are made."""

from __future__ import annotations

import json
from pathlib import Path

from bench.profiling import summarize_speedscope


def test_functions_with_equal_shares_are_listed_by_name(tmp_path: Path) -> None:
    frames = [{"name": name, "file": "/repo/bench/x.py"} for name in ("main", "b", "a", "c")]
    # Every sample holds main, a, b and c (in two orders); c is on top twice, b once.
    samples = [[0, 1, 2, 3], [0, 2, 1, 3], [0, 3, 2, 1]]
    document = {
        "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "samples": samples, "weights": [1.0, 1.0, 1.0]}],
    }
    path = tmp_path / "profile.speedscope.json"
    path.write_text(json.dumps(document))
    summary = summarize_speedscope(path)
    assert summary.samples == 3
    assert [name for name, _ in summary.inclusive_top] == [
        "a (bench/x.py)",
        "b (bench/x.py)",
        "c (bench/x.py)",
        "main (bench/x.py)",
    ]
    assert all(share == 1.0 for _, share in summary.inclusive_top)
    assert summary.self_top == [("c (bench/x.py)", 2 / 3), ("b (bench/x.py)", 1 / 3)]
