"""Shared fixtures.

grpcio client side (used by the gRPC integration tests under tests/rpc/):

- `grpcio_stubs`: job_pb2 / job_pb2_grpc generated from protos/ at test time;
- `grpc_clients`: opens grpcio channels and closes every one of them at
  teardown, which also ends any worker thread still blocked on a stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from grpcio_stubs import GrpcioClients, GrpcioStubs, load


@pytest.fixture(scope="session")
def grpcio_stubs() -> GrpcioStubs:
    return load()


@pytest.fixture
def grpc_clients(grpcio_stubs: GrpcioStubs) -> Iterator[GrpcioClients]:
    clients = GrpcioClients(grpcio_stubs)
    try:
        yield clients
    finally:
        clients.close_all()
