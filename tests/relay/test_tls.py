"""A relay's upstream over TLS: the settings and the handshake of `jobsignal subscribe`."""

from __future__ import annotations

from pathlib import Path

import trio
import trustme

from jobsignal.relay.source import Relay
from jobsignal.store.model import event_id
from tests.support.factories import make_job
from tests.support.grpc_server import local_settings, open_jobsignal_server
from tests.support.relay import open_relay_server
from tests.support.tls import Pki, write_pair
from tests.support.waiting import wait_until


def relay_of(server: object) -> Relay:
    source = server._parts.source  # type: ignore[attr-defined]
    assert isinstance(source, Relay)
    return source


async def test_a_relay_subscribes_over_mutual_tls(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    server_ca = tmp_path / "server-ca.pem"
    pki.server_ca.cert_pem.write_to_path(str(server_ca))
    cert, key = write_pair(pki.client_ca.issue_cert("relay@x"), tmp_path, "relay")
    job = make_job(1)
    async with open_jobsignal_server(local_settings(tls=pki.files(mutual=True))) as upstream:
        upstream.broadcaster.publish([job])
        async with open_relay_server(
            upstream.port,
            upstream_tls_ca=str(server_ca),
            upstream_tls_cert=str(cert),
            upstream_tls_key=str(key),
        ) as relay:
            (relayed,) = relay._parts.store.live_jobs()
    assert relayed == job and event_id(relayed) == event_id(job)


async def test_an_upstream_certificate_that_does_not_verify_is_never_trusted(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    stranger = tmp_path / "stranger-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    async with (
        open_jobsignal_server(local_settings(tls=pki.files(mutual=False))) as upstream,
        open_relay_server(upstream.port, ready=False, upstream_tls_ca=str(stranger)) as relay,
    ):
        upstream.broadcaster.publish([make_job(1)])
        await wait_until(lambda: relay_of(relay).counters.upstream_errors["unreachable"] > 0)
        await trio.sleep(0.2)
        assert not relay.ready.is_set()
        assert relay._parts.store.live_job_count() == 0
