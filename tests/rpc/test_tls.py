"""TLS and mutual TLS on the gRPC port, with certificates made in the test."""

from __future__ import annotations

import functools
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trustme

from jobsignal.config import ConfigError, load_config
from tests.support.factories import make_job
from tests.support.grpc_server import local_settings, open_jobsignal_server
from tests.support.grpcio import GrpcioStream, GrpcioStubs
from tests.support.threads import in_thread
from tests.support.tls import Pki, write_pair
from tests.support.waiting import wait_until, wait_until_blocking


def register(stubs: GrpcioStubs, port: int, credentials: Any) -> Any:
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = stubs.job_pb2_grpc.JobStub(channel)
        return stub.Register(stubs.job_pb2.ClientInfo(role="CCAgent"), timeout=5)


def served_certificate_serial(port: int, ca: trustme.CA) -> int:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


async def rotated_serial(port: int, ca: trustme.CA, before: int) -> int:
    """Wait until the server presents a certificate other than serial `before`; its serial."""
    served: list[int] = []

    def rotated() -> bool:
        served.append(served_certificate_serial(port, ca))
        return served[-1] != before

    wait = functools.partial(
        wait_until_blocking, rotated, within=5, what="the new certificate", interval=0.05
    )
    await in_thread(wait)
    return served[-1]


async def test_tls_serves_and_plain_text_is_refused(
    tmp_path: Path, grpcio_stubs: GrpcioStubs
) -> None:
    pki = Pki(tmp_path)
    async with open_jobsignal_server(local_settings(tls=pki.files(mutual=False))) as server:
        reply = await in_thread(register, grpcio_stubs, server.port, pki.credentials(None))
        assert reply.code == 200

        def plain() -> Any:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = grpcio_stubs.job_pb2_grpc.JobStub(channel)
                return stub.Register(grpcio_stubs.job_pb2.ClientInfo(role="CCAgent"), timeout=3)

        with pytest.raises(grpc.RpcError) as error:
            await in_thread(plain)
        assert error.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate_from_the_ca(
    tmp_path: Path, grpcio_stubs: GrpcioStubs
) -> None:
    pki = Pki(tmp_path)
    async with open_jobsignal_server(local_settings(tls=pki.files(mutual=True))) as server:
        good = await in_thread(register, grpcio_stubs, server.port, pki.credentials(pki.client_ca))
        assert good.code == 200
        for credentials in (pki.credentials(None), pki.credentials(trustme.CA())):
            with pytest.raises(grpc.RpcError) as error:
                await in_thread(register, grpcio_stubs, server.port, credentials)
            assert error.value.code() is grpc.StatusCode.UNAVAILABLE
        # The refused handshakes did not hurt the server.
        again = await in_thread(register, grpcio_stubs, server.port, pki.credentials(pki.client_ca))
        assert again.code == 200


async def test_certificate_rotation_keeps_live_streams(
    tmp_path: Path, grpcio_stubs: GrpcioStubs
) -> None:
    pki = Pki(tmp_path)
    settings = local_settings(tls=pki.files(mutual=True), tls_reload_interval=0.05)
    async with open_jobsignal_server(settings) as server, trio.open_nursery() as nursery:
        before = await in_thread(served_certificate_serial, server.port, pki.server_ca)
        channel = grpc.secure_channel(f"localhost:{server.port}", pki.credentials(pki.client_ca))
        try:
            stub = grpcio_stubs.job_pb2_grpc.JobStub(channel)
            info = grpcio_stubs.job_pb2.ClientInfo
            reply = await in_thread(stub.Register, info(role="CCAgent"))
            call = stub.SubscribeJobSummarySignal(info(role="CCAgent", clientId=reply.clientId))
            stream = GrpcioStream(call).start(nursery)
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            server.broadcaster.publish([make_job(1)])
            await stream.wait_for(1)

            # Rotate: a new server certificate written over the old files.
            write_pair(pki.server_ca.issue_cert("localhost", "127.0.0.1"), tmp_path, "server")
            await rotated_serial(server.port, pki.server_ca, before)

            server.broadcaster.publish([make_job(2)])
            [first, second] = await stream.wait_for(2)
            assert (first.jobId, second.jobId) == ("uid-0001", "uid-0002")
            assert not stream.ended.is_set()
            # The second went out from publish itself, through the TLS transport.
            assert server.broadcaster.stats.batches_written_from_publish == 1
        finally:
            channel.close()


def certificate_serial(cert: trustme.LeafCert) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()).serial_number


async def test_a_broken_rotation_keeps_the_old_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = Pki(tmp_path)
    settings = local_settings(tls=pki.files(mutual=False), tls_reload_interval=0.05)
    async with open_jobsignal_server(settings) as server:

        async def served() -> int:
            return await in_thread(served_certificate_serial, server.port, pki.server_ca)

        # A good rotation is served: the reloader runs, so what follows can fail.
        first = await served()
        good = pki.server_ca.issue_cert("localhost", "127.0.0.1")
        write_pair(good, tmp_path, "server")
        assert await rotated_serial(server.port, pki.server_ca, first) == certificate_serial(good)

        # A broken one: a key that does not load, then a new certificate (the key
        # first, so no moment has a loadable pair).
        pki.server_key.write_text("-----BEGIN PRIVATE KEY-----\ngarbage\n")
        newer = pki.server_ca.issue_cert("localhost", "127.0.0.1")
        newer.cert_chain_pems[0].write_to_path(str(pki.server_cert))
        caplog.clear()
        await wait_until(
            lambda: "TLS reload failed" in caplog.text, what="the reload of the broken files"
        )
        # Still the last good certificate: not the first one, not the broken new one.
        assert await served() == certificate_serial(good)


def test_tls_settings_are_checked_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        load_config({"tls_cert": "x.pem"}, {})
    with pytest.raises(ConfigError, match="needs --tls-cert"):
        load_config({"tls_client_ca": "ca.pem"}, {})
    from jobsignal.app import server_settings

    config = load_config(
        {"tls_cert": str(tmp_path / "missing.crt"), "tls_key": str(tmp_path / "k")}, {}
    )
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        server_settings(config)
