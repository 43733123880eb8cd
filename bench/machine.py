"""What the benchmark ran on: CPU, memory, load, software versions, source revision."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "grpcio",
    "grpcio-tools",
    "protobuf",
    "grpclib",
    "h2",
    "betterproto2",
    "trio",
    "trio-asyncio",
    "httpx",
    "matplotlib",
    "py-spy",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _git(*args: str) -> str:
    try:
        result = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip()


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def describe() -> dict[str, Any]:
    versions: dict[str, str] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    # "XY path" per file; split, not sliced: _git strips the first line's leading blank.
    status = _git("status", "--porcelain", "jobsignal").splitlines()
    dirty = [line.split(maxsplit=1)[1] for line in status]
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "packages": versions,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty_jobsignal_files": dirty,
        "load_average_start": load_average(),
    }
