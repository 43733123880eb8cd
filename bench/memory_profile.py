"""Where an idle subscriber's memory goes: tracemalloc of jobsignal's server, by file.

    python -m bench.memory_profile [--subscribers N] [--warmup W] [--top K] [--json PATH]
                                   [--rss-only]

The gRPC server (`run_grpc_server`, the benchmark's roomy limits) runs in this
process; the subscribers are the benchmark's grpc.aio load generator
(`bench.loadgen`, one channel and so one connection each, Register then
SubscribeJobSummarySignal) in a child process, so none of the client's
allocations are counted. `--warmup` subscribers connect first, so one-time
costs (caches, interned strings, code paths run for the first time) stay out
of the figure; then `--subscribers` more, and the Python allocations the
server holds once they are all idle, minus those it held before, divided by
their number, are the bytes per idle subscriber, listed by the file that made
them. VmRSS grows by more (allocator overhead, pages); `--rss-only` measures
it without tracemalloc's own overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench.common import MAX_CLIENTS, ROLES, STUBS_ENV, generate_stubs
from bench.jobsignal_server import roomy_settings
from bench.procs import REPO, Child, status_bytes
from jobsignal.fanout import Broadcaster
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import ServerSettings, run_grpc_server
from jobsignal.rpc.session import SessionSettings
from jobsignal.status import SourceStatus

SETTLE_SECONDS = 1.0


@dataclass(frozen=True)
class FileShare:
    """What one source file allocated and the server still holds, per subscriber."""

    file: str
    bytes: float
    blocks: float


@dataclass
class Profile:
    subscribers: int
    rss_bytes_per_subscriber: float
    # Empty with `trace=False`.
    python_bytes_per_subscriber: float = 0.0
    by_file: list[FileShare] = field(default_factory=list)

    def share_of(self, fragment: str) -> float:
        """Bytes per subscriber allocated in files whose path contains `fragment`."""
        return sum(row.bytes for row in self.by_file if fragment in row.file)


def short_path(path: str) -> str:
    """`h2/settings.py`, `asyncio/locks.py`, `jobsignal/rpc/service.py`: the path from
    the package down (site-packages, the standard library or this repository)."""
    for marker in ("site-packages/", f"{REPO}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = Path(path).parts
    return "/".join(parts[-2:])


@contextlib.contextmanager
def grpcio_stubs() -> Iterator[Path]:
    """The load generator's job_pb2 stubs: $BENCH_GRPCIO_STUBS, else generated now."""
    existing = os.environ.get(STUBS_ENV)
    if existing:
        yield Path(existing)
        return
    with tempfile.TemporaryDirectory(prefix="memory-profile-stubs-") as directory:
        generate_stubs(Path(directory))
        yield Path(directory)


class Subscribers:
    """One load-generator child and its idle subscribers."""

    def __init__(self, target: str, count: int, stubs: Path, log_dir: Path) -> None:
        env = {
            **os.environ,
            STUBS_ENV: str(stubs),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        self.count = count
        self.child = Child(
            f"loadgen-{count}",
            "bench.loadgen",
            ["--target", target, "--count", str(count), "--deadline", "600"],
            env=env,
            log_dir=log_dir,
        )

    async def started(self) -> int:
        reply = await trio.to_thread.run_sync(self.child.request, {"cmd": "count"})
        if reply["failed"]:
            raise RuntimeError(f"{reply['failed']} subscribers failed: {reply['errors']}")
        return int(reply["started"])

    def stop(self) -> None:
        self.child.stop()
        if self.child.proc.stdout is not None:
            self.child.proc.stdout.close()


@contextlib.asynccontextmanager
async def subscribers(
    target: str, count: int, stubs: Path, log_dir: Path, broadcaster: Broadcaster
) -> AsyncIterator[Subscribers]:
    """`count` more subscribers, all of them subscribed and idle for a moment."""
    expected = len(broadcaster.subscribers) + count
    group = Subscribers(target, count, stubs, log_dir)
    try:
        await trio.to_thread.run_sync(group.child.wait_ready)
        with trio.fail_after(60 + count / 20):
            # Polled: the load generator only answers when asked.
            while True:
                if await group.started() >= count and len(broadcaster.subscribers) >= expected:
                    break
                await trio.sleep(0.05)
        await trio.sleep(SETTLE_SECONDS)
        yield group
    finally:
        await trio.to_thread.run_sync(group.stop)


def held_now() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot()


async def measure(
    subscribers_count: int,
    *,
    warmup: int = 20,
    stubs: Path,
    log_dir: Path,
    trace: bool = True,
    by_line: bool = False,
) -> Profile:
    """Run the server here, connect `warmup` and then `subscribers_count` idle subscribers
    from a load-generator child, and return what the second group costs each."""
    settings = roomy_settings(
        ServerSettings(
            host="127.0.0.1",
            port=0,
            session=SessionSettings(idle_timeout=3600.0),
            shutdown_grace=2.0,
        )
    )
    broadcaster = Broadcaster()
    registry = Registry(
        roles=ROLES,
        max_registrations=MAX_CLIENTS,
        max_subscriptions_per_role=MAX_CLIENTS,
        ttl=3600.0,
    )
    status = SourceStatus()
    shutdown = trio.Event()
    if trace:
        tracemalloc.start()
    try:
        async with trio.open_nursery() as nursery:
            running = await nursery.start(
                run_grpc_server, settings, broadcaster, registry, status, shutdown
            )
            status.mark_ready(time.time())
            target = f"127.0.0.1:{running.port}"
            async with contextlib.AsyncExitStack() as groups:
                if warmup:
                    await groups.enter_async_context(
                        subscribers(target, warmup, stubs, log_dir, broadcaster)
                    )
                before = held_now() if trace else None
                rss_before = status_bytes(os.getpid(), "VmRSS")
                await groups.enter_async_context(
                    subscribers(target, subscribers_count, stubs, log_dir, broadcaster)
                )
                gc.collect()
                rss_after = status_bytes(os.getpid(), "VmRSS")
                after = held_now() if trace else None
            shutdown.set()
    finally:
        if trace:
            tracemalloc.stop()
    profile = Profile(
        subscribers=subscribers_count,
        rss_bytes_per_subscriber=(rss_after - rss_before) / subscribers_count,
    )
    if before is not None and after is not None:
        by_file: dict[str, list[float]] = {}
        for stat in after.compare_to(before, "lineno" if by_line else "filename"):
            frame = stat.traceback[0]
            name = short_path(frame.filename) + (f":{frame.lineno}" if by_line else "")
            share = by_file.setdefault(name, [0.0, 0.0])
            share[0] += stat.size_diff / subscribers_count
            share[1] += stat.count_diff / subscribers_count
        profile.by_file = sorted(
            (FileShare(name, size, blocks) for name, (size, blocks) in by_file.items()),
            key=lambda row: -row.bytes,
        )
        profile.python_bytes_per_subscriber = sum(row.bytes for row in profile.by_file)
    return profile


def report(profile: Profile, top: int) -> str:
    lines = [
        f"{profile.subscribers} idle subscribers, one connection each",
        f"VmRSS: {profile.rss_bytes_per_subscriber:,.0f} B per subscriber",
    ]
    if profile.by_file:
        lines.append(
            f"Python allocations held: {profile.python_bytes_per_subscriber:,.0f} B"
            f" ({profile.python_bytes_per_subscriber / 1024:.1f} KiB) per subscriber"
        )
        lines.append(f"{'bytes':>9} {'blocks':>7}  file")
        for row in profile.by_file[:top]:
            lines.append(f"{row.bytes:9,.0f} {row.blocks:7.1f}  {row.file}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20, help="subscribers not counted")
    parser.add_argument("--top", type=int, default=25, help="files listed")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--lines", action="store_true", help="by source line, not by file")
    parser.add_argument(
        "--rss-only", action="store_true", help="VmRSS only, without tracemalloc's overhead"
    )
    args = parser.parse_args()
    with grpcio_stubs() as stubs, tempfile.TemporaryDirectory(prefix="memory-profile-") as logs:
        profile = trio.run(
            lambda: measure(
                args.subscribers,
                warmup=args.warmup,
                stubs=stubs,
                log_dir=Path(logs),
                trace=not args.rss_only,
                by_line=args.lines,
            )
        )
    print(f"Python {sys.version.split()[0]}")
    print(report(profile, args.top))
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")


if __name__ == "__main__":
    main()
