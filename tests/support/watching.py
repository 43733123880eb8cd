"""A Watcher against the emulator over real 127.0.0.1 HTTP, observed as a client would.

`SignalLog` subscribes to a Broadcaster before the watcher starts and decodes
every frame, so tests see exactly what a gRPC client would get;
`open_watcher` runs a Watcher (docs/architecture.md section 5) on an emulator
(directly, or through a proxy) and records every request it sends; `open_source` runs the source as
`jobsignal serve --kubeconfig` does (`run_source` on a kubeconfig's connection).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import trustme

from jobsignal._proto.job import JobSummarySignal
from jobsignal.app import choose_connection, run_source
from jobsignal.config import load_config
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.kube.api import MAX_LIST_PAGE_BYTES, KubeApi, TokenProvider, open_kube_client
from jobsignal.kube.credentials import KubeConnection
from jobsignal.kube.watcher import Credentials, Watcher, WatchSettings
from jobsignal.sim.emulator import KubeEmulator, open_emulator
from jobsignal.status import SourceStatus
from jobsignal.store import JobKey, JobStore, JobSummary

from .cluster import Cluster
from .events import Event, event_of, live_state
from .proxy import HttpProxy, open_proxy
from .tls import client_context, server_context
from .waiting import wait_until

#: The watcher's wall clock in the watcher tests: the deleteTime it stamps on
#: jobs whose ConfigMaps vanished without ClusterD's delete rewrite.
WALL = 1_800_000_000.0


class SignalLog:
    """A SubscribeJobSummarySignal subscriber on the Broadcaster, decoded."""

    def __init__(self, broadcaster: Broadcaster) -> None:
        self.subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "test", snapshot=True)
        self.events: list[Event] = []

    async def run(self) -> None:
        while True:
            for frame in await self.subscriber.next_batch(256):
                self.events.append(event_of(JobSummarySignal.parse(frame)))

    async def holds(self, expected: dict[JobKey, JobSummary], *, within: float = 30.0) -> None:
        """Wait until the subscriber holds exactly `expected` (a cluster's live jobs)."""
        await wait_until(
            lambda: self.live() == expected,
            within=within,
            what="the subscriber to hold the cluster's state",
        )

    def live(self) -> dict[JobKey, JobSummary]:
        return live_state(self.events)

    def jobs(self) -> list[JobSummary]:
        return [event.job for event in self.events]


@dataclass
class WatchHarness:
    emu: KubeEmulator
    watcher: Watcher
    store: JobStore
    broadcaster: Broadcaster
    status: SourceStatus
    log: SignalLog
    #: (trio time, "list" or "watch", query) of every request the watcher sent.
    sent: list[tuple[float, str, dict[str, str]]] = field(default_factory=list)

    async def watch_open(self, within: float = 10.0) -> None:
        """Wait until the watcher's WATCH is streaming."""
        with trio.fail_after(within):
            await self.emu.wait_open_watches(1)

    def sent_times(self, kind: str) -> list[float]:
        return [when for when, what, _ in self.sent if what == kind]

    async def caught_up(self, cluster: Cluster, timeout: float = 30.0) -> None:
        """Wait until the client's view is the cluster's, and the store's too."""
        expected = cluster.live()
        await self.log.holds(expected, within=timeout)
        assert {job.key: job for job in self.store.live_jobs()} == expected


@asynccontextmanager
async def open_watcher(
    emu: KubeEmulator,
    settings: WatchSettings | None = None,
    *,
    tokens: TokenProvider | None = None,
    credentials: Credentials | None = None,
    read_timeout: float = 90.0,
    max_page_bytes: int = MAX_LIST_PAGE_BYTES,
    rng: Callable[[], float] = lambda: 0.5,
    on_response: Callable[[httpx.Response], None] | None = None,
    on_publish: Callable[[Sequence[JobSummary]], None] | None = None,
    proxy: str | None = None,
    verify: ssl.SSLContext | None = None,
) -> AsyncIterator[WatchHarness]:
    """A Watcher on `emu` over real HTTP, observed through a Broadcaster subscriber;
    `on_publish` sees every batch of job events the watcher publishes, first.
    The client is `open_kube_client`'s, through `proxy` if given (`verify`: the
    SSLContext for an https emulator)."""
    settings = WatchSettings() if settings is None else settings
    store, status = JobStore(), SourceStatus()
    broadcaster = Broadcaster(jobs=store)

    def publish(jobs: Sequence[JobSummary], seen_at: float) -> None:
        if on_publish is not None:
            on_publish(jobs)
        broadcaster.publish(jobs, seen_at)

    sent: list[tuple[float, str, dict[str, str]]] = []

    async def record_request(request: httpx.Request) -> None:
        params = dict(request.url.params)
        kind = "watch" if params.get("watch") else "list"
        sent.append((trio.current_time(), kind, params))

    async def record_response(response: httpx.Response) -> None:
        if on_response is not None:
            on_response(response)

    raised: BaseException | None = None
    timeout = httpx.Timeout(10.0, read=read_timeout + 5)
    connection = KubeConnection(
        base_url=emu.url,
        verify=verify,
        token_source=None,
        description="the test's emulator",
        default_namespace=None,
        proxy=proxy,
    )
    async with (
        open_kube_client(connection, timeout=timeout) as client,
        trio.open_nursery() as nursery,
    ):
        client.event_hooks = {"request": [record_request], "response": [record_response]}
        api = KubeApi(client, tokens, read_timeout=read_timeout, max_page_bytes=max_page_bytes)
        watcher = Watcher(
            api,
            store,
            publish,
            status,
            settings,
            credentials=credentials,
            wall_clock=lambda: WALL,
            rng=rng,
        )
        log = SignalLog(broadcaster)
        nursery.start_soon(log.run)
        await nursery.start(watcher.run)
        harness = WatchHarness(emu, watcher, store, broadcaster, status, log, sent)
        try:
            yield harness
        except BaseException as exc:
            # Raised again below, outside the nursery that would wrap it in a group.
            raised = exc
        finally:
            nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised


@dataclass
class WatchPath:
    """How a test's watcher reaches its emulator: "direct" (plain HTTP) or
    "proxy" (TLS through a CONNECT proxy of the tests' own, as a cluster behind
    a proxy is reached)."""

    name: str
    ca: trustme.CA = field(default_factory=trustme.CA)
    #: The proxy of a "proxy" path, once `emulator` has opened it.
    proxy: HttpProxy | None = None

    @asynccontextmanager
    async def emulator(self, **options: Any) -> AsyncIterator[KubeEmulator]:
        """`open_emulator(**options)`, over TLS on the proxy path (and the proxy with it)."""
        if self.name == "direct":
            async with open_emulator(**options) as emu:
                yield emu
            return
        tls = server_context(self.ca, client_certs=False)
        async with open_proxy() as proxy, open_emulator(ssl_context=tls, **options) as emu:
            self.proxy = proxy
            yield emu

    def watcher(
        self, emu: KubeEmulator, **options: Any
    ) -> AbstractAsyncContextManager[WatchHarness]:
        """`open_watcher(emu, **options)`, through the proxy on the proxy path."""
        if self.proxy is None:
            return open_watcher(emu, **options)
        verify = client_context(self.ca, with_cert=False)
        return open_watcher(emu, proxy=self.proxy.url, verify=verify, **options)

    def check_carried(self) -> None:
        """On the proxy path, that the proxy carried the watcher's requests."""
        if self.proxy is not None:
            assert self.proxy.tunnels, "no request went through the proxy"


@dataclass
class Source:
    """A running `run_source`, observed through a Broadcaster subscriber."""

    store: JobStore
    broadcaster: Broadcaster
    status: SourceStatus
    log: SignalLog
    watcher: Watcher
    #: Exceptions that ended run_source (it must never end on its own).
    crashes: list[BaseException] = field(default_factory=list)

    async def holds(self, cluster: Cluster, timeout: float = 30.0) -> None:
        """Wait until the subscriber holds exactly the cluster's live jobs."""
        await self.log.holds(cluster.live(), within=timeout)


@asynccontextmanager
async def open_source(
    kubeconfig: Path, *, tolerate_crash: bool = False, **flags: str
) -> AsyncIterator[Source]:
    """run_source on the cluster a kubeconfig names, as `jobsignal serve` would."""
    config = load_config(
        {"kubeconfig": str(kubeconfig), "source": "kubernetes", **flags},
        {},
    )
    connection = choose_connection(config, {})
    assert connection is not None
    store, status = JobStore(), SourceStatus()
    broadcaster = Broadcaster(jobs=store)
    log = SignalLog(broadcaster)
    crashes: list[BaseException] = []

    async def guarded(task_status: trio.TaskStatus[Watcher]) -> None:
        try:
            await run_source(
                config, connection, store, broadcaster, status, task_status=task_status
            )
        except Exception as exc:
            crashes.append(exc)
            if not tolerate_crash:
                raise

    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.run)
        watcher: Watcher = await nursery.start(guarded)
        yield Source(store, broadcaster, status, log, watcher, crashes)
        nursery.cancel_scope.cancel()
