"""The subscriptions page in a real browser: Debian's Chromium, headless.

Chromium loads the page of a real server with real grpcio subscribers. After
its script ran, the rendered table lists them (`--dump-dom`); a screenshot
shows the table (its pixels: the header band, one rule under each row, the
stripes, text in each row); and the page updates itself in place: a stream
that ends between the load and the first refresh is gone from the table the
refresh brings (Chromium's virtual time runs the page's timers at once).
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import trio
from prometheus_client import CollectorRegistry

from jobsignal.app import subscriptions_now
from jobsignal.fanout import EndReason
from jobsignal.metrics_server import run_metrics_server
from jobsignal.rpc.subscriptions import PageRequest, SubscriptionPage
from jobsignal.subscriptions_page import HEADERS, REFRESH_SECONDS
from tests.support.chromium import run_chromium
from tests.support.grpcio import GrpcioClients
from tests.support.png import Image, read_png
from tests.support.subscriptions import SubscribedServer, open_subscribed_server, table_rows

WIDTH, HEIGHT = 1300, 320
# The page's colours (subscriptions_page._STYLE).
HEADER_BAND = (0xEE, 0xF1, 0xF4)
ROW_RULE = (0xD1, 0xD9, 0xE0)
STRIPE = (0xF6, 0xF8, 0xFA)


def columns_of(subscribed: SubscribedServer, *, without: str = "") -> list[list[str]]:
    return [
        [s.short_id, s.role, s.rpc.removeprefix("SubscribeJobSummary")]
        for s in subscribed.subscriptions
        if s.client_id != without
    ]


def refreshes(document: str) -> int:
    found = re.search(r'<body[^>]* data-refreshes="(\d+)"', document)
    assert found is not None, "the page's body lost its refresh count"
    return int(found.group(1))


def bands(image: Image, colour: tuple[int, int, int], min_run: int) -> list[range]:
    """Runs of consecutive rows with at least `min_run` pixels of `colour`."""
    found: list[range] = []
    for y in range(image.height):
        if image.count(y, colour) >= min_run:
            if found and found[-1].stop == y:
                found[-1] = range(found[-1].start, y + 1)
            else:
                found.append(range(y, y + 1))
    return found


async def test_the_page_in_chromium(tmp_path: Path, grpc_clients: GrpcioClients) -> None:
    async with open_subscribed_server(tmp_path, grpc_clients) as subscribed:
        url = f"http://127.0.0.1:{subscribed.metrics_port}/"

        dom = (await run_chromium(url, tmp_path / "dom", "--dump-dom")).decode()
        header, *rows = table_rows(dom)
        assert header == list(HEADERS)
        assert [row[:3] for row in rows] == columns_of(subscribed)
        assert all(row[7] == "team-a/3b1f0c1e-5d2a-4c59-9a57-0f2d3b1c4e77" for row in rows)

        shot = tmp_path / "page.png"
        await run_chromium(
            url, tmp_path / "shot", f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}"
        )
        image = read_png(await trio.Path(shot).read_bytes())
        assert (image.width, image.height) == (WIDTH, HEIGHT)
        # The table is some 800 pixels wide: its header band, then a 1-pixel rule
        # under each of the 3 rows, the second row striped.
        (header_band,) = bands(image, HEADER_BAND, 600)
        rules = bands(image, ROW_RULE, 600)
        assert len(rules) == 3 and all(len(rule) == 1 for rule in rules)
        assert header_band.stop <= rules[0].start
        (stripe,) = bands(image, STRIPE, 600)
        assert rules[0].stop <= stripe.start and stripe.stop <= rules[1].start + 1
        # Text in every row: dark pixels between one rule and the next.
        for top, bottom in zip([header_band, *rules], rules, strict=False):
            dark = sum(
                1
                for y in range(top.stop, bottom.start)
                for pixel in image.rows[y]
                if sum(pixel) < 3 * 110
            )
            assert dark > 200, f"no text between rows {top} and {bottom}"
        # Above the table: the title (dark text on white).
        assert any(sum(p) < 3 * 110 for y in range(header_band.start) for p in image.rows[y])

        await _refreshes_in_place(subscribed, tmp_path)


async def _refreshes_in_place(subscribed: SubscribedServer, tmp_path: Path) -> None:
    """A metrics port whose pages are the server's own, except that the stream of
    `victim` ends (as the idle rule ends one) just before the page's first refresh
    is read: the load shows 3 rows, the refresh 2."""
    victim = subscribed.subscriptions[1]
    (session,) = [
        s for s in subscribed.sessions.live_after(0) if s.request.client_id == victim.client_id
    ]
    pages_read = 0

    def pages(request: PageRequest) -> SubscriptionPage:
        nonlocal pages_read
        pages_read += 1
        if pages_read == 2:  # the first refresh
            session.subscriber.end(EndReason.IDLE)
            session.finish()
        return subscriptions_now(subscribed.sessions, request)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: run_metrics_server(
                "127.0.0.1",
                0,
                CollectorRegistry(),
                subscriptions=pages,
                task_status=task_status,
            )
        )
        budget = int(1000 * REFRESH_SECONDS * 1.5)  # one refresh, in virtual time
        dom = await run_chromium(
            f"http://127.0.0.1:{port}/",
            tmp_path / "refresh",
            "--dump-dom",
            f"--virtual-time-budget={budget}",
        )
        nursery.cancel_scope.cancel()
    document = dom.decode()
    assert pages_read == 2 and refreshes(document) == 1
    assert [row[:3] for row in table_rows(document)[1:]] == columns_of(
        subscribed, without=victim.client_id
    )
    assert "2 live subscriptions" in document
    code, details = await victim.stream.wait_end()
    assert code == grpc.StatusCode.UNAVAILABLE and details is not None
    assert details.startswith("idle for")
