"""Who is subscribed, over the metrics port: `/debug/subscriptions`, the page at
`/` and `jobsignal clients` list a real server's grpcio subscribers as they are,
page by page, with client ids only as short hashes. The page in a real browser
is tests/test_subscriptions_browser.py; the view itself tests/rpc/test_subscriptions.py.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
from functools import partial
from pathlib import Path

import httpx
import trio
from prometheus_client import CollectorRegistry

from jobsignal.app import subscriptions_now
from jobsignal.fanout import Broadcaster
from jobsignal.metrics_server import route, run_metrics_server
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.session import Sessions, SessionSettings
from jobsignal.rpc.subscriptions import PageRequest, SubscriptionPage, SubscriptionRow
from jobsignal.store.model import JobKey
from jobsignal.subscriptions_page import HEADERS, cells
from jobsignal.util.text import human_bytes
from tests.support.grpcio import GrpcioClients
from tests.support.subscriptions import (
    JOB,
    SubscribedServer,
    open_subscribed_server,
    table_rows,
)
from tests.support.waiting import wait_until
from tests.test_cli_ux import jobsignal


async def get(port: int, target: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{port}{target}", headers=headers)


def expected_columns(subscribed: SubscribedServer) -> list[list[str]]:
    """ID, ROLE, RPC of each subscriber, in the order they subscribed."""
    return [
        [s.short_id, s.role, s.rpc.removeprefix("SubscribeJobSummary")]
        for s in subscribed.subscriptions
    ]


def assert_no_whole_id(text: str, subscribed: SubscribedServer) -> None:
    for subscription in subscribed.subscriptions:
        assert subscription.client_id not in text
        assert subscription.client_id.replace("-", "") not in text


async def test_the_json_lists_every_subscriber_as_it_is(
    tmp_path: Path, grpc_clients: GrpcioClients
) -> None:
    async with open_subscribed_server(tmp_path, grpc_clients) as subscribed:
        response = await get(subscribed.metrics_port, "/debug/subscriptions")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.headers["cache-control"] == "no-store"
        page = response.json()
        assert (page["kind"], page["total"], page["continue"]) == ("SubscriptionList", 3, None)
        items = page["items"]
        assert [item["id"] for item in items] == [s.short_id for s in subscribed.subscriptions]
        for item, subscription in zip(items, subscribed.subscriptions, strict=True):
            assert (item["role"], item["rpc"]) == (subscription.role, subscription.rpc)
            assert re.fullmatch(r"127\.0\.0\.1:\d+", item["peer"])
            assert item["messagesSent"] == subscription.messages_sent
            assert (item["messagesQueued"], item["bytesQueued"]) == (0, 0)
            last = item["lastMessage"]
            assert (last["namespace"], last["jobId"]) == (JOB.namespace, JOB.uid)
            assert 0 <= last["ageSeconds"] <= item["connectedSeconds"] < 60
            assert item["connectedAt"].endswith("Z")
        # Three connections: three peers.
        assert len({item["peer"] for item in items}) == 3
        assert_no_whole_id(response.text, subscribed)

        # Paged: one at a time, each page names where the next starts.
        walked: list[str] = []
        target = "/debug/subscriptions?limit=1"
        for _ in range(4):  # (a walk that never ends fails, not hangs)
            page = (await get(subscribed.metrics_port, target)).json()
            assert len(page["items"]) <= 1 and page["limit"] == 1
            walked += [item["id"] for item in page["items"]]
            if page["continue"] is None:
                break
            target = f"/debug/subscriptions?limit=1&continue={page['continue']}"
        assert walked == [s.short_id for s in subscribed.subscriptions]

        # A subscriber that hangs up is gone from the list.
        gone = subscribed.subscriptions[1]
        gone.call.cancel()
        await wait_until(lambda: len(subscribed.sessions) == 2)
        page = (await get(subscribed.metrics_port, "/debug/subscriptions")).json()
        assert gone.short_id not in [item["id"] for item in page["items"]]
        assert page["total"] == 2


async def test_jobsignal_clients_prints_them_following_the_pages(
    tmp_path: Path, grpc_clients: GrpcioClients
) -> None:
    async with open_subscribed_server(tmp_path, grpc_clients) as subscribed:
        target = subscribed.metrics_target
        done = await jobsignal("clients", "--target", target, "--chunk-size", "2")
        assert done.returncode == 0, done.stderr
        output = done.stdout.decode()
        header, *lines = output.splitlines()
        assert header.split() == [word for name in HEADERS for word in name.split()]
        rows = [line.split() for line in lines]
        assert [row[:3] for row in rows] == expected_columns(subscribed)
        for row, subscription in zip(rows, subscribed.subscriptions, strict=True):
            assert re.fullmatch(r"127\.0\.0\.1:\d+", row[3])
            assert row[5:8] == [str(subscription.messages_sent), "0B", f"{JOB.namespace}/{JOB.uid}"]
            assert re.fullmatch(r"\d+s", row[4]) and re.fullmatch(r"\d+s", row[8])
        assert_no_whole_id(output, subscribed)

        bare = await jobsignal("clients", "--target", target, "--no-headers", "--chunk-size", "1")
        assert bare.returncode == 0
        assert [line.split()[:3] for line in bare.stdout.decode().splitlines()] == (
            expected_columns(subscribed)
        )

        # The gRPC port is not the metrics port: said, exit 1.
        wrong = await jobsignal("clients", "--target", f"127.0.0.1:{subscribed.server.port}")
        assert wrong.returncode == 1 and wrong.stdout == b""
        assert b"--metrics-listen" in wrong.stderr


async def test_no_subscribers_pages_that_never_end_and_no_server() -> None:
    async with trio.open_nursery() as nursery:
        registry = Registry(
            roles=["CCAgent"], max_registrations=1, max_subscriptions_per_role=1, ttl=1
        )
        sessions = await nursery.start(Sessions(registry, Broadcaster(), SessionSettings()).run)

        def endless(request: PageRequest) -> SubscriptionPage:
            # A server answering every page with the same row and the same token.
            return SubscriptionPage(request, [hostile_row()], 9, 1, 1_800_000_000.0)

        ports = [
            await nursery.start(
                partial(run_metrics_server, subscriptions=source),
                "127.0.0.1",
                0,
                CollectorRegistry(),
            )
            for source in (partial(subscriptions_now, sessions), endless)
        ]
        empty = await jobsignal("clients", "--target", f"127.0.0.1:{ports[0]}")
        assert (empty.returncode, empty.stdout, empty.stderr) == (0, b"", b"No subscriptions.\n")
        looping = await jobsignal("clients", "--target", f"127.0.0.1:{ports[1]}")
        assert looping.returncode == 1 and looping.stdout == b""
        assert b"the pages do not end" in looping.stderr
        nursery.cancel_scope.cancel()

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    refused = await jobsignal("clients", "--target", f"127.0.0.1:{port}")
    assert refused.returncode == 1 and refused.stdout == b""
    assert refused.stderr.startswith(b"jobsignal clients: cannot ask http://127.0.0.1:")
    usage = await jobsignal("clients", "--target", "nowhere")
    assert usage.returncode == 2 and b"--target" in usage.stderr
    chunk = await jobsignal("clients", "--target", "127.0.0.1:1", "--chunk-size", "0")
    assert chunk.returncode == 2


async def test_the_page_shows_the_same_rows(tmp_path: Path, grpc_clients: GrpcioClients) -> None:
    async with open_subscribed_server(tmp_path, grpc_clients) as subscribed:
        response = await get(subscribed.metrics_port, "/", **{"accept-encoding": "identity"})
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        header, *rows = table_rows(response.text)
        assert header == list(HEADERS)
        assert [row[:3] for row in rows] == expected_columns(subscribed)
        assert "3 live subscriptions" in response.text
        assert_no_whole_id(response.text, subscribed)
        paged = await get(subscribed.metrics_port, "/?limit=2")
        assert 'href="?limit=2&amp;continue=' in paged.text
        assert len(table_rows(paged.text)) == 1 + 2


# -- the routes, without a server ---------------------------------------------------------


def one_page(request: PageRequest, rows: list[SubscriptionRow] | None = None) -> SubscriptionPage:
    return SubscriptionPage(request, rows or [], len(rows or []), None, 1_800_000_000.0)


def hostile_row() -> SubscriptionRow:
    return SubscriptionRow(
        id="0123abcd",
        role="<b>Role</b>",
        rpc="SubscribeJobSummarySignal",
        peer='1.2.3.4:5"onmouseover="x',
        connected_at=1_800_000_000.0,
        connected_seconds=75,
        messages_sent=3,
        messages_queued=1,
        bytes_queued=2048,
        last_job=JobKey("ns", "<script>alert(1)</script>"),
        last_message_seconds=4,
    )


def test_the_routes_need_a_source_and_a_good_query() -> None:
    registry = CollectorRegistry()
    for target in (b"/", b"/debug/subscriptions"):
        assert route(b"GET", target, registry).status == 404
    asked: list[PageRequest] = []

    def source(request: PageRequest) -> SubscriptionPage:
        asked.append(request)
        return one_page(request)

    ok = route(b"GET", b"/debug/subscriptions?limit=5&continue=9", registry, subscriptions=source)
    assert ok.status == 200 and asked == [PageRequest(5, 9)]
    bad = route(b"GET", b"/debug/subscriptions?limit=0", registry, subscriptions=source)
    assert bad.status == 400 and b"limit" in bad.body and len(asked) == 1
    head = route(b"HEAD", b"/", registry, subscriptions=source)
    assert head.status == 200 and head.body.startswith(b"<!doctype html>")
    assert route(b"POST", b"/", registry, subscriptions=source).status == 405
    assert b"/debug/subscriptions" in route(b"GET", b"/x", registry, subscriptions=source).body
    zipped = route(b"GET", b"/", registry, subscriptions=source, accept_encoding="gzip")
    assert dict(zipped.headers)["content-encoding"] == "gzip"
    assert gzip.decompress(zipped.body) == route(b"GET", b"/", registry, subscriptions=source).body


def test_the_page_escapes_what_peers_and_configmaps_wrote() -> None:
    def source(request: PageRequest) -> SubscriptionPage:
        return one_page(request, [hostile_row()])

    reply = route(b"GET", b"/", CollectorRegistry(), subscriptions=source)
    document = reply.body.decode()
    assert "<script>alert" not in document and "<b>" not in document
    assert '"onmouseover' not in document
    (row,) = table_rows(document)[1:]
    assert row == [
        "0123abcd",
        "<b>Role</b>",
        "Signal",
        '1.2.3.4:5"onmouseover="x',
        "75s",
        "3",
        "2.0KiB",
        "ns/<script>alert(1)</script>",
        "4s",
    ]
    data = json.loads(
        route(b"GET", b"/debug/subscriptions", CollectorRegistry(), subscriptions=source).body
    )
    assert data["items"][0]["lastMessage"]["jobId"] == "<script>alert(1)</script>"


def test_the_page_allows_only_its_own_script_and_style() -> None:
    reply = route(
        b"GET", b"/", CollectorRegistry(), subscriptions=lambda r: one_page(r, [hostile_row()])
    )
    headers = dict(reply.headers)
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    document = reply.body.decode()
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (inline,) = re.findall(rf"<{tag}>(.*?)</{tag}>", document, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert re.search(rf"{directive} 'sha256-{re.escape(digest)}';", policy)
    # Nothing else is loaded: no src or external link, no inline handlers.
    assert not re.search(r"\s(src|on\w+)=|<link|https?://", document)
    assert headers["x-content-type-options"] == "nosniff"


def test_sizes_and_odd_items_in_the_table() -> None:
    sizes = {0: "0B", 1023: "1023B", 1024: "1.0KiB", 1536: "1.5KiB", 5 << 20: "5.0MiB"}
    assert {count: human_bytes(count) for count in sizes} == sizes
    assert human_bytes(3 << 30) == "3.0GiB"
    # A server of another version: missing or mistyped fields show as <unknown>,
    # blanks and control characters cannot break the columns.
    odd = {"id": 7, "role": "a b\x1b[2J", "messagesSent": "3", "lastMessage": "x"}
    assert cells(odd) == [
        "<unknown>",
        "a?b?[2J",
        "<unknown>",
        "<unknown>",
        "<unknown>",
        "<unknown>",
        "<unknown>",
        "<unknown>",
        "<unknown>",
    ]
    never = {"lastMessage": None, "messagesSent": True, "bytesQueued": 10}
    assert cells(never)[5:] == ["<unknown>", "10B", "<none>", "<none>"]
