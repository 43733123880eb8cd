"""Helpers shared by the benchmark's child processes (servers, clients, cluster).

Every child process is started by the orchestrator with pipes on stdin and
stdout. It prints one JSON line when it is ready, then answers each JSON
command line on stdin with exactly one JSON line. It stops by itself:

- when stdin reaches end of file (the orchestrator closed it or died);
- when its parent dies (Linux `PR_SET_PDEATHSIG`, SIGKILL);
- when its hard deadline (`--deadline` seconds) passes, whatever it is doing.

`run_child` gives a child its `--deadline` and those three ways to stop;
`answer_commands` (trio) and `answer_commands_on_asyncio` (the grpc.aio
processes) read the commands and write the replies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib
import json
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import trio
import trio.lowlevel

# Environment variable naming the directory holding job_pb2 / job_pb2_grpc.
STUBS_ENV = "BENCH_GRPCIO_STUBS"
# ClusterD's role whitelist (docs/architecture.md section 2).
ROLES = ("CCAgent", "DefaultUser1", "DefaultUser2", "FdAgent")
# Role every benchmark subscriber uses: no snapshot on subscribe in either server.
ROLE = "CCAgent"
# Roomy limits for both servers, so only the machine limits the load.
MAX_CLIENTS = 100_000
# Big enough for a 40,000-NPU rank table (about 2.9 MB with this generator).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Namespace of every benchmark job.
NAMESPACE = "bench"

_PR_SET_PDEATHSIG = 1


def run_micro(
    prog: str,
    measure: Callable[[int, int], Awaitable[dict[str, Any]]],
    *,
    subscribers: int,
    events: int,
    argv: list[str] | None = None,
) -> None:
    """The command line of a delivery microbenchmark: `--subscribers`, `--events`,
    one JSON line of `measure(subscribers, events)`."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--subscribers", type=int, default=subscribers)
    parser.add_argument("--events", type=int, default=events)
    args = parser.parse_args(argv)
    print(json.dumps(trio.run(measure, args.subscribers, args.events)))


def run_child(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], object]) -> None:
    """Parse a child's command line (`parser` plus `--deadline`), make the process
    stop by itself (`setup_child`), then `run` it with the parsed arguments."""
    parser.add_argument(
        "--deadline", type=float, default=600.0, help="seconds until it exits, whatever it does"
    )
    args = parser.parse_args()
    setup_child(args.deadline)
    run(args)


def setup_child(deadline: float) -> None:
    """Make this process stop by itself: with its parent, or at `deadline` seconds."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent is already gone
        os._exit(3)
    timer = threading.Timer(deadline, _deadline_passed, args=(deadline,))
    timer.daemon = True
    timer.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _deadline_passed(deadline: float) -> None:
    sys.stderr.write(f"bench child {os.getpid()}: deadline of {deadline:g}s passed, exiting\n")
    sys.stderr.flush()
    os._exit(3)


def emit(payload: dict[str, Any]) -> None:
    """One JSON line on stdout (a reply, or the ready line)."""
    sys.stdout.write(json.dumps(payload, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """job_pb2 and job_pb2_grpc from the directory the orchestrator generated."""
    directory = os.environ.get(STUBS_ENV)
    if not directory:
        raise SystemExit(f"{STUBS_ENV} is not set")
    sys.path.insert(0, directory)
    return importlib.import_module("job_pb2"), importlib.import_module("job_pb2_grpc")


def generate_stubs(out: Path) -> None:
    """job_pb2*.py from protos/job/job.proto with grpcio-tools, into `out`."""
    from grpc_tools import protoc

    proto_dir = Path(__file__).resolve().parents[1] / "protos" / "job"
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto_dir / "job.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {code}")


# The flood driver looks at this many subscribers' queues (enough for a
# stable 95th percentile, few enough to cost little next to the fan-out).
LEVEL_SAMPLE = 200
# The flood driver's publish() calls make about this many queue pushes each.
PUSHES_PER_PUBLISH = 16_000


def flood_batch(batch: int, subscribers: int) -> int:
    """Events per publish: at most `batch`, and about PUSHES_PER_PUBLISH queue pushes.

    publish() runs to completion without yielding, so a batch of 16 events to
    5,000 subscribers would stall the event loop (and every send) for a second.
    """
    return max(1, min(batch, PUSHES_PER_PUBLISH // max(1, subscribers)))


def queue_level(pending: list[int], quantile: float) -> int:
    """The `quantile` of the subscribers' queue lengths (0 without subscribers)."""
    if not pending:
        return 0
    pending.sort()
    return pending[int(quantile * (len(pending) - 1))]


@dataclass
class Percentiles:
    count: int
    p50: float
    p99: float
    max: float


def percentiles(values: list[float]) -> Percentiles | None:
    """Nearest-rank p50 / p99 / max, or None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    count = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(count - 1, max(0, int(q * count + 0.5) - 1))]

    return Percentiles(count, rank(0.50), rank(0.99), ordered[-1])


def now_ns() -> int:
    return time.time_ns()


async def answer_commands(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Answer JSON commands read from stdin, one per line, until stdin closes."""
    stdin = trio.lowlevel.FdStream(os.dup(0))
    buffer = b""
    while True:
        data = await stdin.receive_some(65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                emit(handle(json.loads(line)))


async def answer_commands_on_asyncio(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """`answer_commands` for a child running on asyncio."""
    reader = asyncio.StreamReader(limit=1 << 20)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    while line := await reader.readline():
        if line.strip():
            emit(handle(json.loads(line)))
