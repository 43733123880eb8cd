"""The public API for trio programs, and the example that shows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import jobsignal

ROOT = Path(__file__).parent.parent


def test_public_api_is_small_and_documented() -> None:
    assert sorted(jobsignal.__all__) == [
        "Config",
        "ConfigError",
        "EventKind",
        "FellBehind",
        "JobEvent",
        "JobEvents",
        "JobState",
        "JobSummarySignal",
        "JobSummarySignalList",
        "RankDevice",
        "RankServer",
        "RankTable",
        "RunningJobsignal",
        "SubscribeFailed",
        "SubscribeOptions",
        "configure",
        "open_subscription",
        "serve",
        "subscribe",
        "watch_jobs",
    ]
    for name in jobsignal.__all__:
        assert getattr(jobsignal, name).__doc__, f"{name} has no docstring"


def test_configure_validates_like_the_command_line() -> None:
    config = jobsignal.configure(
        listen="127.0.0.1:0", idle_timeout=30, roles="CCAgent", snapshot_roles=""
    )
    assert config.listen == (("127.0.0.1", 0),)
    assert config.idle_timeout == 30.0
    assert config.roles == ("CCAgent",)
    with pytest.raises(jobsignal.ConfigError, match="--idle-timeout='0'"):
        jobsignal.configure(idle_timeout=0, snapshot_roles="")
    with pytest.raises(jobsignal.ConfigError, match="unknown settings \\['idle'\\]"):
        jobsignal.configure(idle=3)


def test_example_program_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed.py"), "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert all(line.startswith("demo/") and "(add)" in line for line in lines), lines
    assert "Traceback" not in result.stderr
