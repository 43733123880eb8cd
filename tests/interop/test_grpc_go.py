"""jobsignal as a real grpc-go client sees it: ClusterD's own clients are Go programs.

The peer is built from tests/interop/go/main.go against Debian's grpc-go
(see peers.py) and runs with grpc-go's defaults unless a test says otherwise:
dynamic flow-control windows with BDP estimation (which sends a PING with its
window updates while a large message arrives), no keepalive, 4 MiB receive
limit. Plain-text runs also report every HTTP/2 PING the client sent and every
GOAWAY it received, read off the wire.

grpc-go raises any keepalive time below 10 s to 10 s (it logs "Adjusting
keepalive ping interval to minimum period of 10s"), so ClusterD v26's 3 s
policy cannot be exercised from Go: the keepalive test runs grpcio at 3 s
next to grpc-go at 10 s, and shows the 10 s floor on a Go client asking for 3 s.
"""

from __future__ import annotations

import itertools
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest
import trio

from jobsignal.fanout import EndReason
from jobsignal.rpc.keepalive import KeepalivePolicy
from jobsignal.rpc.session import SessionSettings
from jobsignal.sim.emulator import open_emulator
from jobsignal.store.model import event_id
from tests.support.cluster import TOKEN, Cluster, expected_summary
from tests.support.factories import clusterd_job, make_job
from tests.support.grpc_server import (
    local_settings,
    make_registry,
    open_jobsignal_server,
)
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.relay import open_relay_server, serve_upstream
from tests.support.threads import in_thread
from tests.support.tls import Pki
from tests.support.waiting import wait_until

from .peers import (
    BIG_NPUS,
    CLUSTER_NPUS,
    FOUR_MIB,
    Peer,
    assert_no_goaway,
    assert_quiet_subscriber_answers_server_keepalive,
    assert_signals,
    assert_stayed_ready,
    code,
    flag_argv,
    quiet_pings,
    run_to_end,
    running,
    sha256,
    uuids_of,
)


def go(binary: Path, command: str, target: str, **flags: object) -> list[str]:
    """The peer's command line; keyword `conn_window=1` becomes `-conn-window 1`."""
    return [str(binary), command, "-target", target, *flag_argv(flags, "-")]


# -- the job.Job contract with grpc-go's defaults -------------------------------------


async def test_register_and_signal_stream_with_default_settings(go_peer: Path) -> None:
    jobs = [make_job(1), make_job(2, status="complete"), make_job(3, operator="delete")]
    async with open_jobsignal_server() as server:
        registered = await run_to_end(go(go_peer, "register", server.target, role="FdAgent"))
        async with running(go(go_peer, "subscribe", server.target, count=3)) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            server.broadcaster.publish(jobs)
            await peer.wait_exit()
        uuids = uuids_of(server)

    (reply,) = registered.of("registered")
    assert (reply["code"], reply["info"]) == (200, "registration successful")
    assert uuid.UUID(reply["clientId"]).version == 4
    assert_signals(peer, jobs, uuids)
    assert [event["received"] for event in peer.of("done")] == [3]
    assert_no_goaway(registered, peer)


async def test_a_client_compressing_its_requests_with_gzip_is_served(go_peer: Path) -> None:
    """`grpc.UseCompressor(gzip.Name)` compresses every message a client sends, however
    small; the server inflates them (it answered UNIMPLEMENTED before)."""
    jobs = [make_job(1), make_job(2, npus=BIG_NPUS)]
    async with open_jobsignal_server() as server:
        async with running(go(go_peer, "subscribe", server.target, count=2, gzip=True)) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            server.broadcaster.publish(jobs)
            await peer.wait_exit()
        uuids = uuids_of(server)
    assert peer.of("registered")[0]["code"] == 200, peer.describe()
    assert_signals(peer, jobs, uuids)
    (wire,) = peer.of("wire")
    assert wire["compressedData"] == 2, wire  # the Register and the subscription


@pytest.mark.parametrize(
    "windows",
    [{}, {"window": 1 << 20, "conn_window": 4 << 20}],
    ids=["default-bdp-windows", "fixed-windows"],
)
async def test_a_4_mib_job_event_reaches_a_grpc_go_client(
    go_peer: Path, windows: dict[str, int]
) -> None:
    """The FdAgent case of the issue: a big job in the snapshot, then a 40,000-NPU event."""
    big, cluster = make_job(1, npus=BIG_NPUS), make_job(2, npus=CLUSTER_NPUS)
    async with open_jobsignal_server() as server:
        server.broadcaster.publish([big])
        argv = go(go_peer, "subscribe", server.target, role="FdAgent", count=2, **windows)
        async with running(argv) as peer:
            await peer.wait_for(lambda p: len(p.messages) == 1, within=20, what="the snapshot")
            server.broadcaster.publish([cluster])
            await peer.wait_exit(20)
        uuids, floods = uuids_of(server), server.connections.ping_floods

    assert_signals(peer, [big, cluster], uuids)
    sizes = [message["size"] for message in peer.messages]
    assert 4_000_000 < sizes[0] <= FOUR_MIB and sizes[1] > 2_800_000, sizes
    assert_no_goaway(peer)
    assert floods == 0
    pings = len(peer.of("ping"))
    if windows:
        assert pings == 0, "fixed windows turn grpc-go's BDP estimator off"
    else:
        # What the issue is about: the default client pings while the data flows.
        assert pings >= 2, peer.describe()


async def test_list_snapshot_of_several_large_jobs_then_a_live_change(go_peer: Path) -> None:
    heavy = [make_job(i, npus=16_000) for i in range(4)]  # 1.15 MB each
    cluster = make_job(9, npus=CLUSTER_NPUS)
    change = make_job(2, status="complete", npus=16_000, version=1)
    async with open_jobsignal_server() as server:
        server.broadcaster.publish([*heavy, cluster])
        snapshot_uuids = uuids_of(server)
        argv = go(go_peer, "subscribe-list", server.target, role="DefaultUser1")
        async with running(argv) as peer:
            await peer.wait_for(lambda p: len(p.signals) == 5, within=20, what="the snapshot")
            snapshot = list(peer.messages)
            server.broadcaster.publish([change])
            await peer.wait_for(lambda p: len(p.signals) == 6, within=20, what="the change")
        change_uuid = uuids_of(server)[change.job_id]

    snapshot_signals = [s for batch in snapshot for s in batch["signals"]]
    by_id = {job.job_id: job for job in [*heavy, cluster]}
    assert sorted(s["jobId"] for s in snapshot_signals) == sorted(by_id)
    for batch in snapshot:
        jobs = [by_id[s["jobId"]] for s in batch["signals"]]
        assert sum(job.npu_count for job in jobs) <= CLUSTER_NPUS
        assert batch["size"] <= FOUR_MIB
        assert batch["JobTotalNum"] == 5
        batch_peer = Peer(["snapshot"], [{"event": "message", **batch}])
        assert_signals(batch_peer, jobs, snapshot_uuids)
    assert len(snapshot) >= 3, "80,000 NPUs of rank tables take at least three batches"
    assert len({batch["ReportTime"] for batch in snapshot}) == 1
    (live,) = peer.messages[len(snapshot) :]
    assert live["JobTotalNum"] == 1  # a live change: a list of one, as ClusterD sends it
    assert_signals(
        Peer(["live"], [{"event": "message", **live}]), [change], {"uid-0002": change_uuid}
    )
    assert_no_goaway(peer)


# -- a relay in front of a ClusterD-style server -------------------------------------------


async def test_a_grpc_go_subscriber_of_a_relay_gets_every_change_through_an_upstream_restart(
    go_peer: Path, tmp_path: Path
) -> None:
    """Issue 38's "done": a grpc-go List subscriber of `jobsignal serve --source relay`,
    whose upstream is a jobsignal watching the emulated cluster, receives every change
    written to the cluster with the upstream's uuids, through an upstream restart.

    (bench/go/reference, the grpc-go server written like ClusterD, serves neither the
    List RPC nor a cluster's changes: it publishes a benchmark's fixed jobs.)
    """
    a, b, c, d = (clusterd_job(name) for name in ("a", "b", "c", "d"))
    async with open_emulator(token=TOKEN) as emu, trio.open_nursery() as nursery:
        cluster = Cluster(emu.state)
        stop = trio.Event()
        first = await nursery.start(serve_upstream, emu, tmp_path, stop, "127.0.0.1:0")
        port = first.port
        async with open_relay_server(port) as relay:
            argv = go(go_peer, "subscribe-list", f"127.0.0.1:{relay.port}", role="CCAgent")
            async with running(argv) as peer:
                await peer.wait_for(lambda p: len(p.messages) == 1, within=20, what="snapshot")
                cluster.write(a, "pending")
                cluster.write(b, "pending")
                await peer.wait_for(lambda p: len(p.signals) == 2, within=20, what="a and b")
                stop.set()  # the upstream restarts; meanwhile the cluster moves on
                await wait_until(lambda: relay._parts.store.live_job_count() == 2)
                await trio.sleep(0.5)
                cluster.write(a, "running")
                cluster.remove(b)
                cluster.write(c, "pending")
                stop = trio.Event()
                await nursery.start(serve_upstream, emu, tmp_path, stop, f"127.0.0.1:{port}")
                await peer.wait_for(lambda p: len(p.signals) == 5, within=40, what="the resync")
                cluster.write(d, "pending")
                await peer.wait_for(lambda p: len(p.signals) == 6, within=20, what="d")
                stop.set()
        nursery.cancel_scope.cancel()

    assert peer.messages[0]["signals"] == [] and peer.messages[0]["JobTotalNum"] == 0
    got = [(s["jobName"], s["jobStatus"], s["operator"]) for s in peer.signals]
    assert got[:2] == [("a", "pending", "add"), ("b", "pending", "add")]
    assert sorted(got[2:5]) == [
        ("a", "running", "add"),
        ("b", "pending", "delete"),
        ("c", "pending", "add"),
    ]
    assert got[5] == ("d", "pending", "add")
    expected = {
        ("a", "pending"): expected_summary(a, "pending"),
        ("b", "pending"): expected_summary(b, "pending"),
        ("a", "running"): expected_summary(a, "running"),
        ("c", "pending"): expected_summary(c, "pending"),
        ("d", "pending"): expected_summary(d, "pending"),
    }
    for signal in peer.signals:
        state = expected[(signal["jobName"], signal["jobStatus"])]
        if signal["operator"] == "delete":  # gone while the upstream was away: the relay's
            state = state.as_deleted(signal["deleteTime"])
        # A jobsignal upstream's uuid is derived from the state: the same at both tiers.
        assert signal["uuid"] == event_id(state), signal
        assert signal["hcclSha256"] == sha256(state.hccl_json)
    assert_no_goaway(peer)


# -- refusals, each with its status code --------------------------------------------------


async def test_every_refusal_reaches_grpc_go_with_its_status_code(go_peer: Path) -> None:
    registry = make_registry(max_subscriptions_per_role=1)
    async with open_jobsignal_server(registry=registry) as server:
        target = server.target
        unknown_role = await run_to_end(go(go_peer, "register", target, role="Intruder"))
        unregistered = await run_to_end(go(go_peer, "subscribe", target, client_id="never-issued"))
        wrong_role = await run_to_end(
            go(go_peer, "subscribe", target, role="FdAgent", subscribe_role="CCAgent")
        )
        async with running(go(go_peer, "subscribe", target, role="CCAgent")) as holder:
            await wait_until(lambda: registry.active_subscriptions("CCAgent") == 1)
            over_limit = await run_to_end(go(go_peer, "subscribe", target, role="CCAgent"))
            assert not holder.exited.is_set()

    expected = [
        (unknown_role, "Register", grpc.StatusCode.INVALID_ARGUMENT, "'Intruder' is not allowed"),
        (
            unregistered,
            "SubscribeJobSummarySignal",
            grpc.StatusCode.FAILED_PRECONDITION,
            "Register",
        ),
        (wrong_role, "SubscribeJobSummarySignal", grpc.StatusCode.PERMISSION_DENIED, "'FdAgent'"),
        (over_limit, "SubscribeJobSummarySignal", grpc.StatusCode.RESOURCE_EXHAUSTED, "limit"),
    ]
    for peer, rpc, status, words in expected:
        end = peer.end()
        assert (end["rpc"], end["code"]) == (rpc, code(status)), peer.describe()
        assert words in end["message"], end


async def test_a_full_registry_answers_grpc_go_with_status_429(go_peer: Path) -> None:
    async with open_jobsignal_server(registry=make_registry(max_registrations=1)) as server:
        first = await run_to_end(go(go_peer, "register", server.target))
        full = await run_to_end(go(go_peer, "register", server.target))
    assert first.of("registered")[0]["code"] == 200
    (reply,) = full.of("registered")
    assert (reply["code"], reply["clientId"]) == (429, ""), full.describe()


# -- shutdown --------------------------------------------------------------------------------


async def test_shutdown_ends_both_streams_with_unavailable(go_peer: Path) -> None:
    async with open_jobsignal_server() as server, AsyncExitStack() as stack:
        target = server.target
        signal = await stack.enter_async_context(running(go(go_peer, "subscribe", target)))
        listing = await stack.enter_async_context(
            running(go(go_peer, "subscribe-list", target, role="DefaultUser1"))
        )
        quiet = await stack.enter_async_context(
            running(go(go_peer, "register", target, role="DefaultUser2", hold="20s"))
        )
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2)
        await quiet.wait_for(lambda p: bool(p.of("registered")), within=5, what="Register")
        await server.stop()
        for peer in (signal, listing):
            await peer.wait_exit()
            assert (peer.end()["code"], peer.end()["message"]) == (
                code(grpc.StatusCode.UNAVAILABLE),
                "server shutting down",
            ), peer.describe()
        # The connection without a stream is told to go away politely.
        await quiet.wait_for(lambda p: bool(p.goaways()), within=5, what="GOAWAY")
        assert quiet.goaways()[0]["code"] == 0  # NO_ERROR


# -- TLS ---------------------------------------------------------------------------------------


async def test_grpc_go_over_mutual_tls(go_peer: Path, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    leaf = pki.client_ca.issue_cert("client@example")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "client.crt"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    pki.server_ca.cert_pem.write_to_path(str(tmp_path / "server-ca.pem"))
    tls = {"tls_ca": tmp_path / "server-ca.pem", "server_name": "localhost"}
    async with open_jobsignal_server(local_settings(tls=pki.files(mutual=True))) as server:
        job = make_job(1)
        server.broadcaster.publish([job])
        client_tls = {
            **tls,
            "tls_cert": tmp_path / "client.crt",
            "tls_key": tmp_path / "client.key",
        }
        argv = go(go_peer, "subscribe", server.target, role="FdAgent", count=1, **client_tls)
        accepted = await run_to_end(argv)
        refused = await run_to_end(go(go_peer, "register", server.target, timeout="3s", **tls))
        uuids = uuids_of(server)
    assert_signals(accepted, [job], uuids)
    assert refused.end()["code"] == code(grpc.StatusCode.UNAVAILABLE), refused.describe()


@pytest.mark.parametrize(
    ("ending", "status", "message"),
    [
        ("replaced", grpc.StatusCode.ABORTED, "replaced by a newer subscription"),
        ("shutdown", grpc.StatusCode.UNAVAILABLE, "server shutting down"),
    ],
)
async def test_a_stream_ended_mid_message_finishes_it_before_its_status(
    go_peer: Path, ending: str, status: grpc.StatusCode, message: str
) -> None:
    """A stream ended while part of a 2.9 MB message waits for grpc-go's window
    (fixed at 64 KiB, so it waits): the message is finished first, then the
    status. Trailers right after part of a message, grpc-go reports as INTERNAL
    "unexpected EOF" instead of the status they carry."""
    job = make_job(2, npus=CLUSTER_NPUS)
    windows = {"window": 64 << 10, "conn_window": 64 << 10}
    async with open_jobsignal_server() as server:
        argv = go(go_peer, "subscribe", server.target, role="FdAgent", count=2, **windows)
        async with running(argv) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            (protocol,) = server.connections.protocols()
            (subscriber,) = server.broadcaster.subscribers
            server.broadcaster.publish([job])
            await wait_until(lambda: protocol.output.has_waiting, interval=0, what="part-way")
            if ending == "replaced":
                subscriber.end(EndReason.REPLACED)
            else:
                await server.stop()
            await peer.wait_exit(20)
        uuids = uuids_of(server)
    assert_signals(peer, [job], uuids)
    end = peer.end()
    assert end["code"] == code(status) and message in end["message"], peer.describe()


# -- server keepalive ------------------------------------------------------------------------------


async def test_a_quiet_grpc_go_subscriber_answers_server_keepalive_and_stays(
    go_peer: Path,
) -> None:
    """grpc-go answers the server's PINGs on a quiet stream (its defaults: no
    keepalive of its own), so the server never takes it for gone; the stream
    still delivers after six of the server's intervals."""
    await assert_quiet_subscriber_answers_server_keepalive(
        lambda target: go(go_peer, "subscribe", target, count=1)
    )


# -- keepalive and the idle rule (the slow test: it holds for 30 s) -------------------------------

HOLD = 30.0
IDLE = 12.0  # just above grpc-go's 10 s keepalive floor
# Below the idle timeout, as --keepalive-time must be, and above the clients' own
# 10 s: a client pinging every 10 s is never asked, a silent one is asked every 11 s.
SERVER_KEEPALIVE = KeepalivePolicy(interval=11.0, timeout=5.0)
GRPCIO_3S = {
    "keepalive_time_ms": 3000,
    "keepalive_permit_without_calls": 1,
    "http2__max_pings_without_data": 0,
}


@pytest.mark.slow
async def test_keepalive_holds_quiet_connections_30s_with_and_without_client_keepalive(
    go_peer: Path, grpc_clients: GrpcioClients
) -> None:
    """Holds for 30 s with the production ping policy and a 12 s idle timeout.

    grpc-go at 10 s (with and without a stream), grpc-go asking for 3 s (it
    pings every 10 s), grpcio at ClusterD v26's 3 s (with and without a
    stream): none earns a strike, every stream stays open; a grpc-go stream
    without keepalive (FD-OL's way) stays open too, its heartbeats being its
    ACKs of the server's PINGs, and delivers after more than twice the idle timeout.
    """
    settings = local_settings(
        session=SessionSettings(idle_timeout=IDLE), keepalive=SERVER_KEEPALIVE
    )
    async with (
        trio.open_nursery() as nursery,
        open_jobsignal_server(settings) as server,
        AsyncExitStack() as stack,
    ):
        target = server.target

        async def go_peer_running(command: str, role: str, **flags: object) -> Peer:
            return await stack.enter_async_context(
                running(go(go_peer, command, target, role=role, **flags))
            )

        go_10s = await go_peer_running("subscribe", "CCAgent", count=1, keepalive="10s")
        go_3s = await go_peer_running("subscribe", "CCAgent", count=1, keepalive="3s")
        go_silent = await go_peer_running("subscribe", "DefaultUser1", count=1)
        go_no_stream = await go_peer_running(
            "register", "DefaultUser2", keepalive="10s", permit_without_stream=True, hold="31s"
        )
        grpcio_stream = grpc_clients.connect(target, **GRPCIO_3S)
        grpcio_id = await in_thread(grpcio_stream.register_id, "FdAgent")
        grpcio_events = GrpcioStream(grpcio_stream.subscribe("FdAgent", grpcio_id, timeout=60))
        grpcio_events.start(nursery)
        grpcio_no_stream = grpc_clients.connect(target, **GRPCIO_3S)
        await in_thread(grpcio_no_stream.register_id, "DefaultUser2")
        await wait_until(lambda: len(server.broadcaster.subscribers) == 4)
        await go_no_stream.wait_for(lambda p: bool(p.of("registered")), within=5, what="Register")
        quiet_from = trio.current_time()
        go_peers = (go_10s, go_3s, go_silent, go_no_stream)

        await trio.sleep(HOLD - (trio.current_time() - quiet_from))

        job = make_job(1)
        server.broadcaster.publish([job])
        for peer in (go_10s, go_3s, go_silent):
            await peer.wait_exit()
        await grpcio_events.wait_for(1)
        await go_no_stream.wait_exit(within=5)
        go_ports = {event["local"].rpartition(":")[2] for p in go_peers for event in p.of("dialed")}
        grpcio_connections = [
            protocol.activity
            for protocol in server.connections.protocols()
            if protocol.activity.peer.rpartition(":")[2] not in go_ports
        ]
        floods = server.connections.ping_floods
        idle_ends = server.broadcaster.stats.stream_ends["idle"]
        grpcio_stream_open = not grpcio_events.ended.is_set()

    assert floods == 0
    assert idle_ends == 0
    # Keepalive at 10 s, or the server's PINGs answered, hold streams and bare
    # connections past the 12 s idle timeout.
    assert quiet_pings(go_silent) == [], go_silent.describe()
    for peer in (go_10s, go_3s, go_silent):
        assert [s["jobId"] for s in peer.signals] == [job.job_id], peer.describe()
    assert go_no_stream.of("held")[0]["state"] == "READY", go_no_stream.describe()
    for peer in (go_10s, go_3s, go_no_stream):
        assert_no_goaway(peer)
        assert_stayed_ready(peer)
        pings = quiet_pings(peer)
        assert len(pings) >= 2, peer.describe()
        # grpc-go's floor: asking for 3 s still pings every 10 s.
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert all(gap > 9.5 for gap in gaps), (gaps, peer.describe())
    # grpcio at 3 s, with and without a stream: the same two connections all along
    # (no GOAWAY, no reconnect), pinging about ten times each.
    assert [stream.jobId for stream in grpcio_events.messages] == [job.job_id]
    assert grpcio_stream_open, (grpcio_events.code, grpcio_events.details)
    assert len(grpcio_connections) == 2, [a.peer for a in grpcio_connections]
    for activity in grpcio_connections:
        assert activity.pings_received >= 8, (activity.peer, activity.pings_received)
