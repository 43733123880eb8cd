"""Listening: several addresses, and every address of the host (IPv4 and IPv6) by default."""

from __future__ import annotations

import socket

import pytest

from jobsignal.config import ConfigError, load_config
from jobsignal.rpc.server import ServerSettings
from tests.support.grpc_server import local_settings, open_jobsignal_server
from tests.support.grpcio import GrpcioClients
from tests.support.threads import in_thread


def test_listen_takes_several_addresses_and_every_address_form() -> None:
    config = load_config({"listen": "127.0.0.1:8899, [::1]:9000,:7000"}, {})
    assert config.listen == (("127.0.0.1", 8899), ("::1", 9000), ("", 7000))
    with pytest.raises(ConfigError, match="lists an address twice"):
        load_config({"listen": "127.0.0.1:1,127.0.0.1:1"}, {})
    with pytest.raises(ConfigError, match="must be HOST:PORT"):
        load_config({"listen": "127.0.0.1:1,8899"}, {})


async def test_the_default_serves_ipv4_and_ipv6(grpc_clients: GrpcioClients) -> None:
    async with open_jobsignal_server(ServerSettings(host="", port=0)) as server:
        families = {":" in host for host, _ in server.running.addresses}
        assert families == {False, True}, server.running.addresses
        for host, port in server.running.addresses:
            target = f"[::1]:{port}" if ":" in host else f"127.0.0.1:{port}"
            reply = await in_thread(grpc_clients.connect(target).register, "CCAgent")
            assert reply.code == 200, target


async def test_every_listed_address_is_served(grpc_clients: GrpcioClients) -> None:
    settings = local_settings(more_addresses=(("127.0.0.2", 0),))
    async with open_jobsignal_server(settings) as server:
        assert [host for host, _ in server.running.addresses] == ["127.0.0.1", "127.0.0.2"]
        for host, port in server.running.addresses:
            reply = await in_thread(grpc_clients.connect(f"{host}:{port}").register, "CCAgent")
            assert reply.code == 200
    # Stopped: nothing listens any more.
    for host, port in server.running.addresses:
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect((host, port))
