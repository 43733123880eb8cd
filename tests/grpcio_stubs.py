"""The official grpcio client, as the integration tests use it.

`load()` generates `job_pb2` / `job_pb2_grpc` from `protos/job/job.proto`
with grpc_tools.protoc (the grpcio-tools pinned next to grpcio) into a
temporary directory private to this process, and imports them. Nothing is
written into the source tree, so concurrent test runs cannot race.

The stubs are generated with `protos/job` as the include root, so protobuf's
default pool holds them as "job.proto", while the server's own descriptor
(betterproto2's pool) is "job/job.proto". Reflection tests rely on that
difference to prove which pool the server answered from.

grpcio-health-checking and grpcio-reflection cannot be imported in the test
process: their protos define the same symbols (grpc.health.v1.*,
grpc.reflection.v1alpha.*) as grpclib's, in the same default descriptor pool,
and protobuf refuses the second registration. Their clients therefore run
out of process through this module's command line:

    python tests/grpcio_stubs.py health TARGET SERVICE...
    python tests/grpcio_stubs.py reflection TARGET
    python tests/grpcio_stubs.py subscribe TARGET ROLE

Each prints JSON lines on stdout (`subscribe` one line per message, until
killed). The parent passes its stub directory in `JOBSIGNAL_GRPCIO_STUBS`.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROTO_DIR = REPO / "protos" / "job"
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


def generate(out: Path) -> None:
    """Run grpc_tools.protoc on job.proto, writing job_pb2*.py into `out`."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / "job.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {code}")


@functools.cache
def load() -> GrpcioStubs:
    """Generate (once per process) and import the grpcio stubs."""
    existing = os.environ.get(STUBS_ENV)
    if existing and (Path(existing) / "job_pb2_grpc.py").exists():
        directory = Path(existing)
    else:
        directory = Path(tempfile.mkdtemp(prefix="jobsignal-grpcio-stubs-"))
        atexit.register(shutil.rmtree, directory, True)
        generate(directory)
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
        import grpc

        channel = grpc.insecure_channel(target, options=channel_options(**options))
        client = JobClient(self.stubs, channel)
        self._clients.append(client)
        return client

    def close_all(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


# -- out-of-process clients ---------------------------------------------------


def cli_command(*args: str) -> list[str]:
    """The command line running this module's out-of-process client."""
    return [sys.executable, str(Path(__file__).resolve()), *args]


def cli_env(stubs: GrpcioStubs) -> dict[str, str]:
    """Environment for `cli_command`: reuse this process's generated stubs."""
    return {**os.environ, STUBS_ENV: str(stubs.directory)}


def _emit(payload: object) -> None:
    print(json.dumps(payload), flush=True)


def _health(target: str, services: list[str]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        result: dict[str, str] = {}
        for service in services:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                result[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as error:
                result[service] = f"error:{error.code().name}"
        _emit(result)


def _reflection(target: str) -> None:
    import grpc
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        pool = DescriptorPool(database)
        job_file = pool.FindFileContainingSymbol("job.Job")
        job = pool.FindServiceByName("job.Job")
        _emit(
            {
                "services": services,
                "job_file": job_file.name,
                "job_package": job_file.package,
                "methods": {
                    method.name: {
                        "input": method.input_type.full_name,
                        "output": method.output_type.full_name,
                        "server_streaming": method.server_streaming,
                    }
                    for method in job.methods
                },
                "signal_fields": [
                    field.name
                    for field in pool.FindMessageTypeByName("job.JobSummarySignal").fields
                ],
            }
        )


def _subscribe(target: str, role: str) -> None:
    client = GrpcioClients(load()).connect(target)
    client_id = client.register_id(role)
    _emit({"registered": client_id})
    for message in client.subscribe(role, client_id, timeout=60):
        _emit({"jobId": message.jobId, "uuid": message.uuid})


def main(argv: list[str]) -> None:
    command, target, *rest = argv
    if command == "health":
        _health(target, rest)
    elif command == "reflection":
        _reflection(target)
    elif command == "subscribe":
        _subscribe(target, rest[0])
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
