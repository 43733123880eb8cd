"""Streams' sessions (`rpc.session.Sessions`): no task while idle, one while there
is something to write, every way a stream ends; and the handler's side
(`JobService._run_session`): outcomes, errors and cancellation cross either way.
The idle rule itself is in tests/rpc/test_idle.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import trio_asyncio
from grpclib.const import Status

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout import Broadcaster, EndReason, StreamKind
from jobsignal.fanout.snapshot import SLICE_JOBS
from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.service import JobService
from jobsignal.rpc.session import Session, Sessions, SessionSettings, StreamEnd, StreamRequest
from tests.support.factories import make_job
from tests.support.tasks import count_tasks

ROLE = "CCAgent"


class Client:
    """One subscriber's side: what it was sent, and how its stream ended."""

    def __init__(self, registry: Registry, *, direct: bool = True, peer: str = "peer") -> None:
        self.activity = ConnectionActivity(PingPolicy(), peer)
        self.client_id = registry.register(ROLE, trio.current_time(), address=self.activity.ip)
        self.direct = direct
        self.sent: list[bytes] = []
        self.batches = 0
        self.outcomes: list[StreamEnd | Exception] = []
        self.ended_at: float | None = None
        self.send_error: Exception | None = None
        self.hold = trio.Event()
        self.hold.set()

    def request(self) -> StreamRequest:
        return StreamRequest(
            StreamKind.SIGNAL,
            ROLE,
            self.client_id,
            self.activity,
            self.send,
            self.send_now if self.direct else None,
        )

    async def send(self, frames: list[bytes]) -> bool:
        await self.hold.wait()
        if self.send_error is not None:
            raise self.send_error
        self.batches += 1
        self.sent.extend(frames)
        return True

    def send_now(self, message: bytes) -> bool:
        self.sent.append(message)
        return True

    def done(self, outcome: StreamEnd | Exception) -> None:
        self.outcomes.append(outcome)
        self.ended_at = trio.current_time()


def registry() -> Registry:
    return Registry(roles=[ROLE], max_registrations=100, max_subscriptions_per_role=100, ttl=600)


@asynccontextmanager
async def running_sessions(
    settings: SessionSettings | None = None,
) -> AsyncIterator[Sessions]:
    async with trio.open_nursery() as nursery:
        sessions = Sessions(registry(), Broadcaster(), settings or SessionSettings())
        yield await nursery.start(sessions.run)
        nursery.cancel_scope.cancel()


def opened(sessions: Sessions, client: Client) -> Session:
    session = sessions.open(client.request(), client.done)
    assert isinstance(session, Session)
    return session


def assert_ended(sessions: Sessions, client: Client, reason: EndReason) -> None:
    (end,) = client.outcomes
    assert isinstance(end, StreamEnd) and end.reason is reason
    assert_released(sessions, client)


def assert_released(sessions: Sessions, client: Client) -> None:
    assert not sessions.broadcaster.subscribers
    assert sessions.registry.active_subscriptions() == 0
    assert not client.activity.heartbeat_listeners
    assert len(sessions) == 0


@pytest.mark.parametrize("direct", [True, False], ids=["from_publish", "task"])
async def test_an_idle_session_holds_no_task(
    autojump_clock: trio.testing.MockClock, direct: bool
) -> None:
    async with running_sessions() as sessions:
        await trio.testing.wait_all_tasks_blocked()
        tasks = count_tasks()
        clients = [Client(sessions.registry, direct=direct) for _ in range(20)]
        for client in clients:
            opened(sessions, client)
        await trio.testing.wait_all_tasks_blocked()
        assert count_tasks() == tasks
        sessions.broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        # Written, from publish or by a task that has returned since.
        assert all(len(client.sent) == 1 for client in clients)
        assert count_tasks() == tasks
        assert all(not client.outcomes for client in clients)


async def test_a_message_that_must_wait_is_written_by_a_task_that_then_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        await trio.testing.wait_all_tasks_blocked()
        tasks = count_tasks()
        client = Client(sessions.registry, direct=False)
        client.hold = trio.Event()  # the client reads nothing for now
        opened(sessions, client)
        sessions.broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        assert count_tasks() == tasks + 1  # the session's task, waiting to write
        sessions.broadcaster.publish([make_job(2), make_job(3)])  # queued behind it
        client.hold.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(client.sent) == 3
        assert client.batches == 2  # the first message, then the two queued meanwhile
        assert count_tasks() == tasks


async def test_a_refused_subscription_is_answered_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        client = Client(sessions.registry)
        request = client.request()
        unknown = StreamRequest(
            request.kind, request.role, "not-registered", request.activity, request.send
        )
        end = sessions.open(unknown, client.done)
        assert isinstance(end, StreamEnd) and end.reason is EndReason.REFUSED
        assert end.status is Status.FAILED_PRECONDITION
        assert client.outcomes == []
        assert sessions.broadcaster.stats.stream_ends[EndReason.REFUSED.value] == 1


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (EndReason.CLIENT_GONE, Status.CANCELLED),
        (EndReason.REPLACED, Status.ABORTED),
        (EndReason.SLOW, Status.RESOURCE_EXHAUSTED),
    ],
)
async def test_a_parked_session_ends_then_and_there(
    autojump_clock: trio.testing.MockClock, reason: EndReason, status: Status
) -> None:
    async with running_sessions() as sessions:
        client = Client(sessions.registry)
        start = trio.current_time()
        session = opened(sessions, client)
        await trio.sleep(30)
        assert sessions.broadcaster.subscribers  # subscribed, idle
        if reason is EndReason.CLIENT_GONE:
            session.client_gone()
        else:
            session.subscriber.end(reason)
        await trio.testing.wait_all_tasks_blocked()
        assert len(client.outcomes) == 1
        end = client.outcomes[0]
        assert isinstance(end, StreamEnd) and end.reason is reason and end.status is status
        assert trio.current_time() == pytest.approx(start + 30)
        assert sessions.broadcaster.stats.stream_ends[reason.value] == 1
        assert_released(sessions, client)


async def test_a_newer_subscription_replaces_the_older_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        client = Client(sessions.registry)
        opened(sessions, client)
        newer = opened(sessions, client)  # the same clientId again
        await trio.testing.wait_all_tasks_blocked()
        assert len(client.outcomes) == 1
        first_end = client.outcomes[0]
        assert isinstance(first_end, StreamEnd) and first_end.reason is EndReason.REPLACED
        assert sessions.broadcaster.subscribers == {newer.subscriber}


async def test_a_snapshot_is_composed_by_the_session_task_and_a_replacement_cuts_it_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    jobs = [make_job(i, hccl_json="{}") for i in range(3 * SLICE_JOBS)]
    async with running_sessions(SessionSettings(snapshot_roles=frozenset({ROLE}))) as sessions:
        sessions.broadcaster.publish(jobs)  # nobody subscribed: nothing encoded
        client = Client(sessions.registry)
        first = opened(sessions, client)
        assert first.subscriber.owes_snapshot  # opening it composed nothing
        await trio.lowlevel.checkpoint()  # its task's first slice
        assert first.subscriber.owes_snapshot and client.sent == []
        newer = opened(sessions, client)  # the same clientId again, mid-snapshot
        await trio.testing.wait_all_tasks_blocked()
        [end] = client.outcomes
        assert isinstance(end, StreamEnd) and end.reason is EndReason.REPLACED
        assert sessions.broadcaster.subscribers == {newer.subscriber}
        # Only the newer stream's snapshot was sent, whole, in publish order.
        assert [JobSummarySignal.parse(m).job_id for m in client.sent] == [j.job_id for j in jobs]


async def test_a_session_ends_while_its_task_waits_to_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        client = Client(sessions.registry, direct=False)
        client.hold = trio.Event()
        session = opened(sessions, client)
        sessions.broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        session.client_gone()  # cancels the waiting write
        await trio.testing.wait_all_tasks_blocked()
        assert client.sent == []
        assert_ended(sessions, client, EndReason.CLIENT_GONE)


async def test_an_error_in_one_session_ends_that_session_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        broken, healthy = Client(sessions.registry, direct=False), Client(sessions.registry)
        broken.send_error = ValueError("a bug in the send path")
        opened(sessions, broken)
        kept = opened(sessions, healthy)
        sessions.broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        assert len(broken.outcomes) == 1 and isinstance(broken.outcomes[0], ValueError)
        assert sessions.broadcaster.subscribers == {kept.subscriber}
        assert len(sessions) == 1
        sessions.broadcaster.publish([make_job(2)])
        await trio.testing.wait_all_tasks_blocked()
        assert len(healthy.sent) == 2 and not healthy.outcomes


async def test_sessions_still_open_when_the_server_stops_end_as_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, waiting = None, None
    async with running_sessions() as sessions:
        client = Client(sessions.registry)
        waiting = Client(sessions.registry, direct=False)
        waiting.hold = trio.Event()
        opened(sessions, client)  # parked
        opened(sessions, waiting)
        sessions.broadcaster.publish([make_job(1)])  # `waiting`'s task waits to write
        await trio.testing.wait_all_tasks_blocked()
    for each in (client, waiting):
        assert_ended(sessions, each, EndReason.SHUTDOWN)


async def test_idle_deadlines_of_many_sessions_each_come_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions(SessionSettings(idle_timeout=120)) as sessions:
        start = trio.current_time()
        clients: list[Client] = []
        for index in range(5):  # one every 10 s; three pinged later, at one time
            client = Client(sessions.registry, peer=f"peer-{index}")
            opened(sessions, client)
            clients.append(client)
            await trio.sleep(10)
        for index in (4, 1, 3):
            clients[index].activity.ping_received()
        pinged_at = trio.current_time()
        await trio.sleep(300)
    assert clients[0].ended_at == pytest.approx(start + 120)
    assert clients[2].ended_at == pytest.approx(start + 20 + 120)
    for index in (1, 3, 4):
        assert clients[index].ended_at == pytest.approx(pinged_at + 120)
    assert len(sessions) == 0


async def test_ended_sessions_do_not_pile_up_in_the_idle_heap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        for _ in range(1000):  # register, subscribe and go away, again and again
            opened(sessions, Client(sessions.registry)).client_gone()
            await trio.testing.wait_all_tasks_blocked()
        assert len(sessions) == 0
        assert len(sessions._deadlines) <= 64 + 1


# -- the handler's side ---------------------------------------------------------------------------


def job_service() -> JobService:
    return JobService(
        registry=registry(),
        broadcaster=Broadcaster(),
        settings=SessionSettings(),
        connections=ConnectionTable(PingPolicy()),
    )


@asynccontextmanager
async def serving(service: JobService) -> AsyncIterator[Sessions]:
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        sessions = Sessions(service.registry, service.broadcaster, service.settings)
        service.serve_sessions_with(await nursery.start(sessions.run))
        yield sessions
        nursery.cancel_scope.cancel()


async def in_handler(service: JobService, request: StreamRequest) -> StreamEnd:
    """`_run_session` in an asyncio task, as grpclib calls a handler."""
    end: StreamEnd = await trio_asyncio.aio_as_trio(service._run_session)(request)
    return end


async def test_the_handler_gets_the_sessions_end() -> None:
    service = job_service()
    async with serving(service) as sessions:
        client = Client(service.registry)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                ends: list[StreamEnd] = []

                async def handler() -> None:
                    ends.append(await in_handler(service, client.request()))

                nursery.start_soon(handler)
                while not sessions.broadcaster.subscribers:
                    await trio.lowlevel.checkpoint()
                sessions.broadcaster.end_all(EndReason.REPLACED)
        assert [end.reason for end in ends] == [EndReason.REPLACED]


async def test_an_error_in_a_session_reaches_its_handler_not_the_server() -> None:
    service = job_service()
    async with serving(service) as sessions:
        client = Client(service.registry, direct=False)
        client.send_error = ValueError("a bug in the session")
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:

                async def handler() -> None:
                    with pytest.raises(ValueError, match="a bug in the session"):
                        await in_handler(service, client.request())

                nursery.start_soon(handler)
                while not sessions.broadcaster.subscribers:
                    await trio.lowlevel.checkpoint()
                sessions.broadcaster.publish([make_job(2)])
        # The server's sessions live on and serve the next stream.
        other = Client(service.registry)
        refused = StreamRequest(
            StreamKind.SIGNAL, "NoSuchRole", other.client_id, other.activity, other.send
        )
        end = await in_handler(service, refused)
        assert end.reason is EndReason.REFUSED


async def test_a_cancelled_handler_tells_its_session_the_client_went_away() -> None:
    service = job_service()
    async with serving(service) as sessions:
        client = Client(service.registry)

        async def handler() -> None:
            task = asyncio.ensure_future(service._run_session(client.request()))
            while not sessions.broadcaster.subscribers:
                await asyncio.sleep(0)
            task.cancel()  # what grpclib does when the client resets the stream
            with pytest.raises(asyncio.CancelledError):
                await task

        with trio.fail_after(5):
            await trio_asyncio.aio_as_trio(handler)()
            while len(sessions):
                await trio.lowlevel.checkpoint()
        assert sessions.broadcaster.stats.stream_ends[EndReason.CLIENT_GONE.value] == 1
        assert_released(sessions, client)


async def test_a_session_ended_by_the_server_stopping_answers_its_handler() -> None:
    service = job_service()
    ends: list[StreamEnd] = []
    async with trio_asyncio.open_loop(), trio.open_nursery() as outer:
        client = Client(service.registry)

        async def handler() -> None:
            ends.append(await service._run_session(client.request()))

        async with trio.open_nursery() as server_nursery:
            sessions = await server_nursery.start(
                Sessions(service.registry, service.broadcaster, service.settings).run
            )
            service.serve_sessions_with(sessions)
            outer.start_soon(trio_asyncio.aio_as_trio(handler))
            with trio.fail_after(5):
                while not sessions.broadcaster.subscribers:
                    await trio.lowlevel.checkpoint()
            server_nursery.cancel_scope.cancel()  # the server stops
        with trio.fail_after(5):
            while not ends:
                await trio.lowlevel.checkpoint()
    assert [end.reason for end in ends] == [EndReason.SHUTDOWN]


def test_a_service_without_sessions_says_so() -> None:
    async def main() -> None:
        async with trio_asyncio.open_loop():
            client = Client(registry())
            with pytest.raises(RuntimeError, match="serve_sessions_with"):
                await in_handler(job_service(), client.request())

    trio.run(main)


async def test_snapshots_take_turns_and_a_client_that_does_not_read_holds_only_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """At most `Sessions.snapshots` sessions compose and write their snapshots at once
    (one here): the next waits for the turn, and gets its whole snapshot once the
    one before has written its own."""
    settings = SessionSettings(snapshot_roles=frozenset({ROLE}))
    async with running_sessions(settings) as sessions:
        sessions.broadcaster.publish([make_job(index) for index in range(3)])
        sessions.snapshots.total_tokens = 1
        stuck, waiting = Client(sessions.registry), Client(sessions.registry)
        stuck.hold = trio.Event()  # its client does not read: the write waits
        opened(sessions, stuck)
        await trio.testing.wait_all_tasks_blocked()
        opened(sessions, waiting)
        await trio.sleep(30)
        assert stuck.sent == [] and waiting.sent == []  # the turn is the stuck one's
        assert sessions.snapshots.borrowed_tokens == 1
        stuck.hold.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(stuck.sent) == 3 and len(waiting.sent) == 3
        assert sessions.snapshots.borrowed_tokens == 0
        sessions.broadcaster.publish([make_job(7)])  # live events after the snapshots
        await trio.testing.wait_all_tasks_blocked()
        assert len(stuck.sent) == len(waiting.sent) == 4


async def test_a_stream_owed_a_snapshot_is_up_once_the_snapshot_is_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream counts as up (`Broadcaster.streams_up`, what `jobsignal_subscribers`
    shows) only once the snapshot it is owed is written, however long its client
    takes to read it; one owed nothing (the cluster was empty) is up at once."""
    settings = SessionSettings(snapshot_roles=frozenset({ROLE}))
    key = (StreamKind.SIGNAL.value, ROLE)
    async with running_sessions(settings) as sessions:
        broadcaster = sessions.broadcaster
        opened(sessions, Client(sessions.registry))  # an empty cluster: nothing owed
        assert broadcaster.streams_up() == {key: 1}
        broadcaster.publish([make_job(index) for index in range(3)])
        late = Client(sessions.registry)
        late.hold = trio.Event()  # its client does not read yet: the write waits
        opened(sessions, late)
        await trio.sleep(60)
        assert len(broadcaster.subscribers) == 2
        assert broadcaster.streams_up() == {key: 1} and late.sent == []
        late.hold.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(late.sent) == 3
        assert broadcaster.streams_up() == {key: 2}
