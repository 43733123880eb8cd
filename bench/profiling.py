"""Summaries of a profile of the jobsignal server: the functions where the time goes.

A py-spy speedscope file (sampled, wall-clock on a busy server) or a cProfile
dump (deterministic, with its own overhead) becomes two lists: self time
(where the CPU actually is) and inclusive time (which call paths cost most).
"""

from __future__ import annotations

import json
import pstats
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ProfileSummary:
    tool: str
    samples: int
    self_top: list[tuple[str, float]]  # (function, share of samples or of time)
    inclusive_top: list[tuple[str, float]]


def _short(file: str) -> str:
    """site-packages/grpclib/protocol.py -> grpclib/protocol.py; repo paths relative."""
    file = re.sub(r"^.*/(site|dist)-packages/", "", file)
    file = re.sub(r"^.*/lib/python3\.\d+/", "", file)
    return re.sub(r"^.*/(jobsignal|bench)/", r"\1/", file)


def summarize_speedscope(path: Path, top: int = 15) -> ProfileSummary:
    document: dict[str, Any] = json.loads(path.read_text())
    frames = document["shared"]["frames"]
    names = [f"{frame['name']} ({_short(str(frame.get('file', '?')))})" for frame in frames]
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0.0
    for profile in document["profiles"]:
        if profile.get("type") != "sampled":
            continue
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack:
                continue
            total += weight
            own[names[stack[-1]]] += weight
            for name in {names[index] for index in stack}:
                inclusive[name] += weight
    total = total or 1.0
    return ProfileSummary(
        "py-spy",
        int(total),
        [(name, count / total) for name, count in _largest(own, top)],
        [(name, count / total) for name, count in _largest(inclusive, top * 2)],
    )


def _largest(counts: Mapping[str, float], top: int) -> list[tuple[str, float]]:
    """The `top` largest counts, ties by name, so a report reads the same when
    regenerated (the order frames were counted in follows set iteration)."""
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]


def summarize_cprofile(path: Path, top: int = 15) -> ProfileSummary:
    stats = pstats.Stats(str(path))
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = []
    total = 0.0
    for (file, line, function), (_cc, calls, tottime, cumtime, _callers) in table.items():
        name = f"{function} ({_short(file)}:{line})"
        rows.append((name, calls, tottime, cumtime))
        total += tottime
    total = total or 1.0
    by_self = sorted(rows, key=lambda row: row[2], reverse=True)[:top]
    by_cumulative = sorted(rows, key=lambda row: row[3], reverse=True)[: top * 2]
    return ProfileSummary(
        "cProfile",
        sum(row[1] for row in rows),
        [(name, tottime / total) for name, _c, tottime, _cum in by_self],
        [(name, cumtime / total) for name, _c, _tot, cumtime in by_cumulative],
    )
