"""Who is subscribed (`rpc.subscriptions`): each row as the stream is, in virtual
time; pages that walk every live stream once while streams come and go; the
page query; client ids shown only as a short hash."""

from __future__ import annotations

import hashlib
import json

import pytest
import trio
import trio.testing

from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.session import Session, Sessions, SessionSettings, StreamRequest
from jobsignal.rpc.subscriptions import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    BadPageRequest,
    PageRequest,
    SubscriptionPage,
    short_id,
    subscriptions_page,
)
from tests.rpc.test_sessions import ROLE, Client, opened, running_sessions
from tests.support.factories import make_job

WALL = 1_800_000_000.0  # the Unix time the tests read pages at


def page_now(sessions: Sessions, request: PageRequest | None = None) -> SubscriptionPage:
    return subscriptions_page(
        sessions, request or PageRequest(), now=trio.current_time(), wall_now=WALL
    )


def list_request(client: Client) -> StreamRequest:
    request = client.request()
    return StreamRequest(
        StreamKind.LIST, request.role, request.client_id, request.activity, request.send
    )


async def test_a_row_is_the_stream_as_it_is_now(autojump_clock: trio.testing.MockClock) -> None:
    async with running_sessions() as sessions:
        reader = Client(sessions.registry, peer="10.0.0.1:4000")
        stuck = Client(sessions.registry, peer="10.0.0.2:5000", direct=False)
        stuck.hold = trio.Event()  # its sends wait: what it is owed stays queued
        opened_at = trio.current_time()
        opened(sessions, reader)
        await trio.sleep(5)
        opened(sessions, stuck)
        (row,) = [r for r in page_now(sessions).rows if r.id == short_id(reader.client_id)]
        assert row.messages_sent == 0 and row.last_message_seconds is None
        assert row.last_job is None

        await trio.sleep(10)
        first, second = make_job(1), make_job(2)
        sessions.broadcaster.publish([first])
        await trio.testing.wait_all_tasks_blocked()
        sessions.broadcaster.publish([second])
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(3)
        sessions.broadcaster.publish([first])  # one more for the stuck one's queue
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(2)

        page = page_now(sessions)
        assert page.total == 2 and page.next_after is None
        by_id = {row.id: row for row in page.rows}
        assert [row.id for row in page.rows] == [
            short_id(reader.client_id),
            short_id(stuck.client_id),
        ]

        row = by_id[short_id(reader.client_id)]
        assert (row.role, row.rpc, row.peer) == (ROLE, "SubscribeJobSummarySignal", "10.0.0.1:4000")
        assert row.connected_seconds == pytest.approx(trio.current_time() - opened_at)
        assert row.connected_at == pytest.approx(WALL - row.connected_seconds)
        assert row.messages_sent == len(reader.sent) == 3
        assert row.last_job == first.key
        assert row.last_message_seconds == pytest.approx(2)
        assert (row.messages_queued, row.bytes_queued) == (0, 0)

        # The stuck one took its first message and waits to send it: the
        # other two are queued, and nothing counts as sent yet.
        held = by_id[short_id(stuck.client_id)]
        assert held.messages_sent == 0 and held.last_message_seconds is None
        assert held.peer == "10.0.0.2:5000"
        assert held.messages_queued == 2
        assert held.bytes_queued == sum(len(frame) for frame in reader.sent[1:])

        stuck.hold.set()
        await trio.testing.wait_all_tasks_blocked()
        held = next(r for r in page_now(sessions).rows if r.id == short_id(stuck.client_id))
        assert (held.messages_sent, held.messages_queued, held.bytes_queued) == (3, 0, 0)
        assert held.last_job == first.key and held.last_message_seconds == 0


async def test_a_list_snapshot_batch_names_no_single_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        sessions.broadcaster.publish([make_job(1), make_job(2)])
        client = Client(sessions.registry, direct=False)
        session = sessions.open(list_request(client), client.done)
        assert isinstance(session, Session)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1)
        (row,) = page_now(sessions).rows
        assert row.rpc == "SubscribeJobSummarySignalList"
        assert row.messages_sent == 1  # one batch of both jobs
        assert row.last_job is None and row.last_message_seconds == 1
        assert row.as_json()["lastMessage"] == {"namespace": None, "jobId": None, "ageSeconds": 1}

        job = make_job(3)
        sessions.broadcaster.publish([job])  # a live change: a list of one
        await trio.testing.wait_all_tasks_blocked()
        (row,) = page_now(sessions).rows
        assert row.messages_sent == 2 and row.last_job == job.key
        assert row.as_json()["lastMessage"] == {
            "namespace": job.namespace,
            "jobId": job.job_id,
            "ageSeconds": 0,
        }


async def test_pages_walk_every_stream_once_while_streams_come_and_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        clients = [Client(sessions.registry) for _ in range(7)]
        live = {short_id(c.client_id): opened(sessions, c) for c in clients}
        order = list(live)

        first = page_now(sessions, PageRequest(limit=3))
        assert [row.id for row in first.rows] == order[:3]
        assert first.total == 7 and first.continue_token is not None
        # Meanwhile one listed stream and one not yet listed end, and one opens.
        for gone in (order[1], order[4]):
            live[gone].client_gone()
        newcomer = Client(sessions.registry)
        opened(sessions, newcomer)
        await trio.testing.wait_all_tasks_blocked()

        walked = [row.id for row in first.rows]
        request = PageRequest.parse(f"limit=3&continue={first.continue_token}")
        for _ in range(6):  # (a walk that never ends fails, not hangs)
            page = page_now(sessions, request)
            assert len(page.rows) <= 3 and page.total == 6
            walked += [row.id for row in page.rows]
            if page.continue_token is None:
                break
            request = PageRequest.parse(request.query(page.next_after))
        expected = [*order[:3], order[3], *order[5:], short_id(newcomer.client_id)]
        assert walked == expected


async def test_a_page_is_bounded_however_many_streams(
    autojump_clock: trio.testing.MockClock,
) -> None:
    many = Registry(roles=[ROLE], max_registrations=1000, max_subscriptions_per_role=1000, ttl=600)
    async with trio.open_nursery() as nursery:
        sessions = await nursery.start(Sessions(many, Broadcaster(), SessionSettings()).run)
        for _ in range(MAX_LIMIT + 5):
            opened(sessions, Client(sessions.registry))
        asked = PageRequest.parse(f"limit={MAX_LIMIT * 10}")
        assert asked.limit == MAX_LIMIT
        page = page_now(sessions, asked)
        assert len(page.rows) == MAX_LIMIT and page.total == MAX_LIMIT + 5
        rest = page_now(sessions, PageRequest(MAX_LIMIT, page.next_after or 0))
        assert len(rest.rows) == 5 and rest.next_after is None
        assert len(json.dumps(page.as_json())) < MAX_LIMIT * 700
        nursery.cancel_scope.cancel()


async def test_client_ids_are_shown_only_as_a_short_hash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_sessions() as sessions:
        clients = [Client(sessions.registry) for _ in range(3)]
        for client in clients:
            opened(sessions, client)
        sessions.broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        text = json.dumps(page_now(sessions).as_json())
        for client in clients:
            digest = hashlib.sha256(client.client_id.encode()).hexdigest()
            assert short_id(client.client_id) == digest[:8]
            assert f'"id": "{digest[:8]}"' in text
            # Neither the id nor any 9 characters of it in a row.
            assert not any(
                client.client_id[i : i + 9] in text for i in range(len(client.client_id) - 8)
            )


@pytest.mark.parametrize(
    ("query", "limit", "after"),
    [
        ("", DEFAULT_LIMIT, 0),
        ("limit=7", 7, 0),
        ("limit=7&continue=42", 7, 42),
        ("continue=42&limit=7&limit=9", 7, 42),  # the first of each counts
        (f"limit={MAX_LIMIT + 1}", MAX_LIMIT, 0),
        ("limit=999999", MAX_LIMIT, 0),
        ("other=1&limit=2", 2, 0),
        ("continue=", DEFAULT_LIMIT, 0),
    ],
)
def test_page_query(query: str, limit: int, after: int) -> None:
    request = PageRequest.parse(query)
    assert (request.limit, request.after) == (limit, after)
    assert PageRequest.parse(request.query()) == request


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=-1",
        "limit=abc",
        "limit=1e3",
        "limit=１２",  # fullwidth digits: isdigit() says yes, int() takes them
        "limit=1234567",
        "continue=abc",
        "continue=-5",
        "continue=" + "9" * 20,
        "&".join(f"p{i}=1" for i in range(17)),
    ],
)
def test_a_bad_page_query_is_refused(query: str) -> None:
    with pytest.raises(BadPageRequest):
        PageRequest.parse(query)
