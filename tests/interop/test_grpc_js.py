"""jobsignal as a grpc-js client (@grpc/grpc-js on Node.js) sees it.

The peer is tests/interop/js/client.js with the versions pinned in
tests/interop/js/package.json (installed by `nox -s peers`). It loads
protos/job/job.proto at run time with @grpc/proto-loader, and reaches the
server through a relay in its own process that reports the PINGs it sends
and the GOAWAYs it receives.
"""

from __future__ import annotations

import itertools

import grpc
import pytest
import trio

from tests.support.factories import make_job
from tests.support.grpc_server import open_jobsignal_server
from tests.support.waiting import wait_until

from .peers import (
    BIG_NPUS,
    assert_no_goaway,
    assert_quiet_subscriber_answers_server_keepalive,
    assert_signals,
    assert_stayed_ready,
    code,
    flag_argv,
    quiet_pings,
    run_to_end,
    running,
    uuids_of,
)


def js(peer: list[str], command: str, target: str, **flags: object) -> list[str]:
    """The peer's command line; keyword `keepalive_ms=1` becomes `--keepalive-ms 1`."""
    return [*peer, command, "--target", target, *flag_argv(flags, "--")]


async def test_register_and_refusal_status(js_peer: list[str]) -> None:
    async with open_jobsignal_server() as server:
        registered = await run_to_end(js(js_peer, "register", server.target, role="FdAgent"))
        refused = await run_to_end(js(js_peer, "register", server.target, role="Intruder"))
    (reply,) = registered.of("registered")
    assert (reply["code"], reply["info"]) == (200, "registration successful")
    assert refused.end()["code"] == code(grpc.StatusCode.INVALID_ARGUMENT), refused.describe()
    assert "'Intruder' is not allowed" in refused.end()["message"]


async def test_subscribe_receives_events_up_to_4_mib(js_peer: list[str]) -> None:
    jobs = [make_job(1), make_job(2, npus=BIG_NPUS)]
    async with open_jobsignal_server() as server:
        async with running(js(js_peer, "subscribe", server.target, count=2)) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=10)
            server.broadcaster.publish(jobs)
            await peer.wait_exit(20)
        uuids = uuids_of(server)
    assert_signals(peer, jobs, uuids)
    assert_no_goaway(peer)


async def test_a_client_compressing_its_requests_with_gzip_is_served(js_peer: list[str]) -> None:
    """`grpc.default_compression_algorithm` gzip compresses every message a client
    sends; the server inflates them (it answered UNIMPLEMENTED before)."""
    jobs = [make_job(1), make_job(2, npus=BIG_NPUS)]
    async with open_jobsignal_server() as server:
        async with running(js(js_peer, "subscribe", server.target, count=2, gzip=True)) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=10)
            server.broadcaster.publish(jobs)
            await peer.wait_exit(20)
        uuids = uuids_of(server)
    assert peer.of("registered")[0]["code"] == 200, peer.describe()
    assert_signals(peer, jobs, uuids)
    (wire,) = peer.of("wire")
    assert wire["compressedData"] == 2, wire  # the Register and the subscription


async def test_list_stream_starts_with_the_snapshot(js_peer: list[str]) -> None:
    jobs = [make_job(i) for i in range(3)]
    async with open_jobsignal_server() as server:
        server.broadcaster.publish(jobs)
        peer = await run_to_end(js(js_peer, "subscribe-list", server.target, count=1))
        uuids = uuids_of(server)
    (batch,) = peer.messages
    assert batch["JobTotalNum"] == 3
    assert_signals(peer, jobs, uuids)


async def test_a_quiet_grpc_js_subscriber_answers_server_keepalive_and_stays(
    js_peer: list[str],
) -> None:
    """grpc-js answers the server's PINGs on a quiet stream, so the server never
    takes it for gone; the stream still delivers after six of its intervals."""
    await assert_quiet_subscriber_answers_server_keepalive(
        lambda target: js(js_peer, "subscribe", target, count=1)
    )


async def test_shutdown_ends_the_stream_and_sends_goaway(js_peer: list[str]) -> None:
    async with open_jobsignal_server() as server:
        target = server.target
        async with (
            running(js(js_peer, "subscribe", target)) as streaming,
            running(js(js_peer, "register", target, role="DefaultUser2", hold_ms=20_000)) as bare,
        ):
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=10)
            await bare.wait_for(lambda p: bool(p.of("registered")), within=10, what="Register")
            await server.stop()
            await streaming.wait_exit()
            await bare.wait_for(lambda p: bool(p.goaways()), within=5, what="GOAWAY")
    end = streaming.end()
    assert (end["code"], end["message"]) == (
        code(grpc.StatusCode.UNAVAILABLE),
        "server shutting down",
    ), streaming.describe()
    assert bare.goaways()[0]["code"] == 0  # NO_ERROR: the relay sees what the server sends


HOLD = 14.0  # past the fourth 3 s ping: a 4 s policy would have sent GOAWAY by now


@pytest.mark.slow
async def test_keepalive_every_3s_holds_14s_with_and_without_a_stream(
    js_peer: list[str],
) -> None:
    """ClusterD v26's client policy (pings every 3 s, permitted without calls) under the
    server's default ping policy: no strike, no GOAWAY, the stream stays open."""
    keepalive = {"keepalive_ms": 3000, "permit_without_calls": True}
    async with open_jobsignal_server() as server:
        stream_argv = js(js_peer, "subscribe", server.target, count=1, **keepalive)
        bare_argv = js(js_peer, "register", server.target, hold_ms=int(HOLD * 1000), **keepalive)
        async with running(stream_argv) as streaming, running(bare_argv) as bare:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=10)
            await trio.sleep(HOLD)
            job = make_job(1)
            server.broadcaster.publish([job])
            await streaming.wait_exit()
            await bare.wait_exit()
        floods = server.connections.ping_floods

    assert floods == 0
    assert [signal["jobId"] for signal in streaming.signals] == [job.job_id]
    assert bare.of("held")[0]["state"] == "READY", bare.describe()
    for peer in (streaming, bare):
        assert_no_goaway(peer)
        assert_stayed_ready(peer)
        pings = quiet_pings(peer)
        assert len(pings) >= 4, peer.describe()
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert all(2.9 < gap < 4.5 for gap in gaps), (gaps, peer.describe())
