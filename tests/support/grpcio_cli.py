"""grpcio clients run in a child process: `python -m tests.support.grpcio_cli COMMAND ...`.

grpcio-health-checking and grpcio-reflection cannot be imported in the test
process: their protos define the same symbols (grpc.health.v1.*,
grpc.reflection.v1alpha.*) as grpclib's, in the same default descriptor pool,
and protobuf refuses the second registration. Their clients therefore run
out of process:

    health TARGET SERVICE...
    reflection TARGET
    subscribe TARGET ROLE

Each prints JSON lines on stdout (`subscribe` one line per message, until
killed). Start them with `cli_command` and `cli_env` (tests/support/grpcio.py),
which pass the parent's generated stubs along.
"""

from __future__ import annotations

import json
import sys

import grpc

from .grpcio import GrpcioClients, load


def _emit(payload: object) -> None:
    print(json.dumps(payload), flush=True)


def _health(target: str, services: list[str]) -> None:
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
