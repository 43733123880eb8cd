"""Random answers of a hostile API server against the real watcher.

A raw HTTP/1.1 server on 127.0.0.1 answers the watcher's LISTs and WATCHes
with seeded random responses (tests/support/kube_fuzz.py), then turns
honest: every WATCH but one from its own LIST's version gets 410, every LIST
the same few ConfigMaps. What must hold whatever the API server sent:

- the watcher never ends, nothing is logged at ERROR (every fault is one
  that kube/api.py translates), no event fails to apply;
- once the server is honest, the store holds exactly what it lists.

Each seed runs twice: straight to the server over plain HTTP, and over TLS
through a CONNECT proxy of the tests' own (tests/support/proxy.py), the path
a cluster behind a proxy takes. Virtual time (`io_clock`); a failure names
its seed and path.
"""

from __future__ import annotations

import functools
import json
import random

import httpx
import pytest
import trio
import trio.testing
import trustme

from jobsignal.fanout import Broadcaster
from jobsignal.kube.api import KubeApi, open_kube_client
from jobsignal.kube.credentials import KubeConnection
from jobsignal.kube.watcher import Watcher, WatchSettings
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore
from tests.support.cluster import expected_summary
from tests.support.factories import clusterd_job
from tests.support.kube_fuzz import ResponseMaker, listed_configmap
from tests.support.proxy import open_proxy
from tests.support.tls import client_context, server_context
from tests.support.waiting import wait_until
from tests.support.watching import WALL

pytestmark = pytest.mark.usefixtures("nothing_logged_at_error")

HOSTILE_ANSWERS = 600
HONEST_VERSION = "100000"
HONEST_JOBS = [clusterd_job(f"j{index}") for index in (1, 3, 7)]


class FuzzedApiServer:
    """Random answers until `hostile` are spent, then an honest cluster."""

    def __init__(self, seed: int, hostile: int) -> None:
        self.maker = ResponseMaker(random.Random(seed))
        self.hostile = hostile
        self.honest_lists = 0

    async def serve(self, stream: trio.abc.Stream) -> None:
        try:
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    pending += data
                head, pending = pending.split(b"\r\n\r\n", 1)
                target = head.split(b"\r\n", 1)[0]
                if not await self._answer(stream, target):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _answer(self, stream: trio.abc.Stream, target: bytes) -> bool:
        watch = b"watch=1" in target
        if self.hostile <= 0:
            await self._honest(stream, target, watch)
            return True
        self.hostile -= 1
        answer = self.maker.answer(watch)
        await stream.send_all(answer.head)
        for part in answer.parts:  # each part in its own send: lines straddle reads
            await stream.send_all(part)
        return answer.keep_alive

    async def _honest(self, stream: trio.abc.Stream, target: bytes, watch: bool) -> None:
        if not watch:
            self.honest_lists += 1
            items = [
                listed_configmap(job.namespace, name, data, HONEST_VERSION)
                for job in HONEST_JOBS
                for name, data in job.configmaps("running")
            ]
            page = {"metadata": {"resourceVersion": HONEST_VERSION}, "items": items}
            body = json.dumps(page).encode()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            return
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        if f"resourceVersion={HONEST_VERSION}".encode() not in target:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
            line = json.dumps(gone).encode() + b"\n"
            await stream.send_all(f"{len(line):x}\r\n".encode() + line + b"\r\n0\r\n\r\n")
            return
        bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": HONEST_VERSION}}}
        line = json.dumps(bookmark).encode() + b"\n"
        while True:  # until the test ends
            await stream.send_all(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            await trio.sleep(30)


@pytest.mark.parametrize("path", ["direct", "proxy"])
@pytest.mark.parametrize("seed", range(1, 6))
async def test_whatever_the_api_server_sends_the_watcher_goes_on_and_recovers(
    io_clock: trio.testing.MockClock, ca: trustme.CA, seed: int, path: str
) -> None:
    server = FuzzedApiServer(seed, HOSTILE_ANSWERS)
    store, status = JobStore(), SourceStatus()
    # No backoff: each of its sleeps would cost io_clock a jump in real time.
    settings = WatchSettings(label_selector="a=b", backoff_initial=0.0, backoff_max=0.0)
    proxied = path == "proxy"
    async with trio.open_nursery() as nursery, open_proxy() as proxy:
        if proxied:
            tls = server_context(ca, client_certs=False)
            listeners = await nursery.start(
                functools.partial(trio.serve_ssl_over_tcp, server.serve, 0, tls, host="127.0.0.1")
            )
        else:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1")
            )
        socket = getattr(listeners[0], "transport_listener", listeners[0]).socket
        port = socket.getsockname()[1]
        connection = KubeConnection(
            base_url=f"{'https' if proxied else 'http'}://127.0.0.1:{port}",
            verify=client_context(ca, with_cert=False) if proxied else None,
            token_source=None,
            description="the fuzzed API server",
            default_namespace=None,
            proxy=proxy.url if proxied else None,
        )
        async with open_kube_client(connection, timeout=httpx.Timeout(10.0)) as client:
            api = KubeApi(client, None, read_timeout=60.0)
            watcher = Watcher(
                api,
                store,
                Broadcaster(jobs=store).publish,
                status,
                settings,
                wall_clock=lambda: WALL,
            )
            what = f"seed {seed} {path}"
            await nursery.start(watcher.run)
            await wait_until(lambda: server.honest_lists > 0, within=3600, what=what)
            expected = {
                expected_summary(job, "running").key: expected_summary(job, "running")
                for job in HONEST_JOBS
            }
            await wait_until(
                lambda: {job.key: job for job in store.live_jobs()} == expected,
                within=60,
                what=f"{what}: the store to hold the honest LIST",
            )
            counters = watcher.counters
            assert counters.apply_errors == 0, what
            # The hostile answers were seen as such, not all lost to one kind of fault.
            assert counters.errors > HOSTILE_ANSWERS // 4 and counters.events > 0, what
            # Every request of the proxied run went through the proxy's tunnels.
            assert bool(proxy.tunnels) == proxied, what
            nursery.cancel_scope.cancel()
