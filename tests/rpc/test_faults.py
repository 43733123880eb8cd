"""The handler boundary: an unexpected exception ends only its own stream, seen and counted."""

from __future__ import annotations

import logging

import grpc
import pytest

from jobsignal.rpc.registry import Registry
from tests.support.grpc_server import open_jobsignal_server
from tests.support.grpcio import GrpcioClients, rpc_error
from tests.support.threads import in_thread


async def test_an_unexpected_error_in_a_handler_is_internal_logged_and_counted(
    grpc_clients: GrpcioClients,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_register(self: Registry, *args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug one request can reach")

    async with open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
            patch.setattr(Registry, "register", broken_register)
            error = await rpc_error(lambda: client.register("CCAgent"))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "logged by the server" in error.details()
        assert server.running.handler_errors["Register"] == 1
        (record,) = [r for r in caplog.records if "unexpected error in Register" in r.getMessage()]
        assert "127.0.0.1:" in record.getMessage()
        assert record.exc_info is not None and "a bug one request can reach" in str(
            record.exc_info[1]
        )
        # The server, and the same connection, go on serving.
        reply = await in_thread(client.register, "CCAgent")
        assert reply.code == 200
