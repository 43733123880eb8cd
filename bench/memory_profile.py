"""Where an idle server's memory goes: per idle subscriber, and with no subscriber at all.

    python -m bench.memory_profile [--subscribers N] [--warmup W] [--top K] [--lines]
                                   [--json PATH] [--rss-only]
    python -m bench.memory_profile --idle [--python PATH] [--optimize N] [--jobs N] [--trace]

Per subscriber: the gRPC server (`run_grpc_server`, the benchmark's roomy
limits) runs in this process; the subscribers are the benchmark's grpc.aio
load generator (`bench.loadgen`, one channel and so one connection each,
Register then SubscribeJobSummarySignal) in a child process, so none of the
client's allocations are counted. `--warmup` subscribers connect first, so
one-time costs (caches, interned strings, code paths run for the first time)
stay out of the figure; then `--subscribers` more, and the Python allocations
the server holds once they are all idle, minus those it held before, divided
by their number, are the bytes per idle subscriber, listed by the file (or
`--lines`: the line) that made them. VmRSS grows by more (allocator
overhead, pages); `--rss-only` measures it without tracemalloc's own overhead.

`--idle`: a whole `jobsignal serve` with no subscriber, against the
Kubernetes API emulator (`bench.cluster`, `--jobs` jobs of two ConfigMaps)
through a kubeconfig: its VmRSS once the first LIST is applied and it has
settled, and the modules it loaded. `--python` runs another interpreter's
installed jobsignal (a plain `pip install .` venv, say) instead of this
repository's; `--optimize 2` runs it with `-OO`, as the container image
does (deploy/Dockerfile); `--trace` adds tracemalloc's largest holders by
package (and tracemalloc's overhead to the RSS). The report names the modules
that had no bytecode at the interpreter's optimization level: compiled at
start, they inflate the figure (`python -OO -m compileall` the venv first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench.common import STUBS_ENV, generate_stubs
from bench.jobsignal_server import bench_registry, bench_settings
from bench.procs import REPO, Child, status_bytes
from jobsignal.fanout import Broadcaster
from jobsignal.rpc.server import run_grpc_server
from jobsignal.status import SourceStatus

SETTLE_SECONDS = 1.0
# The server's log line once its first LIST is applied (kube/watcher.py).
LISTED = "initial LIST applied"
# Run as `python -c` in the idle server: jobsignal's own entry point, which on
# exit (SIGTERM: a graceful stop) writes the modules it loaded and, when
# tracemalloc runs, the largest holders by package, as JSON.
IDLE_SERVER = """
import atexit, json, os, runpy, sys
def report():
    found = {"modules": sorted(sys.modules)}
    # Modules imported from source with no bytecode at this optimization level:
    # each was compiled at start, which leaves the compiler's garbage in the heap.
    found["compiled_at_start"] = sorted(
        name for name, module in list(sys.modules.items())
        if isinstance(getattr(module, "__cached__", None), str)
        and not os.path.exists(module.__cached__)
    )
    import tracemalloc  # (not before: it would count as loaded)
    if tracemalloc.is_tracing():
        top = {}
        for stat in tracemalloc.take_snapshot().statistics("filename"):
            path = stat.traceback[0].filename
            for marker in ("site-packages/", "/lib/python"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            key = path.split("/")[0] if "/" in path else path
            key = path.split("/")[1] if key.startswith("3.") else key
            top[key] = top.get(key, 0) + stat.size
        found["traced"] = top
    with open(os.environ["IDLE_REPORT"], "w") as out:
        json.dump(found, out)
atexit.register(report)
sys.argv = ["jobsignal", *sys.argv[1:]]
runpy.run_module("jobsignal", run_name="__main__", alter_sys=True)
"""


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
    settings = bench_settings()
    broadcaster = Broadcaster()
    registry = bench_registry()
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


@dataclass
class IdleServer:
    """`jobsignal serve` with no subscriber, after its first LIST."""

    python: str
    jobs: int
    rss_bytes: int
    # VmRSS is these two: private memory, and pages of mapped files (the
    # interpreter's and the extension modules' shared libraries, OpenSSL's).
    anonymous_bytes: int
    file_bytes: int
    modules: list[str]
    # -O level the server ran with, and the modules it compiled from source at start.
    optimize: int = 0
    compiled_at_start: list[str] = field(default_factory=list)
    # Bytes tracemalloc saw held, by top-level package (with --trace only).
    traced: dict[str, int] = field(default_factory=dict)

    def packages(self) -> list[str]:
        return sorted({name.split(".")[0] for name in self.modules})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def write_kubeconfig(directory: Path, url: str) -> Path:
    """A kubeconfig (in YAML's JSON subset) for the emulator: no credentials."""
    path = directory / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "nobody"}}],
        "current-context": "emulator",
    }
    path.write_text(json.dumps(config))
    return path


def idle_server(
    python: str | None, jobs: int, *, settle: float, trace: bool, work: Path, optimize: int = 0
) -> IdleServer:
    """Start the emulator with `jobs` jobs and `jobsignal serve` against it; measure."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with Child("cluster", "bench.cluster", ["--deadline", "600"], env=env, log_dir=work) as cluster:
        cluster.wait_ready()
        cluster.request({"cmd": "populate", "count": jobs, "servers": 2})
        server_env = {**os.environ, "IDLE_REPORT": str(work / "idle.json")}
        if python is None:  # this repository's jobsignal
            server_env["PYTHONPATH"] = str(REPO)
        else:  # the interpreter's installed one, from a directory without a jobsignal
            server_env.pop("PYTHONPATH", None)
        if trace:
            server_env["PYTHONTRACEMALLOC"] = "1"
        flags = ["-" + "O" * optimize] if optimize else []
        command = [python or sys.executable, *flags, "-c", IDLE_SERVER, "serve"]
        command += ["--kubeconfig", str(write_kubeconfig(work, cluster.ready["url"]))]
        command += ["--listen", f"127.0.0.1:{free_port()}", "--namespaces", "bench"]
        server = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=work, env=server_env
        )
        try:
            assert server.stderr is not None
            log = []
            for raw in server.stderr:
                log.append(raw.decode(errors="replace"))
                if LISTED in log[-1]:
                    break
            else:
                raise RuntimeError("the server exited before its first LIST:\n" + "".join(log))
            time.sleep(settle)
            rss = status_bytes(server.pid, "VmRSS")
            anonymous = status_bytes(server.pid, "RssAnon")
            file_backed = status_bytes(server.pid, "RssFile")
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=30)
    found = json.loads((work / "idle.json").read_text())
    return IdleServer(
        python=python or sys.executable,
        jobs=jobs,
        rss_bytes=rss,
        anonymous_bytes=anonymous,
        file_bytes=file_backed,
        modules=found["modules"],
        optimize=optimize,
        compiled_at_start=found["compiled_at_start"],
        traced=found.get("traced", {}),
    )


def idle_report(idle: IdleServer, top: int) -> str:
    lines = [
        f"jobsignal serve ({idle.python}{' -' + 'O' * idle.optimize if idle.optimize else ''}),"
        f" {idle.jobs} jobs, no subscriber, after the first LIST",
        f"VmRSS: {idle.rss_bytes / 2**20:.1f} MiB ({idle.rss_bytes / 1e6:.1f} MB):"
        f" {idle.anonymous_bytes / 1e6:.1f} MB private,"
        f" {idle.file_bytes / 1e6:.1f} MB of mapped files",
        f"modules loaded: {len(idle.modules)}; top-level: {' '.join(idle.packages())}",
    ]
    if idle.compiled_at_start:
        lines.append(
            f"compiled from source at start (no bytecode at this -O level, RSS inflated):"
            f" {len(idle.compiled_at_start)} modules, e.g. {' '.join(idle.compiled_at_start[:5])}"
        )
    if idle.traced:
        lines.append(f"Python allocations held: {sum(idle.traced.values()) / 2**20:.1f} MiB")
        ranked = sorted(idle.traced.items(), key=lambda item: -item[1])
        lines += [f"{size:12,}  {name}" for name, size in ranked[:top]]
    return "\n".join(lines)


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
    parser.add_argument("--idle", action="store_true", help="a whole server with no subscriber")
    parser.add_argument("--python", help="--idle: this interpreter's installed jobsignal")
    parser.add_argument(
        "--optimize", type=int, choices=(0, 1, 2), default=0, help="--idle: run with -O or -OO"
    )
    parser.add_argument("--jobs", type=int, default=64, help="--idle: jobs in the emulator")
    parser.add_argument("--settle", type=float, default=3.0, help="--idle: seconds after the LIST")
    parser.add_argument("--trace", action="store_true", help="--idle: tracemalloc by package")
    args = parser.parse_args()
    if args.idle:
        with tempfile.TemporaryDirectory(prefix="memory-profile-") as work:
            found = idle_server(
                args.python,
                args.jobs,
                settle=args.settle,
                trace=args.trace,
                work=Path(work),
                optimize=args.optimize,
            )
        print(idle_report(found, args.top))
        if args.json:
            args.json.write_text(json.dumps(dataclasses.asdict(found), indent=2) + "\n")
        return
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
