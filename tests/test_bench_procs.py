"""The benchmark's CPU placement: a child started on given CPUs runs there, and the
orchestrator's own thread gets its CPUs back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench.procs import Child, split_cpus


def test_a_child_runs_on_the_cpus_it_was_started_on(tmp_path: Path) -> None:
    usable = os.sched_getaffinity(0)
    one = frozenset({max(usable)})
    cat = shutil.which("cat")
    assert cat is not None
    # `cat` echoes nothing and ends when stdin closes, which `stop` does.
    child = Child(
        "cat", "", [], env=dict(os.environ), log_dir=tmp_path, executable=Path(cat), cpus=one
    )
    try:
        assert os.sched_getaffinity(child.pid) == one
        assert os.sched_getaffinity(0) == usable
    finally:
        child.stop()
    unplaced = Child("cat", "", [], env=dict(os.environ), log_dir=tmp_path, executable=Path(cat))
    try:
        assert os.sched_getaffinity(unplaced.pid) == usable
    finally:
        unplaced.stop()


@pytest.mark.parametrize(
    ("usable", "expected"),
    [
        ({3}, None),
        ({0, 1}, (frozenset({1}), frozenset({0}))),
        ({0, 2, 5}, (frozenset({5}), frozenset({0, 2}))),
    ],
)
def test_split_cpus_gives_the_server_one_cpu_and_the_peers_the_rest(
    monkeypatch: pytest.MonkeyPatch,
    usable: set[int],
    expected: tuple[frozenset[int], frozenset[int]] | None,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(usable))
    assert split_cpus() == expected
