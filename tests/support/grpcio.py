"""The official grpcio client as the tests use it: stubs, channels, and reading a stream.

`load()` generates `job_pb2` / `job_pb2_grpc` from `protos/job/job.proto`
with grpc_tools.protoc (`bench.common.generate_stubs`, which the benchmark uses too) into a
temporary directory private to this process, and imports them. Nothing is
written into the source tree, so concurrent test runs cannot race.

The stubs are generated with `protos/job` as the include root, so protobuf's
default pool holds them as "job.proto", while the server's own descriptor
(betterproto2's pool) is "job/job.proto". Reflection tests rely on that
difference to prove which pool the server answered from.

`GrpcioStream` is the one reader of a grpcio response stream: a worker
thread iterates it while the test waits on what arrived. Health and
reflection clients run out of process (tests/support/grpcio_cli.py, which
says why); `cli_command` and `cli_env` start them.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import trio

from bench.common import generate_stubs

from .threads import in_thread
from .waiting import wait_until

if TYPE_CHECKING:
    # Not at run time: the out-of-process clients (grpcio_cli) import this module, and
    # importing jobsignal there would register grpclib's health protos (see grpcio_cli).
    from jobsignal.store.model import JobSummary

REPO = Path(__file__).resolve().parents[2]
STUBS_ENV = "JOBSIGNAL_GRPCIO_STUBS"

# One TCP connection per channel: without a local subchannel pool grpcio
# shares a connection between channels with identical options, which would
# hide per-connection behaviour (idle closes, flow control, ping floods).
BASE_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True)
class GrpcioStubs:
    """The generated modules; untyped (grpcio ships no stubs for them)."""

    directory: Path
    job_pb2: Any
    job_pb2_grpc: Any


@functools.cache
def load() -> GrpcioStubs:
    """Generate (once per process) and import the grpcio stubs."""
    existing = os.environ.get(STUBS_ENV)
    if existing and (Path(existing) / "job_pb2_grpc.py").exists():
        directory = Path(existing)
    else:
        directory = Path(tempfile.mkdtemp(prefix="jobsignal-grpcio-stubs-"))
        atexit.register(shutil.rmtree, directory, True)
        generate_stubs(directory)
    sys.path.insert(0, str(directory))
    return GrpcioStubs(
        directory,
        importlib.import_module("job_pb2"),
        importlib.import_module("job_pb2_grpc"),
    )


def channel_options(**extra: Any) -> list[tuple[str, Any]]:
    """grpcio channel options: the base ones plus `grpc.<name>` overrides.

    Keyword names use `__` for dots, e.g. `http2__bdp_probe=0`.
    """
    options = dict(BASE_CHANNEL_OPTIONS)
    for name, value in extra.items():
        options["grpc." + name.replace("__", ".")] = value
    return list(options.items())


class JobClient:
    """A grpcio channel to jobsignal with the job.Job stub. Blocking: use it in threads."""

    def __init__(self, stubs: GrpcioStubs, channel: Any) -> None:
        self.pb2 = stubs.job_pb2
        self.channel = channel
        self.stub = stubs.job_pb2_grpc.JobStub(channel)

    def info(self, role: str, client_id: str = "") -> Any:
        return self.pb2.ClientInfo(role=role, clientId=client_id)

    def register(self, role: str, client_id: str = "", timeout: float = 5.0) -> Any:
        """Register; returns the Status reply (raises grpc.RpcError on refusal)."""
        return self.stub.Register(self.info(role, client_id), timeout=timeout)

    def register_id(self, role: str) -> str:
        """Register and return the clientId, insisting on success."""
        status = self.register(role)
        assert status.code == 200, status
        client_id: str = status.clientId
        return client_id

    def subscribe(self, role: str, client_id: str, *, timeout: float = 30.0) -> Any:
        """SubscribeJobSummarySignal; returns grpcio's response iterator."""
        return self.stub.SubscribeJobSummarySignal(self.info(role, client_id), timeout=timeout)

    def subscribe_list(self, role: str, client_id: str, *, timeout: float = 30.0) -> Any:
        """SubscribeJobSummarySignalList; returns grpcio's response iterator."""
        return self.stub.SubscribeJobSummarySignalList(self.info(role, client_id), timeout=timeout)

    def close(self) -> None:
        self.channel.close()


class GrpcioClients:
    """Opens grpcio channels (one connection each) and closes them all at the end."""

    def __init__(self, stubs: GrpcioStubs) -> None:
        self.stubs = stubs
        self._clients: list[JobClient] = []

    def connect(self, target: str, **options: Any) -> JobClient:
        """A new channel to `target`; `options` as for `channel_options`."""
        channel = grpc.insecure_channel(target, options=channel_options(**options))
        client = JobClient(self.stubs, channel)
        self._clients.append(client)
        return client

    def close_all(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


# -- calls and streams off the trio thread ------------------------------------------------


def _expect_rpc_error(fn: Callable[[], object]) -> Any:
    try:
        result = fn()
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"expected a gRPC error, got {result!r}")


async def rpc_error(fn: Callable[[], object]) -> Any:
    """Run `fn` (a grpcio call) in a thread; return the grpc.RpcError it raises."""
    return await in_thread(_expect_rpc_error, fn)


@dataclass(eq=False)
class GrpcioStream:
    """Reads one grpcio response stream in a worker thread until it ends."""

    call: Any
    messages: list[Any] = field(default_factory=list)
    code: Any = None  # grpc.StatusCode once the stream has ended
    details: str | None = None
    ended: trio.Event = field(default_factory=trio.Event)

    def _consume(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code = error.code()
            self.details = error.details()

    async def run(self) -> None:
        await in_thread(self._consume)
        self.ended.set()

    def start(self, nursery: trio.Nursery) -> GrpcioStream:
        nursery.start_soon(self.run)
        return self

    async def wait_until(
        self, condition: Callable[[list[Any]], bool], *, within: float = 5.0, what: str
    ) -> list[Any]:
        """Wait until `condition` holds for the messages so far; return them.

        Fails at once if the stream ends first.
        """
        await wait_until(
            lambda: condition(list(self.messages)) or self.ended.is_set(), within=within, what=what
        )
        messages = list(self.messages)
        assert condition(messages), (
            f"stream ended ({self.code} {self.details!r}) before {what},"
            f" after {len(messages)} messages"
        )
        return messages

    async def wait_for(self, count: int, within: float = 5.0) -> list[Any]:
        """Wait until `count` messages have arrived; return them."""
        messages = await self.wait_until(
            lambda messages: len(messages) >= count, within=within, what=f"{count} messages"
        )
        return messages[:count]

    async def wait_end(self, within: float = 5.0) -> tuple[Any, str | None]:
        """Wait until the stream has ended; return (status code, details)."""
        with trio.fail_after(within):
            await self.ended.wait()
        return self.code, self.details


# -- what a grpcio client must see -----------------------------------------------------------

# A ping flood ends the flooder's connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings"
# (last stream id: its open streams), then the server closes it, as gRPC core and grpc-go
# servers do; the open streams end at that close, UNAVAILABLE. grpcio carries the GOAWAY's
# code and text into their status message from 1.81 on; before, the message is only
# "Socket closed" (the GOAWAY is in gRPC core's error chain, which Python does not get).
# Every version reports the GOAWAY in gRPC core's log, on stderr: PING_FLOOD_LOG.
GOAWAY_IN_STATUS = tuple(int(part) for part in grpc.__version__.split(".")[:2]) >= (1, 81)
PING_FLOOD_LOG = (
    'Received a GOAWAY with error code ENHANCE_YOUR_CALM and debug data equal to "too_many_pings"'
)


def assert_ended_for_too_many_pings(code: Any, details: str | None) -> None:
    """The status a grpcio stream ends with when the server closes its connection for
    a ping flood (what grpcio can say of it depends on its version, see above)."""
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    if GOAWAY_IN_STATUS:
        assert details is not None and "too_many_pings" in details, details
    else:
        assert details == "Socket closed", details


def expected_signal(job: JobSummary, uuid: str) -> dict[str, str]:
    """The JobSummarySignal fields (proto names) a client must see for `job`."""
    return {
        "uuid": uuid,
        "jobId": job.job_id,
        "jobName": job.job_name,
        "namespace": job.namespace,
        "frameWork": job.framework,
        "jobStatus": job.job_status,
        "time": job.time,
        "cmIndex": "0",
        "total": job.total,
        "HcclJson": job.hccl_json,
        "deleteTime": job.delete_time,
        "sharedTorIp": job.shared_tor_ip,
        "masterAddr": job.master_addr,
        "operator": job.operator,
        "sid": job.sid,
    }


def signal_fields(message: Any) -> dict[str, str]:
    """All 15 fields of a grpcio JobSummarySignal, by proto name."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


# -- the out-of-process clients -----------------------------------------------------------------


def cli_command(*args: str) -> list[str]:
    """The command line running an out-of-process client (tests/support/grpcio_cli.py)."""
    return [sys.executable, "-m", "tests.support.grpcio_cli", *args]


def cli_env(stubs: GrpcioStubs) -> dict[str, str]:
    """Environment for a child process using these helpers: this process's stubs, and
    the repository on the import path (for `tests.support`)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, STUBS_ENV: str(stubs.directory), "PYTHONPATH": path}


def health_statuses(stubs: GrpcioStubs, target: str, *services: str) -> dict[str, str]:
    """grpc.health.v1 Check of each service by grpcio-health-checking, out of process."""
    done = subprocess.run(
        cli_command("health", target, *services),
        capture_output=True,
        env=cli_env(stubs),
        timeout=30,
        check=True,
    )
    statuses: dict[str, str] = json.loads(done.stdout.decode().splitlines()[-1])
    return statuses
