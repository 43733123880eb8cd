"""Foreign gRPC clients (grpc-go, grpc-js) as the interop tests build and run them.

Both peers are small command-line programs that print one JSON object per
line: connectivity states, each message received (sizes, fields, a SHA-256
of the rank table), GOAWAY frames seen, and the final gRPC status. See
tests/interop/go/main.go for the format; tests/interop/js/client.js prints
the same events.

The grpc-go peer is built once per test session in GOPATH mode against
Debian's packages, with its stubs generated from protos/job/job.proto by
protoc at that moment (nothing generated is kept in the tree). When a tool or
package is missing, `build_go_peer` fails the tests with the package names to
install; `.ci/install-peers` installs all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from rpc import expected_signal

from jobsignal.store.model import JobSummary, event_id

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
GO_SOURCE = Path(__file__).parent / "go" / "main.go"
JS_DIR = Path(__file__).parent / "js"
GOCODE = Path("/usr/share/gocode/src")
GO_IMPORT_ROOT = "jobsignalinterop"
INSTALL_HINT = "run .ci/install-peers (as root) to install them"

# What the grpc-go peer needs, as (Debian package, how to tell it is there).
GO_REQUIREMENTS: tuple[tuple[str, Callable[[], bool]], ...] = (
    ("golang-go", lambda: shutil.which("go") is not None),
    ("protobuf-compiler", lambda: shutil.which("protoc") is not None),
    ("protoc-gen-go", lambda: shutil.which("protoc-gen-go") is not None),
    ("protoc-gen-go-grpc", lambda: shutil.which("protoc-gen-go-grpc") is not None),
    ("golang-google-grpc-dev", lambda: (GOCODE / "google.golang.org/grpc").is_dir()),
    ("golang-google-protobuf-dev", lambda: (GOCODE / "google.golang.org/protobuf").is_dir()),
    (
        "golang-github-golang-protobuf-1-5-dev",
        lambda: (GOCODE / "github.com/golang/protobuf/ptypes").is_dir(),
    ),
)


def missing_go_packages() -> list[str]:
    return [package for package, present in GO_REQUIREMENTS if not present()]


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(
            f"{what} failed ({done.returncode}): {' '.join(argv)}\n{done.stdout}{done.stderr}",
            pytrace=False,
        )


def _go_cache(build_dir: Path) -> Path:
    """The user's Go build cache (rebuilds take a second), or one in `build_dir`."""
    home = Path.home()
    if os.access(home, os.W_OK):
        return home / ".cache" / "go-build"
    return build_dir / "go-cache"


def build_go_peer(build_dir: Path) -> Path:
    """Generate the Go stubs, build the peer, return the binary's path."""
    missing = missing_go_packages()
    if missing:
        pytest.fail(
            "the grpc-go interop peer needs Debian packages that are not installed: "
            f"{', '.join(missing)}; {INSTALL_HINT}",
            pytrace=False,
        )
    package_dir = build_dir / "src" / GO_IMPORT_ROOT
    (package_dir / "peer").mkdir(parents=True)
    shutil.copy(GO_SOURCE, package_dir / "peer" / "main.go")
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{build_dir}:{GOCODE.parent}",
        "GOFLAGS": "",
        "GOCACHE": os.environ.get("GOCACHE") or str(_go_cache(build_dir)),
    }
    # The proto's own go_package ("/job", ClusterD's) is no import path: map it.
    mapping = f"paths=source_relative,Mjob/job.proto={GO_IMPORT_ROOT}/job"
    _run(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--go_out={package_dir}",
            f"--go_opt={mapping}",
            f"--go-grpc_out={package_dir}",
            f"--go-grpc_opt={mapping}",
            "job/job.proto",
        ],
        env,
        "protoc (Go stubs)",
    )
    binary = build_dir / "bin" / "jobsignal-go-peer"
    _run(["go", "build", "-o", str(binary), f"{GO_IMPORT_ROOT}/peer"], env, "go build")
    return binary


def js_peer_command() -> list[str]:
    """The grpc-js peer's command line; fails the tests when it cannot run."""
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            f"the grpc-js interop peer needs Node.js (Debian: nodejs); {INSTALL_HINT}",
            pytrace=False,
        )
    missing = [
        package
        for package in ("@grpc/grpc-js", "@grpc/proto-loader")
        if not (JS_DIR / "node_modules" / package / "package.json").is_file()
    ]
    if missing:
        pytest.fail(
            f"the grpc-js interop peer needs npm packages not installed in {JS_DIR}:"
            f" {', '.join(missing)}; {INSTALL_HINT}",
            pytrace=False,
        )
    return [node, str(JS_DIR / "client.js")]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- running a peer -----------------------------------------------------------------


@dataclass(eq=False)
class Peer:
    """One peer process: the JSON events it printed so far, and how it ended."""

    argv: list[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: bytearray = field(default_factory=bytearray)
    returncode: int | None = None
    exited: trio.Event = field(default_factory=trio.Event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.of("message")

    @property
    def signals(self) -> list[dict[str, Any]]:
        """Every JobSummarySignal received, list batches flattened."""
        return [signal for message in self.messages for signal in message["signals"]]

    def end(self) -> dict[str, Any]:
        """The final status of the call; fails when the peer printed none."""
        ends = self.of("end")
        assert len(ends) == 1, f"expected one status, got {ends}; {self.describe()}"
        return ends[0]

    def goaways(self) -> list[dict[str, Any]]:
        return self.of("goaway")

    def describe(self) -> str:
        """Everything the peer said, for assertion messages."""
        text = "\n".join(json.dumps(event)[:300] for event in self.events)
        return f"{self.argv[0]} exited {self.returncode}:\n{text}\nstderr: {self.stderr[-2000:]!r}"

    async def wait_for(self, condition: Callable[[Peer], bool], within: float, what: str) -> None:
        with trio.move_on_after(within):
            while not condition(self):
                if self.exited.is_set():
                    break
                await trio.sleep(0.01)
        why = "the peer exited" if self.exited.is_set() else f"timed out after {within}s"
        assert condition(self), f"{why} waiting for {what}; {self.describe()}"

    async def wait_exit(self, within: float = 10.0) -> Peer:
        with trio.move_on_after(within):
            await self.exited.wait()
        assert self.exited.is_set(), f"still running after {within}s; {self.describe()}"
        return self


async def _read_lines(stream: trio.abc.ReceiveStream, peer: Peer) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        peer.events += [json.loads(line) for line in lines if line.strip()]


async def _read_all(stream: trio.abc.ReceiveStream, sink: bytearray) -> None:
    async for chunk in stream:
        sink += chunk


@asynccontextmanager
async def running(argv: list[str], env: dict[str, str] | None = None) -> AsyncIterator[Peer]:
    """Run a peer for the duration of the block; it is killed if still running at the end."""
    peer = Peer(argv)
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None and stderr is not None
    async with trio.open_nursery() as nursery:

        async def supervise() -> None:
            async with trio.open_nursery() as readers:
                readers.start_soon(_read_lines, stdout, peer)
                readers.start_soon(_read_all, stderr, peer.stderr)
            peer.returncode = await process.wait()
            peer.exited.set()

        nursery.start_soon(supervise)
        try:
            yield peer
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await peer.exited.wait()


async def run_to_end(argv: list[str], within: float = 10.0) -> Peer:
    """Run a peer that needs nothing from the test while it runs; return it once exited."""
    async with running(argv) as peer:
        await peer.wait_exit(within)
    return peer


# -- what the tests assert about a peer's output -------------------------------------

# The largest event under gRPC clients' default 4 MiB receive limit: a 4.03 MB rank table.
BIG_NPUS = 56_000
CLUSTER_NPUS = 40_000  # a whole 40,000-NPU cluster's rank table, 2.9 MB
FOUR_MIB = 4 * 1024 * 1024


def flag_argv(flags: dict[str, object], dash: str) -> list[str]:
    """Command-line flags from keywords: `conn_window=1` is `-conn-window 1` (dash "-")."""
    argv: list[str] = []
    for name, value in flags.items():
        flag = dash + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def code(status: grpc.StatusCode) -> int:
    number: int = status.value[0]
    return number


def assert_signals(peer: Peer, jobs: Sequence[JobSummary], uuids: dict[str, str]) -> None:
    """The peer received exactly `jobs`, in order, every field intact.

    `uuids` holds the server's event uuid per live job (deleted jobs have none
    left to compare with: their uuid is checked against the id derived from the state).
    """
    received = peer.signals
    assert [s["jobId"] for s in received] == [j.job_id for j in jobs], peer.describe()
    for signal, job in zip(received, jobs, strict=True):
        assert uuid.UUID(signal["uuid"]).version == 5
        assert signal["uuid"] == event_id(job), "event ids are derived from the state"
        expected: dict[str, Any] = expected_signal(job, uuids.get(job.job_id, signal["uuid"]))
        rank_table = expected.pop("HcclJson")
        expected |= {"hcclBytes": len(rank_table.encode()), "hcclSha256": sha256(rank_table)}
        assert signal == expected


def uuids_of(server: Any) -> dict[str, str]:
    return {entry.job.job_id: entry.uuid for entry in server.broadcaster.latest()}


def assert_no_goaway(*peers: Peer) -> None:
    for peer in peers:
        assert peer.goaways() == [], peer.describe()


def assert_stayed_ready(peer: Peer) -> None:
    """Connectivity went READY once and left it only when the peer closed its channel.

    A GOAWAY from the server would show as IDLE or CONNECTING in between.
    """
    states = [event["state"] for event in peer.of("state")]
    assert "READY" in states, peer.describe()
    after = states[states.index("READY") :]
    assert after in (["READY"], ["READY", "SHUTDOWN"]), peer.describe()


def quiet_pings(peer: Peer) -> list[float]:
    """When the peer pinged between Register and the end of the hold (its own clock).

    Half a second is left out at each end: grpc-go's BDP estimator pings when
    data arrives (the Register reply, the final event); keepalive pings remain.
    """
    start = peer.of("registered")[-1]["t"] + 0.5
    end = min(event["t"] for event in peer.events if event["event"] in ("message", "held")) - 0.5
    return [event["t"] for event in peer.of("ping") if start < event["t"] < end]
